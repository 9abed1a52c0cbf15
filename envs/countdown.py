"""Countdown (RAGEN's ``Countdown`` env, ``config/_4_countdown.yaml``): task generator and TextEnv.

A task is 3-4 numbers and a target; the model answers one equation that must use every number
exactly once (single turn, one action). Reward (``envs/countdown_eval.py``): 1.0 if the action's
numbers are the task's multiset and it evaluates to the target (|x - t| < 1e-5), 0.1 if the numbers
match but the value is wrong or it does not evaluate, 0 otherwise. Success = reward 1.

Tasks. RAGEN reads ``Jiayi-Pan/Countdown-Tasks-3to4`` (3 or 4 numbers in 1..99, small targets) and keeps
the rows solvable with only + and - over all numbers (``has_solution``). No data can be downloaded
here, so ``generate_task`` builds tasks procedurally, solvable by construction:
- ``only_add_sub_solvable=True`` (default, the paper's data): target = sum_i s_i n_i for random signs
  s_i in {+1, -1}, so "+-" over all numbers always solves it.
- ``False``: target = the value of a random binary expression tree over all numbers with + - * /
  (repeatedly combine two random remaining values with a random operator, exact rationals),
  kept when it is an integer.
Attempts whose target falls outside [min_target, max_target] (or that divide by zero, or give a
fraction) are redrawn in a ``lax.while_loop``, so any key gives a valid task. The count is uniform
over [min_count, max_count] and numbers are uniform over [min_number, max_number].

Text (RAGEN ``CountdownEnv.reset``): observation "Target: {t}, nums: [a, b, c]"; instruction from
``config/envs.yaml`` (with its worked example); max_tokens 100. RAGEN's post-answer observation
("Your answer get {r} points.") is never shown to the model (max_turn is 1), so ``render`` always
shows the task.

The action is free text, so the gymnax action is a ``CountdownAction`` (bytes uint8[A] + length), and
the text layer's parse yields it (``CountdownParsed``): RAGEN's first "||"-piece, stripped. An
action longer than ``max_action_bytes`` cannot be evaluated on device; it scores 0 (reported as
``action_too_long``); the default 128 bytes fits any sensibly written equation of four numbers.
Likewise nesting deeper than ``max_paren_depth`` (16) parentheses counts as malformed.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from envs.base import TextEnv, TextEnvParams, TextEnvState, select
from envs.countdown_eval import rational_add, rational_div, rational_mul, score_action
from envs.countdown_solver import CountdownPolicy
from envs.text import (
    Dynamic,
    Static,
    TokenFragments,
    answer_cut,
    answer_pieces,
    byte_classes,
    clean_answer,
    parse_answer,
)

RAGEN_INSTRUCTION = (
    "You are solving the Countdown puzzle. You should use the num list to create an equation that equals "
    "the target. Example answer format: <think> To find an equation using [3, 5, 2] to get 4. Let's check "
    "2 + 5 = 7, 7 - 3 = 4. So the answer is 2 + 5 - 3 = 4. </think><answer>2 + 5 - 3</answer>"
)
COMPACT_INSTRUCTION = "Countdown: use each number once with + - * / ( ) to make the target.\n"


@struct.dataclass
class CountdownParams(TextEnvParams):
    """Static task settings (all shape- or trace-defining, so not pytree leaves).

    max_actions: RAGEN max_actions_per_traj (1).
    max_action_bytes: the longest action (stripped equation) the device evaluates; longer ones score 0.
    max_paren_depth: the deepest parenthesis nesting the evaluator holds; deeper (valid in Python up to
      200 levels) is reported as a syntax error (0.1 when the numbers match). The evaluator's cost
      grows with it; 16 is far beyond any equation of four numbers written sensibly.
    """

    max_actions: int = 1
    min_count: int = struct.field(pytree_node=False, default=3)
    max_count: int = struct.field(pytree_node=False, default=4)
    min_number: int = struct.field(pytree_node=False, default=1)
    max_number: int = struct.field(pytree_node=False, default=99)
    min_target: int = struct.field(pytree_node=False, default=1)
    max_target: int = struct.field(pytree_node=False, default=100)
    only_add_sub_solvable: bool = struct.field(pytree_node=False, default=True)
    max_action_bytes: int = struct.field(pytree_node=False, default=128)
    max_paren_depth: int = struct.field(pytree_node=False, default=16)


@struct.dataclass
class CountdownState(TextEnvState):
    """numbers: int32[max_count] (first n_numbers valid, zeros after); n_numbers, target: int32[]."""

    numbers: jax.Array
    n_numbers: jax.Array
    target: jax.Array


@struct.dataclass
class CountdownAction:
    """One free-text action: text uint8[A] (bytes past ``length`` are ignored), length int32[]
    (0 = no action; > A = too long to evaluate)."""

    text: jax.Array
    length: jax.Array


@struct.dataclass
class CountdownParsed:
    """A parsed turn: the first action and RAGEN's bookkeeping (every non-blank piece is valid)."""

    action: CountdownAction
    n_valid: jax.Array
    n_parsed: jax.Array
    matched: jax.Array
    format_ok: jax.Array


def check_params(params: CountdownParams) -> None:
    """Raise a clear error for settings that cannot produce tasks."""
    if not 1 <= params.min_count <= params.max_count:
        raise ValueError(f"need 1 <= min_count <= max_count, got {params.min_count}, {params.max_count}")
    if not 0 <= params.min_number <= params.max_number:
        raise ValueError(f"need 0 <= min_number <= max_number, got {params.min_number}, {params.max_number}")
    if params.min_target > params.max_target:
        raise ValueError(f"need min_target <= max_target, got {params.min_target}, {params.max_target}")
    if params.max_count * params.max_number > 10**8 or max(abs(params.min_target), abs(params.max_target)) > 10**8:
        raise ValueError("numbers and targets must stay small (count * max_number <= 1e8) for exact int32 arithmetic")
    reachable = params.max_count * params.max_number
    if params.only_add_sub_solvable and (params.max_target < -reachable or params.min_target > reachable):
        raise ValueError(
            f"targets [{params.min_target}, {params.max_target}] are out of reach of +- over at most "
            f"{params.max_count} numbers <= {params.max_number}; widen the target range."
        )


def _random_expression_value(key: jax.Array, numbers: jax.Array, n: jax.Array):
    """Value (num, den, ok) of a random binary expression over numbers[:n] using + - * /.

    Combine step s (for s < n - 1): pick two distinct live slots i, j uniformly, an operator uniformly,
    store values[i] op values[j] in slot i and retire slot j. ok is False on division by zero or
    int32 overflow.
    """
    size = numbers.shape[0]
    slots = jnp.arange(size)

    def combine(s, carry):
        num, den, live, ok, k = carry
        k, k_i, k_j, k_op = jax.random.split(k, 4)
        active = s < n - 1
        i = jnp.argmax(jnp.where(live, jax.random.gumbel(k_i, (size,)), -jnp.inf))
        j = jnp.argmax(jnp.where(live & (slots != i), jax.random.gumbel(k_j, (size,)), -jnp.inf))
        op = jax.random.randint(k_op, (), 0, 4)
        a, b = (num[i], den[i]), (num[j], den[j])
        add = rational_add(*a, *b)
        sub = rational_add(*a, -b[0], b[1])
        mul = rational_mul(*a, *b)
        div = rational_div(*a, *b)
        results = [add, sub, mul, div]
        pick = lambda idx: jnp.stack([r[idx] for r in results])[op]  # noqa: E731
        new_num, new_den, over = pick(0), pick(1), pick(2)
        bad = over | ((op == 3) & (b[0] == 0))
        num = jnp.where(active & (slots == i), new_num, num)
        den = jnp.where(active & (slots == i), new_den, den)
        live = live & ~(active & (slots == j))
        return num, den, live, ok & ~(active & bad), k

    init = (numbers, jnp.ones_like(numbers), slots < n, jnp.bool_(True), key)
    num, den, live, ok, _ = jax.lax.fori_loop(0, size - 1, combine, init)
    last = jnp.argmax(live)
    return num[last], jnp.maximum(den[last], 1), ok


def _attempt(key: jax.Array, params: CountdownParams):
    k_count, k_numbers, k_ops = jax.random.split(key, 3)
    size = params.max_count
    n = jax.random.randint(k_count, (), params.min_count, params.max_count + 1)
    numbers = jax.random.randint(k_numbers, (size,), params.min_number, params.max_number + 1)
    numbers = jnp.where(jnp.arange(size) < n, numbers, 0).astype(jnp.int32)
    if params.only_add_sub_solvable:
        signs = jnp.where(jax.random.bernoulli(k_ops, 0.5, (size,)), 1, -1)
        target, ok = jnp.sum(signs * numbers).astype(jnp.int32), jnp.bool_(True)
    else:
        num, den, ok = _random_expression_value(k_ops, numbers, n)
        ok = ok & (num % den == 0)
        target = (num // den).astype(jnp.int32)
    ok = ok & (target >= params.min_target) & (target <= params.max_target)
    return numbers, n.astype(jnp.int32), target, ok


def generate_task(key: jax.Array, params: CountdownParams) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A solvable task from a key: (numbers int32[max_count], n_numbers int32[], target int32[]).

    Jittable and vmappable; attempts are redrawn until one is valid (see the module docstring).
    Raises ValueError (at trace time) for settings that cannot produce tasks.
    """
    check_params(params)

    def body(carry):
        k, *_ = carry
        k, sub = jax.random.split(k)
        return (k, *_attempt(sub, params))

    size = params.max_count
    init = (key, jnp.zeros((size,), jnp.int32), jnp.int32(0), jnp.int32(0), jnp.bool_(False))
    _, numbers, n, target, _ = jax.lax.while_loop(lambda c: ~c[4], body, init)
    return numbers, n, target


def render_task_text(numbers, n_numbers: int, target: int) -> str:
    """RAGEN's observation: f"Target: {target}, nums: {nums}" with nums a Python list."""
    nums = [int(x) for x in list(numbers)[: int(n_numbers)]]
    return f"Target: {int(target)}, nums: {nums}"


def _digits(*values: int) -> int:
    return max(len(str(abs(int(v)))) for v in values)


class Countdown(TextEnv):
    """RAGEN's Countdown as a TextEnv (single turn, one free-text action)."""

    action_lookup: dict[int, str] = {}
    reward_decimals = 1
    default_max_response_tokens = 100
    list_actions_in_system = False

    @property
    def default_params(self) -> CountdownParams:
        return CountdownParams()

    @property
    def name(self) -> str:
        return "Countdown"

    # ----- gymnax -------------------------------------------------------------------------------
    def get_obs(self, state: CountdownState, params: Any = None, key: Any = None) -> jax.Array:
        """int32[2 + max_count]: [target, n_numbers, numbers...]."""
        return jnp.concatenate([state.target[None], state.n_numbers[None], state.numbers]).astype(jnp.int32)

    def reset_env(self, key: jax.Array, params: CountdownParams) -> tuple[jax.Array, CountdownState]:
        numbers, n, target = generate_task(key, params)
        state = CountdownState(
            time=jnp.int32(0),
            terminated=jnp.bool_(False),
            success=jnp.bool_(False),
            numbers=numbers,
            n_numbers=n,
            target=target,
        )
        return self.get_obs(state), state

    def step_env(
        self, key: jax.Array, state: CountdownState, action: CountdownAction, params: CountdownParams
    ) -> tuple[jax.Array, CountdownState, jax.Array, jax.Array, dict]:
        """Score the equation; the episode ends. A blank action (length 0) is a no-op (reward 0)."""
        del key
        width = action.text.shape[-1]
        fits = action.length <= width
        score = score_action(
            action.text,
            jnp.minimum(action.length, width),
            state.numbers,
            state.n_numbers,
            state.target,
            max_depth=params.max_paren_depth,
        )
        live = (action.length > 0) & ~state.terminated
        success = live & fits & score.success
        reward = jnp.where(live & fits, score.reward, 0.0).astype(jnp.float32)
        new_state = state.replace(
            time=state.time + live.astype(jnp.int32),
            terminated=state.terminated | live,
            success=state.success | success,
        )
        info = {
            "numbers_ok": live & fits & score.numbers_ok,
            "well_formed": live & fits & score.evaluation.well_formed,
            "action_too_long": live & ~fits,
        }
        return self.get_obs(new_state), new_state, reward, new_state.terminated, info

    # ----- text ---------------------------------------------------------------------------------
    def instruction_text(self, params: Any, style: str) -> str:
        return RAGEN_INSTRUCTION if style == "ragen" else COMPACT_INSTRUCTION

    def render_state_text(self, state: CountdownState, params: CountdownParams, style: str = "ragen") -> str:
        return render_task_text(state.numbers, int(state.n_numbers), int(state.target))

    def render_state_items(
        self, state: CountdownState, params: CountdownParams, frags: TokenFragments, style: str = "ragen"
    ) -> list[Static | Dynamic]:
        """Device mirror of ``render_task_text`` (already short: the same text in both styles): "Target: " t ", nums: [" a (", " b)* "]"."""
        number_digits = _digits(params.min_number, params.max_number)
        target_digits = _digits(params.min_target, params.max_target)
        items: list[Static | Dynamic] = [
            frags.static("Target: "),
            frags.int_items(state.target, target_digits),
            frags.static(", nums: ["),
        ]
        for k in range(params.max_count):
            shown = k < state.n_numbers
            if k > 0:
                items.append(frags.optional(", ", shown))
            number = frags.int_items(state.numbers[k], number_digits)
            items.append(Dynamic(number.table, number.idx, number.enabled & shown))
        items.append(frags.static("]"))
        return items

    def parse_bytes(
        self,
        buf: jax.Array,
        n: jax.Array,
        state: Any,
        params: CountdownParams,
        max_actions: int,
        answer_window: int | None = None,
    ) -> CountdownParsed:
        """RAGEN's parse for a language env: the first non-blank stripped "||"-piece is the action.

        buf: uint8[B] response bytes, n: int32[]. Free-text pieces are all valid (n_valid == n_parsed);
        format_ok = the format regex matched and a piece was found. ``answer_window`` (the text layer's
        cost knob): an answer longer than the window whose first K pieces are not all closed by "||"
        inside it is an invalid turn (no action, format penalty), as for the other envs.
        """
        del state
        classes = byte_classes(buf, n)
        span = parse_answer(buf, n, classes)
        ans, cls, ans_n = clean_answer(buf, n, span, classes, answer_window)
        cut = answer_cut(span, answer_window)
        # A complete piece lies inside the window, so the window also bounds the action's width.
        width = params.max_action_bytes if answer_window is None else min(params.max_action_bytes, answer_window)
        pieces = answer_pieces(ans, cls, ans_n, max_actions, width, cut)
        n_valid = jnp.where(pieces.complete, pieces.n_parsed, 0).astype(jnp.int32)
        n_parsed = jnp.where(pieces.complete, pieces.n_parsed, jnp.maximum(pieces.n_parsed, 1)).astype(jnp.int32)
        length = jnp.where(n_valid > 0, pieces.lengths[0], 0).astype(jnp.int32)
        return CountdownParsed(
            action=CountdownAction(text=pieces.bytes[0], length=length),
            n_valid=n_valid,
            n_parsed=n_parsed,
            matched=span.matched,
            format_ok=span.matched & (n_valid > 0) & (n_valid == n_parsed),
        )

    def parse_pieces(
        self, pieces: Sequence[str], matched: bool, complete: bool, state: Any, params: CountdownParams,
        max_actions: int,
    ) -> tuple[CountdownParsed, int]:
        """Host mode's parse (``TextEnv.parse_pieces``): the first piece is the action (its UTF-8 bytes,
        cut to ``max_action_bytes``; ``length`` keeps the full length, so a longer one scores 0), and
        every piece counts as valid. An incomplete read has no pieces: an invalid turn."""
        del complete, state, max_actions
        width = params.max_action_bytes
        first = pieces[0].encode("utf-8") if pieces else b""
        text = np.zeros((width,), np.uint8)
        text[: min(len(first), width)] = np.frombuffer(first[:width], np.uint8)
        n = len(pieces)
        parsed = CountdownParsed(
            action=CountdownAction(text=jnp.asarray(text), length=jnp.int32(len(first))),
            n_valid=jnp.int32(n), n_parsed=jnp.int32(n), matched=jnp.asarray(matched),
            format_ok=jnp.asarray(matched and n > 0),
        )
        return parsed, n

    def demo_policy(self) -> CountdownPolicy:
        return CountdownPolicy()

    def step_turn(
        self, key: jax.Array, state: CountdownState, parsed: CountdownParsed, params: CountdownParams
    ) -> tuple[CountdownState, jax.Array, jax.Array, dict]:
        """Execute the first action (Countdown ends after one); later pieces are never executed
        (RAGEN stops a turn at done). info as ``TextEnv.step_turn``."""
        live = (parsed.n_valid > 0) & ~state.terminated & (state.time < params.max_actions)
        _, nxt, reward, _, _ = self.step_env(key, state, parsed.action, params)
        state = select(live, nxt, state)
        reward = jnp.where(live, reward, 0.0).astype(jnp.float32)
        done = state.terminated | (state.time >= params.max_actions)
        info = {
            "success": state.success,
            "n_executed": live.astype(jnp.int32),
            "format_ok": parsed.format_ok,
            "actions_left": (params.max_actions - state.time).astype(jnp.int32),
        }
        return state, reward, done, info
