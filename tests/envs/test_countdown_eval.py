"""Countdown's on-device evaluator and scoring against a plain-Python RAGEN reference (re + eval)."""

from __future__ import annotations

import random
import re
import warnings
from fractions import Fraction

import jax
import numpy as np
import pytest

from envs.countdown_eval import (
    INT_LIMIT,
    RUN_CAP,
    evaluate_equation,
    rational_add,
    rational_div,
    rational_mul,
    score_action,
    within_tolerance,
)

WIDTH = 64
MAX_TASK_NUMBERS = 4


# ----- the reference: RAGEN's ragen/env/countdown/env.py, re-implemented in plain Python ------------
def ref_check_format(equation: str, nums: list[int]) -> bool:
    try:
        return sorted(int(n) for n in re.findall(r"\d+", equation)) == sorted(nums)
    except Exception:
        return False


def ref_eval(equation: str):
    """Python's eval as RAGEN calls it; None where it raises."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return eval(equation, {"__builtins__": None}, {})
        except Exception:
            return None


def ref_check_correctness(equation: str, target: int) -> bool:
    try:
        return abs(ref_eval(equation) - target) < 1e-5
    except Exception:
        return False


def ref_reward(action: str, nums: list[int], target: int) -> float:
    if not ref_check_format(action, nums):
        return 0.0
    return 1.0 if ref_check_correctness(action, target) else 0.1


# ----- test strings ---------------------------------------------------------------------------------
OPS = "+-*/"
NOISE = [" ", "  ", "\t", "\f", "\n", "\r", "(", ")", "+", "-", "*", "/", "0", "7", "--", "q", "$", "?", ";", "\v"]


def random_expression(rng: random.Random, nums: list[int]) -> str:
    """A random fully-formed expression over all of nums (random tree, random parentheses/spaces)."""
    items = [str(n) for n in nums]
    while len(items) > 1:
        i, j = rng.sample(range(len(items)), 2)
        op = rng.choice(OPS)
        left, right = items[i], items[j]
        space = rng.choice(["", " ", " "])
        expr = f"{left}{space}{op}{space}{right}"
        if rng.random() < 0.6:
            expr = f"({expr})"
        items = [items[k] for k in range(len(items)) if k not in (i, j)] + [expr]
    out = items[0]
    if rng.random() < 0.1:
        out = rng.choice(["-", "+", "- -", "-+"]) + out
    return out


def mutate(rng: random.Random, s: str, nums: list[int]) -> str:
    kind = rng.randrange(8)
    if kind == 0 and s:  # insert noise
        k = rng.randrange(len(s) + 1)
        return s[:k] + rng.choice(NOISE) + s[k:]
    if kind == 1 and s:  # delete a character
        k = rng.randrange(len(s))
        return s[:k] + s[k + 1 :]
    if kind == 2:  # replace one number
        runs = list(re.finditer(r"\d+", s))
        if runs:
            m = rng.choice(runs)
            return s[: m.start()] + str(rng.randint(0, 120)) + s[m.end() :]
    if kind == 3:  # leading zero on a number
        runs = list(re.finditer(r"\d+", s))
        if runs:
            m = rng.choice(runs)
            return s[: m.start()] + "0" + s[m.start() :]
    if kind == 4:  # an extra number
        return s + f" {rng.choice(OPS)} {rng.choice(nums)}"
    if kind == 5 and s:  # change an operator
        positions = [k for k, c in enumerate(s) if c in OPS]
        if positions:
            k = rng.choice(positions)
            return s[:k] + rng.choice(OPS) + s[k + 1 :]
    if kind == 6:  # newline inside or outside parentheses
        k = rng.randrange(len(s) + 1)
        return s[:k] + rng.choice(["\n", "\r\n"]) + s[k:]
    return f"({s})"


def random_charset_string(rng: random.Random) -> str:
    alphabet = "0123456789+-*/() \t\n"
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 24)))


def outside_device_grammar(s: str) -> bool:
    """Python syntax the device evaluator rejects by design (documented in countdown_eval)."""
    compact = re.sub(r"[ \t\f]", "", s)
    return "**" in compact or "//" in compact


def make_cases(seed: int, count: int) -> list[tuple[str, list[int], int]]:
    """(stripped action, task numbers, target) triples: correct, mutated and garbage equations."""
    rng = random.Random(seed)
    cases = []
    while len(cases) < count:
        n = rng.choice([3, 4])
        nums = [rng.randint(1, 99) for _ in range(n)]
        if rng.random() < 0.15:
            nums[1] = nums[0]  # duplicates make "(a - a)" zero divisions likely
        expr = random_expression(rng, nums)
        value = ref_eval(expr)
        target = int(round(value)) if isinstance(value, (int, float)) and abs(value) < 1e6 else rng.randint(1, 100)
        if rng.random() < 0.1:
            target += rng.choice([-1, 1])
        r = rng.random()
        if r < 0.35:
            s = expr
        elif r < 0.85:
            s = expr
            for _ in range(rng.randint(1, 3)):
                s = mutate(rng, s, nums)
        elif r < 0.95:
            s = random_charset_string(rng)
        else:
            s = f"{nums[0]} / ({nums[1]} - {nums[1]})" + "".join(f" + {x}" for x in nums[2:])
            nums = [nums[0], nums[1], nums[1], *nums[2:]][:MAX_TASK_NUMBERS]
        s = s.strip()
        if len(s.encode()) > WIDTH or outside_device_grammar(s):
            continue
        cases.append((s, nums, target))
    return cases


def encode_batch(strings: list[str], width: int = WIDTH) -> tuple[np.ndarray, np.ndarray]:
    text = np.zeros((len(strings), width), np.uint8)
    lengths = np.zeros((len(strings),), np.int32)
    for i, s in enumerate(strings):
        b = s.encode()
        text[i, : len(b)] = np.frombuffer(b, np.uint8)
        lengths[i] = len(b)
    return text, lengths


@pytest.fixture(scope="module")
def evaluate():
    return jax.jit(jax.vmap(lambda t, n: evaluate_equation(t, n)))


@pytest.fixture(scope="module")
def score():
    return jax.jit(jax.vmap(score_action))


def run_scores(score, cases):
    strings = [c[0] for c in cases]
    text, lengths = encode_batch(strings)
    numbers = np.zeros((len(cases), MAX_TASK_NUMBERS), np.int32)
    counts = np.zeros((len(cases),), np.int32)
    for i, (_, nums, _) in enumerate(cases):
        numbers[i, : len(nums)] = nums
        counts[i] = len(nums)
    targets = np.asarray([c[2] for c in cases], np.int32)
    return score(text, lengths, numbers, counts, targets)


# ----- tests ----------------------------------------------------------------------------------------
def test_scoring_matches_ragen_reference_on_generated_equations(score):
    cases = make_cases(seed=0, count=3000)
    out = run_scores(score, cases)
    reward = np.asarray(out.reward)
    expected = np.asarray([ref_reward(s, nums, t) for s, nums, t in cases], np.float32)
    mismatches = [(cases[i], float(reward[i]), float(expected[i])) for i in np.flatnonzero(reward != expected)]
    assert not mismatches, mismatches[:10]
    # The mix exercises every outcome, including malformed strings whose numbers still match.
    for value, least in ((1.0, 300), (0.1, 300), (0.0, 300)):
        assert np.sum(expected == value) >= least, (value, np.sum(expected == value))
    malformed_with_numbers = sum(
        1 for s, nums, t in cases if ref_check_format(s, nums) and ref_eval(s) is None
    )
    assert malformed_with_numbers >= 100
    np.testing.assert_array_equal(np.asarray(out.success), expected == 1.0)


def test_evaluator_value_and_validity_match_python_eval(evaluate):
    rng = random.Random(1)
    strings = [c[0] for c in make_cases(seed=1, count=1500)]
    strings += [random_charset_string(rng).strip() for _ in range(500)]
    strings = [s for s in strings if not outside_device_grammar(s)]
    ev = evaluate(*encode_batch(strings))
    for i, s in enumerate(strings):
        expected = ref_eval(s)
        python_number = isinstance(expected, (int, float)) and not isinstance(expected, bool)
        runs = [int(x) for x in re.findall(r"\d+", s)]
        small = len(runs) <= 4 and all(x <= 99 for x in runs)
        if small:  # the proven exact range: max(|num|, den) <= 8 * 99**4 < 2**31
            assert not bool(ev.overflow[i]), s
        if bool(ev.overflow[i]):
            continue
        assert bool(ev.valid[i]) == python_number, (s, expected)
        if python_number:
            exact = Fraction(int(ev.num[i]), int(ev.den[i]))
            assert abs(float(exact) - expected) <= 1e-9 * max(1.0, abs(expected)), (s, exact, expected)
        assert int(ev.count[i]) == len(runs), s
        saturated = [min(x, RUN_CAP) for x in runs[:8]]  # runs >= RUN_CAP never equal a task number
        np.testing.assert_array_equal(np.asarray(ev.numbers[i][: len(saturated)]), saturated)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("2 + 5 - 3", 4),
        ("-(2+3)*4", -20),
        ("2*(3+4)/7-1", 1),
        ("8/4/2", 1),
        ("1-2-3-4", -8),
        ("-+-(-3)*-(2)", 6),
        ("1/-2", Fraction(-1, 2)),
        ("(1\n+2)", 3),  # newline inside parentheses is whitespace
        ("000+1", 1),
        ("1\f+\t2", 3),
        ("1\n+2", None),  # newline ends the logical line
        ("01", None),  # leading zero
        ("3 5", None),
        ("()", None),
        ("(1)(2)", None),  # a call in Python: TypeError
        ("2* *3", None),
        ("1+", None),
        ("(1", None),
        ("1)", None),
        ("", None),
        ("1/(2-2)", None),  # ZeroDivisionError
        ("2**3", None),  # outside the device grammar by design
        ("1.5", None),  # likewise (documented)
    ],
)
def test_evaluator_hand_cases(evaluate, text, expected):
    ev = evaluate(*encode_batch([text]))
    if expected is None:
        assert not bool(ev.valid[0])
    else:
        assert bool(ev.valid[0])
        assert Fraction(int(ev.num[0]), int(ev.den[0])) == expected


def test_evaluator_never_crashes_on_random_bytes(evaluate):
    rng = np.random.default_rng(0)
    text = rng.integers(0, 256, size=(256, WIDTH), dtype=np.uint8)
    text[:64] = rng.choice(np.frombuffer(b"0123456789+-*/()  ", np.uint8), size=(64, WIDTH))
    lengths = rng.integers(0, WIDTH + 1, size=(256,), dtype=np.int32)
    ev = evaluate(text, lengths)
    assert np.all(np.asarray(ev.den) > 0)
    assert np.all(np.isnan(np.asarray(ev.value)) == ~np.asarray(ev.valid))


def test_overflow_is_reported_not_wrapped(evaluate):
    strings = ["99999*99999", "2147483647+1", "2147483648", "46340*46340", "46341*46341", "1/99999/99999"]
    ev = evaluate(*encode_batch(strings))
    assert list(np.asarray(ev.overflow)) == [True, True, True, False, True, True]
    assert int(ev.num[3]) == 46340 * 46340


def test_within_tolerance_is_exact():
    rng = np.random.default_rng(1)
    cases = []
    for _ in range(2000):
        t = int(rng.integers(-1000, 1000))
        m = int(rng.integers(1, 5))
        den = int(rng.choice([1, 7, 99_999, 100_000, 100_001, 200_000, 970_299, int(rng.integers(1, 2**20))]))
        num = t * den + int(rng.choice([-m, 0, m, den - m, -den + m, int(rng.integers(-den, den + 1))]))
        if abs(num) < 2**31:
            cases.append((num, den, t))
    num, den, t = (np.asarray(x, np.int32) for x in zip(*cases))
    got = np.asarray(jax.jit(jax.vmap(within_tolerance))(num, den, t))
    want = np.asarray([abs(Fraction(a, b) - c) < Fraction(1, 100_000) for a, b, c in cases])
    np.testing.assert_array_equal(got, want)
    assert want.any() and (~want).any()


def test_rational_ops_flag_exactly_the_overflowing_results():
    rng = np.random.default_rng(2)
    scale = rng.choice([10, 1000, 50_000, 2**31 - 1], size=(4, 4000))
    p1, q1, p2, q2 = (rng.integers(-s, s, dtype=np.int64) for s in scale)
    q1, q2 = np.maximum(np.abs(q1), 1), np.maximum(np.abs(q2), 1)
    p1, q1, p2, q2 = (x.astype(np.int32) for x in (p1, q1, p2, q2))
    ops = jax.jit(lambda *a: (rational_add(*a), rational_mul(*a), rational_div(*a)))
    (ap, aq, ao), (mp, mq, mo), (dp, dq, do) = ops(p1, q1, p2, q2)
    big = lambda *xs: np.any([np.abs(np.asarray(x, object)) > INT_LIMIT for x in xs], axis=0)  # noqa: E731
    P1, Q1, P2, Q2 = (x.astype(object) for x in (p1, q1, p2, q2))
    want_add = big(P1 * Q2, P2 * Q1, Q1 * Q2, P1 * Q2 + P2 * Q1)
    np.testing.assert_array_equal(np.asarray(ao), want_add)
    np.testing.assert_array_equal(np.asarray(mo), big(P1 * P2, Q1 * Q2))
    np.testing.assert_array_equal(np.asarray(do), big(P1 * Q2, Q1 * P2))
    ok = ~np.asarray(ao)
    assert ok.any()
    got = [Fraction(int(a), int(b)) for a, b in zip(np.asarray(ap)[ok], np.asarray(aq)[ok])]
    want = [Fraction(int(a), int(b)) + Fraction(int(c), int(d)) for a, b, c, d in zip(p1[ok], q1[ok], p2[ok], q2[ok])]
    assert got == want
    nz = ~np.asarray(do) & (p2 != 0)
    assert np.all(np.asarray(dq)[nz] > 0)
    got = [Fraction(int(a), int(b)) for a, b in zip(np.asarray(dp)[nz], np.asarray(dq)[nz])]
    want = [Fraction(int(a), int(b)) / Fraction(int(c), int(d)) for a, b, c, d in zip(p1[nz], q1[nz], p2[nz], q2[nz])]
    assert got == want


def test_scoring_no_action_and_number_multisets(score):
    cases = [
        ("", [3, 5, 2], 4),  # no action: 0
        ("2 + 5 - 3", [3, 5, 2], 4),  # 1
        ("2 + 5 - 3 = 4", [3, 5, 2], 4),  # the "= 4" adds a number: 0
        ("2 + 5 + 5", [5, 2, 5], 12),  # duplicates as a multiset: 1
        ("2 + 5 + 3", [5, 2, 5], 10),  # wrong multiset: 0
        ("2 * 5 - 3", [3, 5, 2], 4),  # right numbers, wrong value: 0.1
        ("2 + 5 -", [5, 2], 7),  # right numbers, syntax error: 0.1
        ("002 + 05", [5, 2], 7),  # int("05") == 5, but Python rejects the literal: 0.1
        ("2 + 5 - 3 - 0", [3, 5, 2], 4),  # an extra 0 is an extra number: 0
    ]
    out = run_scores(score, cases)
    assert [float(r) for r in np.asarray(out.reward)] == pytest.approx([0, 1, 0, 1, 0, 0.1, 0.1, 0.1, 0])
    assert [ref_reward(*c) for c in cases] == pytest.approx([0, 1, 0, 1, 0, 0.1, 0.1, 0.1, 0])
