"""Countdown on device: exact equation evaluation and RAGEN's 0 / 0.1 / 1 scoring, as pure JAX.

RAGEN's reference (``ragen/env/countdown/env.py``), applied to the action string (the first non-empty
``"||"``-separated piece of the answer, stripped):

- ``check_format``: the integers of ``re.findall(r"\\d+", action)`` (maximal digit runs) equal the
  task's numbers as a multiset. Otherwise reward 0.
- ``check_correctness``: ``eval(action, {"__builtins__": None}, {})`` succeeds and
  ``abs(result - target) < 1e-5``. Then reward 1.0 (success), else the format score 0.1.

The device evaluator implements the arithmetic part of Python's expression grammar: integer literals,
binary ``+ - * /`` (``/`` is true division), unary ``+ -`` (any number, e.g. ``2*-3``, ``--3``),
parentheses, and whitespace as Python's tokenizer treats it (space, tab and form feed anywhere; newline
and carriage return only inside parentheses). It agrees with Python's ``eval`` on every string over
those characters that has no ``**`` or ``//``, including Python's syntax errors (``3 5``, ``()``,
``(1)(2)``, ``01`` (a leading zero), trailing operators, unbalanced parentheses) and
``ZeroDivisionError``. Where it cannot agree, it fails safe (reports "not evaluable", never a value
Python would not give):

- other Python syntax: ``**``, ``//``, ``%``, ``~``, bit and comparison operators, float / complex /
  hex literals, ``_`` in literals, keywords, ``#`` comments, ``\\`` line continuations, any other byte.
  RAGEN's reward can be 1.0 on such strings (if Python's result hits the target); ours is 0.1.
- integers beyond int32: a literal or intermediate numerator / denominator past 2**31 - 1 sets
  ``overflow``. Values are exact rationals ``num / den`` with no reduction, and a subexpression over the
  literal set S satisfies ``max(|num|, den) <= 2**(|S|-1) * prod(S)``; for Countdown's 3-4 numbers of at
  most 99 that is <= 8 * 99**4 < 2**30, so every scored equation is evaluated exactly.
- parenthesis nesting beyond ``max_depth`` (default N // 2, enough for every valid string of N bytes;
  the Countdown env uses 16 for speed) is reported as a syntax error; Python allows 200 levels.
- the target test is exact: ``|num/den - t| < 1e-5`` decided with integer arithmetic. Python tests the
  float64 of the result, which is within ~1e-13 of the exact value, so the two differ only if the exact
  distance is within ~1e-13 of 1e-5 (e.g. ``t +- 1/100000``: Python may say yes, exact says no); no
  Countdown task with targets >= 1 admits such an equation with its 3-4 numbers.

Finding the action in a response (the regex, tag removal, "||" split and strip) is ``envs/text.py``'s
job; this module scores the action bytes it yields.

Over 400 lines: one pipeline (tokenize the action, check its numbers, evaluate it exactly with
overflow detection, score it) whose stages share private array layouts; split, they would export them.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

INT_LIMIT = 2**31 - 1
# A digit run's value saturates here; any run at or above it differs from every task number.
RUN_CAP = 10**9
# |x - t| < TOLERANCE_DENOMINATOR ** -1 is RAGEN's 1e-5 tolerance.
TOLERANCE_DENOMINATOR = 100_000
FORMAT_SCORE = 0.1
SUCCESS_SCORE = 1.0

_SPACE, _TAB, _LF, _FF, _CR = 32, 9, 10, 12, 13
_PLUS, _MINUS, _STAR, _SLASH, _LPAREN, _RPAREN = 43, 45, 42, 47, 40, 41
# Fields of one saved parenthesis level: sum (num, den), sign of the pending term, term (num, den),
# whether the pending factor divides, and the unary sign that applies to the parenthesised group.
_LEVEL_FIELDS = 7


class Evaluation(NamedTuple):
    """Result of evaluating one equation string (batched: leading axes everywhere).

    num, den: int32 exact value num / den (den > 0) when ``valid``.
    value: float32 num / den (NaN when not valid), for display and logging.
    well_formed: bool, the string parses as arithmetic (Python would not raise SyntaxError).
    valid: bool, well_formed and no division by zero and no int32 overflow.
    zero_division, overflow: bool, why a well-formed string is not valid.
    numbers: int32[max_numbers], the first digit runs of the string in order (RAGEN's
      ``re.findall(r"\\d+")``), saturated at RUN_CAP, zero-padded.
    count: int32, how many digit runs the string has (may exceed max_numbers).
    """

    num: jax.Array
    den: jax.Array
    value: jax.Array
    well_formed: jax.Array
    valid: jax.Array
    zero_division: jax.Array
    overflow: jax.Array
    numbers: jax.Array
    count: jax.Array


# --------------------------------------------------------------------------------------------------
# Checked int32 rational arithmetic. Each op returns (num, den, overflow); den stays positive.


def _mul_overflows(a: jax.Array, b: jax.Array) -> jax.Array:
    """|a * b| > INT_LIMIT, decided without overflowing: |a| > INT_LIMIT // |b|."""
    return (b != 0) & (jnp.abs(a) > INT_LIMIT // jnp.maximum(jnp.abs(b), 1))


def _add_overflows(a: jax.Array, b: jax.Array) -> jax.Array:
    """|a + b| > INT_LIMIT for |a|, |b| <= INT_LIMIT: only same-sign sums can leave the range."""
    return ((a >= 0) == (b >= 0)) & (jnp.abs(a) > INT_LIMIT - jnp.abs(b))


def rational_add(p1, q1, p2, q2):
    """p1/q1 + p2/q2 = (p1 q2 + p2 q1) / (q1 q2), unreduced."""
    x, y = p1 * q2, p2 * q1
    over = _mul_overflows(p1, q2) | _mul_overflows(p2, q1) | _mul_overflows(q1, q2)
    return x + y, q1 * q2, over | _add_overflows(x, y)


def rational_mul(p1, q1, p2, q2):
    """(p1/q1) (p2/q2) = p1 p2 / (q1 q2)."""
    over = _mul_overflows(p1, p2) | _mul_overflows(q1, q2)
    return p1 * p2, q1 * q2, over


def rational_div(p1, q1, p2, q2):
    """(p1/q1) / (p2/q2) = p1 q2 / (q1 p2), sign moved to the numerator; p2 == 0 is zero division."""
    over = _mul_overflows(p1, q2) | _mul_overflows(q1, p2)
    sign = jnp.where(p2 < 0, -1, 1)
    return sign * p1 * q2, sign * q1 * p2, over


def within_tolerance(num: jax.Array, den: jax.Array, target: jax.Array) -> jax.Array:
    """Exact |num/den - target| < 1e-5 for den > 0, in int32.

    With k = floor(num/den) and r = num - k den (0 <= r < den): if k == t the distance is r/den, if
    k == t - 1 it is (den - r)/den, otherwise it is >= 1. An integer m satisfies m/den < 1/100000 iff
    m <= (den - 1) // 100000.
    """
    den = jnp.maximum(den, 1)
    k = jnp.floor_divide(num, den)
    r = num - k * den
    bound = (den - 1) // TOLERANCE_DENOMINATOR
    return ((k == target) & (r <= bound)) | ((k == target - 1) & (den - r <= bound))


# --------------------------------------------------------------------------------------------------
# The evaluator: one lax.scan over the bytes, recursive-descent semantics with an explicit stack.


class _Carry(NamedTuple):
    expect_operand: jax.Array  # bool: the next token must start an operand (number, "(", unary sign)
    prev_digit: jax.Array  # bool: the previous byte was a digit (a literal / digit run is open)
    literal: jax.Array  # int32 value of the open literal
    literal_len: jax.Array
    literal_zero_first: jax.Array
    literal_nonzero: jax.Array
    sign: jax.Array  # int32 +-1, the unary sign pending for the next factor
    sum_num: jax.Array  # current level: sum of the finished terms
    sum_den: jax.Array
    add_sign: jax.Array  # +-1, the sign of the term being built
    term_num: jax.Array  # current level: product / quotient of the term's finished factors
    term_den: jax.Array
    divide: jax.Array  # bool: the next factor divides the term (else multiplies)
    depth: jax.Array
    stack: jax.Array  # int32[max_depth, _LEVEL_FIELDS], saved outer levels
    syntax_error: jax.Array
    zero_division: jax.Array
    overflow: jax.Array
    result_num: jax.Array
    result_den: jax.Array
    run_value: jax.Array  # digit-run extraction (independent of parsing)
    numbers: jax.Array
    count: jax.Array


def _feed_factor(c: _Carry, apply: jax.Array, p: jax.Array, q: jax.Array) -> _Carry:
    """term <- term * (p/q) or term / (p/q) where ``apply``; division by zero is flagged."""
    mp, mq, mover = rational_mul(c.term_num, c.term_den, p, q)
    dp, dq, dover = rational_div(c.term_num, c.term_den, p, q)
    new_p = jnp.where(c.divide, dp, mp)
    new_q = jnp.where(c.divide, dq, mq)
    over = jnp.where(c.divide, dover, mover)
    return c._replace(
        term_num=jnp.where(apply, new_p, c.term_num),
        term_den=jnp.where(apply, new_q, c.term_den),
        overflow=c.overflow | (apply & over),
        zero_division=c.zero_division | (apply & c.divide & (p == 0)),
    )


def _level_value(c: _Carry):
    """sum + add_sign * term: the value of the current parenthesis level once it ends."""
    return rational_add(c.sum_num, c.sum_den, c.add_sign * c.term_num, c.term_den)


def _step(c: _Carry, x):
    """Consume one byte (or the end marker at i == length)."""
    byte, active, is_end = x
    is_digit = active & (byte >= 48) & (byte <= 57) & ~is_end
    digit = byte - 48
    ends_run = (active | is_end) & c.prev_digit & ~is_digit

    # 1. A literal (digit run) that ends here becomes a factor of the current term.
    bad_zero = c.literal_zero_first & c.literal_nonzero & (c.literal_len > 1)  # Python: "01" is invalid
    c = c._replace(syntax_error=c.syntax_error | (ends_run & bad_zero))
    c = _feed_factor(c, ends_run, c.sign * c.literal, jnp.ones_like(c.literal))
    slot = jnp.arange(c.numbers.shape[0]) == c.count
    c = c._replace(
        sign=jnp.where(ends_run, 1, c.sign),
        numbers=jnp.where(ends_run & slot, c.run_value, c.numbers),
        count=c.count + ends_run.astype(jnp.int32),
    )

    # 2. The byte itself.
    is_plus_minus = active & ((byte == _PLUS) | (byte == _MINUS))
    is_mul_div = active & ((byte == _STAR) | (byte == _SLASH))
    is_lparen = active & (byte == _LPAREN)
    is_rparen = active & (byte == _RPAREN)
    is_blank = active & ((byte == _SPACE) | (byte == _TAB) | (byte == _FF))
    is_newline = active & ((byte == _LF) | (byte == _CR))
    is_other = active & ~(is_digit | is_plus_minus | is_mul_div | is_lparen | is_rparen | is_blank | is_newline)
    expect = c.expect_operand

    # Digits: extend the open literal, or open one where an operand is expected ("1 2" is an error).
    starts = is_digit & ~c.prev_digit
    extends = is_digit & c.prev_digit
    lit_over = extends & (c.literal > (INT_LIMIT - digit) // 10)
    run_value = jnp.where(c.run_value >= RUN_CAP // 10, RUN_CAP, c.run_value * 10 + digit)
    c = c._replace(
        literal=jnp.where(starts, digit, jnp.where(extends, c.literal * 10 + digit, c.literal)),
        literal_len=jnp.where(starts, 1, c.literal_len + extends.astype(jnp.int32)),
        literal_zero_first=jnp.where(starts, digit == 0, c.literal_zero_first),
        literal_nonzero=jnp.where(starts, digit != 0, c.literal_nonzero | (extends & (digit != 0))),
        run_value=jnp.where(starts, digit, jnp.where(extends, run_value, c.run_value)),
        overflow=c.overflow | lit_over,
        syntax_error=c.syntax_error | (starts & ~expect),
    )

    # "+" / "-": a unary sign where an operand is expected, else it closes the term into the sum.
    unary = is_plus_minus & expect
    binary_add = is_plus_minus & ~expect
    minus = byte == _MINUS
    sp, sq, sover = _level_value(c)
    c = c._replace(
        sign=jnp.where(unary & minus, -c.sign, c.sign),
        sum_num=jnp.where(binary_add, sp, c.sum_num),
        sum_den=jnp.where(binary_add, sq, c.sum_den),
        add_sign=jnp.where(binary_add, jnp.where(minus, -1, 1), c.add_sign),
        term_num=jnp.where(binary_add, 1, c.term_num),
        term_den=jnp.where(binary_add, 1, c.term_den),
        divide=jnp.where(binary_add, False, c.divide),
        overflow=c.overflow | (binary_add & sover),
    )

    # "*" / "/": binary only ("*3", "2**3", "2//3" are errors here).
    c = c._replace(
        divide=jnp.where(is_mul_div & ~expect, byte == _SLASH, c.divide),
        syntax_error=c.syntax_error | (is_mul_div & expect),
    )

    # "(": save the level (with the pending unary sign) and start a fresh one. After an operand it
    # would be a call, "(1)(2)", which Python rejects (TypeError).
    max_depth = c.stack.shape[0]
    push = is_lparen & expect & (c.depth < max_depth)
    saved = jnp.stack(
        [c.sum_num, c.sum_den, c.add_sign, c.term_num, c.term_den, c.divide.astype(jnp.int32), c.sign]
    )
    at_depth = (jnp.arange(max_depth) == c.depth)[:, None]
    c = c._replace(
        stack=jnp.where(push & at_depth, saved[None, :], c.stack),
        sum_num=jnp.where(push, 0, c.sum_num),
        sum_den=jnp.where(push, 1, c.sum_den),
        add_sign=jnp.where(push, 1, c.add_sign),
        term_num=jnp.where(push, 1, c.term_num),
        term_den=jnp.where(push, 1, c.term_den),
        divide=jnp.where(push, False, c.divide),
        sign=jnp.where(push, 1, c.sign),
        depth=c.depth + push.astype(jnp.int32),
        syntax_error=c.syntax_error | (is_lparen & ~push),
    )

    # ")": the level's value becomes a factor of the saved level ("()" and "(1+)" are errors).
    pop = is_rparen & ~expect & (c.depth > 0)
    vp, vq, vover = _level_value(c)
    outer = c.stack[jnp.maximum(c.depth - 1, 0)]
    restored = c._replace(
        sum_num=outer[0],
        sum_den=outer[1],
        add_sign=outer[2],
        term_num=outer[3],
        term_den=outer[4],
        divide=outer[5] != 0,
        depth=c.depth - 1,
        sign=jnp.ones_like(c.sign),
        overflow=c.overflow | vover,
    )
    restored = _feed_factor(restored, jnp.ones_like(pop), outer[6] * vp, vq)
    c = jax.tree.map(lambda new, old: jnp.where(pop, new, old), restored, c)
    c = c._replace(syntax_error=c.syntax_error | (is_rparen & ~pop))

    # Whitespace; a newline or carriage return outside parentheses ends Python's logical line.
    c = c._replace(syntax_error=c.syntax_error | (is_newline & (c.depth == 0)) | is_other)

    # End of string: nothing may be pending.
    rp, rq, rover = _level_value(c)
    c = c._replace(
        syntax_error=c.syntax_error | (is_end & (c.expect_operand | (c.depth > 0))),
        overflow=c.overflow | (is_end & rover),
        result_num=jnp.where(is_end, rp, c.result_num),
        result_den=jnp.where(is_end, rq, c.result_den),
    )

    # After an operand or ")" an operator is expected; after an operator or "(" an operand.
    opens = (is_plus_minus & ~expect) | is_mul_div | is_lparen
    closes = is_digit | is_rparen
    c = c._replace(
        expect_operand=jnp.where(opens, True, jnp.where(closes, False, c.expect_operand)),
        prev_digit=jnp.where(active, is_digit, c.prev_digit),
    )
    return c, None


def evaluate_equation(
    text: jax.Array, length: jax.Array, max_numbers: int = 8, max_depth: int | None = None
) -> Evaluation:
    """Evaluate one equation string exactly (vmap for batches).

    text: uint8[N] bytes (anything past ``length`` is ignored). length: int32 scalar, 0 <= length <= N.
    max_numbers: how many digit runs to return; ``count`` is exact regardless.
    max_depth: parenthesis nesting capacity; default N // 2, enough for any valid string of N bytes
      (a valid string of depth d has >= 2d + 1 bytes). Deeper nesting is reported as a syntax error.
    Returns an ``Evaluation``; never raises on garbage input.
    """
    n = text.shape[-1]
    depth_capacity = max(1, n // 2) if max_depth is None else max_depth
    length = jnp.clip(jnp.asarray(length, jnp.int32), 0, n)
    positions = jnp.arange(n + 1, dtype=jnp.int32)
    chars = jnp.concatenate([text.astype(jnp.int32), jnp.zeros((1,), jnp.int32)])
    zero, one = jnp.int32(0), jnp.int32(1)
    false = jnp.bool_(False)
    init = _Carry(
        expect_operand=jnp.bool_(True),
        prev_digit=false,
        literal=zero,
        literal_len=zero,
        literal_zero_first=false,
        literal_nonzero=false,
        sign=one,
        sum_num=zero,
        sum_den=one,
        add_sign=one,
        term_num=one,
        term_den=one,
        divide=false,
        depth=zero,
        stack=jnp.zeros((depth_capacity, _LEVEL_FIELDS), jnp.int32),
        syntax_error=false,
        zero_division=false,
        overflow=false,
        result_num=zero,
        result_den=one,
        run_value=zero,
        numbers=jnp.zeros((max_numbers,), jnp.int32),
        count=zero,
    )
    c, _ = jax.lax.scan(_step, init, (chars, positions < length, positions == length))
    well_formed = ~c.syntax_error
    valid = well_formed & ~c.zero_division & ~c.overflow
    den = jnp.where(valid, c.result_den, 1)
    num = jnp.where(valid, c.result_num, 0)
    value = jnp.where(valid, num.astype(jnp.float32) / den.astype(jnp.float32), jnp.nan)
    return Evaluation(
        num=num,
        den=den,
        value=value,
        well_formed=well_formed,
        valid=valid,
        zero_division=well_formed & c.zero_division,
        overflow=well_formed & c.overflow,
        numbers=c.numbers,
        count=c.count,
    )


# --------------------------------------------------------------------------------------------------
# The action string and the score.


def numbers_match(found: jax.Array, count: jax.Array, numbers: jax.Array, n_numbers: jax.Array) -> jax.Array:
    """RAGEN's ``check_format``: sorted(digit runs) == sorted(task numbers).

    found: int32[K] digit runs (first K), count: how many there are; numbers: int32[M] task numbers,
    the first n_numbers valid. Needs K >= M.
    """
    k, m = found.shape[-1], numbers.shape[-1]
    if k < m:
        raise ValueError(f"max_numbers={k} must be >= the task's number capacity {m}; raise max_numbers.")
    slots = jnp.arange(k) < n_numbers
    given = jnp.concatenate([numbers, jnp.zeros((k - m,), numbers.dtype)]).astype(jnp.int32)
    a = jnp.sort(jnp.where(slots, found, INT_LIMIT))
    b = jnp.sort(jnp.where(slots, given, INT_LIMIT))
    return (count == n_numbers) & jnp.all(a == b)


class Score(NamedTuple):
    """reward: float32 in {0, 0.1, 1}; success: bool (reward == 1); has_action: bool (a non-blank
    action was found); numbers_ok: bool (RAGEN's check_format); evaluation: ``Evaluation`` of the action."""

    reward: jax.Array
    success: jax.Array
    has_action: jax.Array
    numbers_ok: jax.Array
    evaluation: Evaluation


def score_action(
    action: jax.Array,
    length: jax.Array,
    numbers: jax.Array,
    n_numbers: jax.Array,
    target: jax.Array,
    max_numbers: int = 8,
    max_depth: int | None = None,
) -> Score:
    """RAGEN's ``CountdownEnv.compute_reward`` for one action string; vmap for batches.

    action: uint8[N], the stripped first "||"-piece of the answer (``text.answer_pieces``), length:
    int32 (0 = no action); numbers: int32[M] (first n_numbers valid); target: int32.
    reward = 0 if the action's digit runs are not the task's numbers as a multiset (or no action),
             1.0 if it evaluates (exactly) to within 1e-5 of target,
             0.1 otherwise (the format score).
    max_depth: parenthesis nesting capacity of the evaluator (see ``evaluate_equation``).
    """
    has_action = length > 0
    ev = evaluate_equation(action, length, max_numbers=max(max_numbers, numbers.shape[-1]), max_depth=max_depth)
    numbers_ok = has_action & numbers_match(ev.numbers, ev.count, numbers, n_numbers)
    correct = ev.valid & within_tolerance(ev.num, ev.den, jnp.asarray(target, jnp.int32))
    reward = jnp.where(numbers_ok, jnp.where(correct, SUCCESS_SCORE, FORMAT_SCORE), 0.0).astype(jnp.float32)
    return Score(reward=reward, success=numbers_ok & correct, has_action=has_action, numbers_ok=numbers_ok, evaluation=ev)
