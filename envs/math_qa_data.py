"""MathQA data on the host: the procedural word problems, MetaMathQA / GSM8K files, the item table.

An item is (question, label, solution): the question is the observation, the label the answer RAGEN
compares against (``ragen/env/metamathqa/env.py``), the solution the worked reasoning the warm start's
demonstrations write before the answer.

Sources
-------
- Generated (the default; no data can be downloaded at run time): grade-school word problems of 1-4
  arithmetic steps (+ - * and exact /) over small numbers: factors <= 9, every number in a question and
  every intermediate result in 1..99, questions <= 140 characters, so a tiny character-level model can
  learn them. Item i of seed s is drawn by ``random.Random(f"math_qa:{s}:{i}")``
  (seeding with a string is stable across runs and platforms), so it does not depend on the table size.
- A local file: MetaMathQA (``meta-math/MetaMathQA``: a JSON list, or JSONL, of {"query", "response", ...};
  label = RAGEN's ``_extract_answer``: the text after the first "The answer is: " to the end, stripped)
  or GSM8K (JSONL of {"question", "answer"}; label = the text after "####", stripped). The format is
  read from the first record's keys (parquet is not read: pyarrow is not a declared dependency).
  Items without a label, whose normalised label is empty or contains U+FFFD (a decoded invalid byte,
  which no response can match on device), or longer than the table's limits are dropped.

``normalize(text)`` is RAGEN's comparison form: ``re.sub(r"\\s+", "", text.lower())``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import random
import re
from typing import Callable, Iterable

import numpy as np

# (name, pronoun): the pronoun starts a sentence, so it is capitalised.
NAMES = (("Ann", "She"), ("Ben", "He"), ("Mia", "She"), ("Sam", "He"), ("Lily", "She"), ("Tom", "He"),
         ("Zoe", "She"), ("Max", "He"))
THINGS = ("apples", "pencils", "stickers", "marbles", "cookies", "cards", "shells", "books")


def normalize(text: str) -> str:
    """RAGEN's comparison form of an answer or label: lower-cased, every whitespace character removed."""
    return re.sub(r"\s+", "", text.lower())


@dataclasses.dataclass(frozen=True)
class Step:
    """One arithmetic step ``left op right = result`` (integers; ``/`` is exact)."""

    left: int
    op: str
    right: int
    result: int

    def text(self) -> str:
        return f"{self.left} {self.op} {self.right} = {self.result}"


@dataclasses.dataclass(frozen=True)
class Problem:
    """A generated word problem: its template, text, worked steps and answer (the last step's result)."""

    template: int
    question: str
    steps: tuple[Step, ...]

    @property
    def answer(self) -> int:
        return self.steps[-1].result

    @property
    def solution(self) -> str:
        return ", ".join(step.text() for step in self.steps) + "."


def _step(left: int, op: str, right: int) -> Step:
    result = {"+": left + right, "-": left - right, "*": left * right, "/": left // right}[op]
    return Step(left, op, right, result)


def _buy_more(rng: random.Random) -> tuple[str, list[Step]]:
    (name, he), thing = rng.choice(NAMES), rng.choice(THINGS)
    a, b = rng.randint(3, 20), rng.randint(2, 12)
    question = f"{name} has {a} {thing}. {he} buys {b} more. How many {thing} does {name} have now?"
    return question, [_step(a, "+", b)]


def _give_away(rng: random.Random) -> tuple[str, list[Step]]:
    (name, he), thing = rng.choice(NAMES), rng.choice(THINGS)
    a = rng.randint(5, 30)
    c = rng.randint(1, a - 1)
    question = f"{name} has {a} {thing}. {he} gives {c} to a friend. How many {thing} does {name} have left?"
    return question, [_step(a, "-", c)]


def _bags(rng: random.Random) -> tuple[str, list[Step]]:
    (name, _), thing = rng.choice(NAMES), rng.choice(THINGS)
    a, b = rng.randint(2, 6), rng.randint(2, 9)
    question = f"{name} buys {a} bags with {b} {thing} in each bag. How many {thing} does {name} have?"
    return question, [_step(a, "*", b)]


def _share(rng: random.Random) -> tuple[str, list[Step]]:
    (name, _), thing = rng.choice(NAMES), rng.choice(THINGS)
    k, q = rng.randint(2, 5), rng.randint(2, 9)
    question = f"{name} shares {k * q} {thing} equally among {k} friends. How many {thing} does each friend get?"
    return question, [_step(k * q, "/", k)]


def _buy_and_give(rng: random.Random) -> tuple[str, list[Step]]:
    (name, he), thing = rng.choice(NAMES), rng.choice(THINGS)
    a, b = rng.randint(3, 20), rng.randint(2, 12)
    c = rng.randint(1, a + b - 1)
    question = (f"{name} has {a} {thing}. {he} buys {b} more and gives {c} to a friend. "
                f"How many {thing} does {name} have now?")
    s1 = _step(a, "+", b)
    return question, [s1, _step(s1.result, "-", c)]


def _bags_and_found(rng: random.Random) -> tuple[str, list[Step]]:
    (name, _), thing = rng.choice(NAMES), rng.choice(THINGS)
    a, b, c = rng.randint(2, 6), rng.randint(2, 9), rng.randint(1, 9)
    question = (f"{name} buys {a} bags with {b} {thing} in each bag and finds {c} more. "
                f"How many {thing} does {name} have?")
    s1 = _step(a, "*", b)
    return question, [s1, _step(s1.result, "+", c)]


def _share_and_lose(rng: random.Random) -> tuple[str, list[Step]]:
    (name, _), thing = rng.choice(NAMES), rng.choice(THINGS)
    k, q = rng.randint(2, 5), rng.randint(2, 9)
    e = rng.randint(1, q - 1)
    question = (f"{name} shares {k * q} {thing} equally among {k} friends. Each friend loses {e}. "
                f"How many {thing} does each friend have left?")
    s1 = _step(k * q, "/", k)
    return question, [s1, _step(s1.result, "-", e)]


def _boxes_more_away(rng: random.Random) -> tuple[str, list[Step]]:
    (name, he), thing = rng.choice(NAMES), rng.choice(THINGS)
    a, b, c = rng.randint(2, 5), rng.randint(2, 9), rng.randint(1, 12)
    d = rng.randint(1, a * b + c - 1)
    question = (f"{name} has {a} boxes of {b} {thing}. {he} gets {c} more and gives away {d}. "
                f"How many {thing} are left?")
    s1 = _step(a, "*", b)
    s2 = _step(s1.result, "+", c)
    return question, [s1, s2, _step(s2.result, "-", d)]


def _rows_broken_new(rng: random.Random) -> tuple[str, list[Step]]:
    a, b = rng.randint(2, 6), rng.randint(2, 8)
    c = rng.randint(1, a * b - 1)
    d = rng.randint(1, 9)
    question = (f"A class has {a} rows of {b} desks. {c} desks break and {d} new desks arrive. "
                "How many desks are there now?")
    s1 = _step(a, "*", b)
    s2 = _step(s1.result, "-", c)
    return question, [s1, s2, _step(s2.result, "+", d)]


def _earn_spend_earn(rng: random.Random) -> tuple[str, list[Step]]:
    name, he = rng.choice(NAMES)
    a, b = rng.randint(2, 9), rng.randint(2, 6)
    c = rng.randint(1, a * b - 1)
    d, e = rng.randint(2, 9), rng.randint(2, 5)
    question = (f"{name} earns {a} dollars a day for {b} days and spends {c} dollars. "
                f"{he} then earns {d} dollars a day for {e} days. How many dollars does {name} have?")
    s1 = _step(a, "*", b)
    s2 = _step(s1.result, "-", c)
    s3 = _step(d, "*", e)
    return question, [s1, s2, s3, _step(s2.result, "+", s3.result)]


def _pens_of_birds(rng: random.Random) -> tuple[str, list[Step]]:
    a, b, c, d = rng.randint(2, 5), rng.randint(2, 9), rng.randint(2, 5), rng.randint(2, 9)
    e = rng.randint(1, a * b + c * d - 1)
    question = (f"A farm has {a} pens of {b} hens and {c} pens of {d} ducks. {e} birds fly away. "
                f"How many birds are left?")
    s1, s2 = _step(a, "*", b), _step(c, "*", d)
    s3 = _step(s1.result, "+", s2.result)
    return question, [s1, s2, s3, _step(s3.result, "-", e)]


TEMPLATES: tuple[Callable[[random.Random], tuple[str, list[Step]]], ...] = (
    _buy_more, _give_away, _bags, _share, _buy_and_give, _bags_and_found, _share_and_lose, _boxes_more_away,
    _rows_broken_new, _earn_spend_earn, _pens_of_birds,
)


# Arithmetic steps of each template's solution (1 to 4).
TEMPLATE_STEPS = (1, 1, 1, 1, 2, 2, 2, 3, 3, 4, 4)
MAX_STEPS = max(TEMPLATE_STEPS)


MAX_NUMBER = 99
MIN_MAX_NUMBER = 10  # every template has items whose numbers all stay within 10
_DRAWS = 10_000


def generate_problem(seed: int, index: int, max_steps: int = MAX_STEPS, max_number: int = MAX_NUMBER) -> Problem:
    """Problem ``index`` of ``seed``: a uniform template among those of at most ``max_steps`` steps (1-4),
    its numbers uniform in the template's ranges, redrawn until every number of the question and of the
    worked steps is at most ``max_number`` (10-99; the ranges keep them within 99, so 99 never redraws).
    With every template allowed, item i of a seed is the same whatever the table size."""
    if not min(TEMPLATE_STEPS) <= max_steps <= MAX_STEPS:
        raise ValueError(f"math_qa max_steps must be in {min(TEMPLATE_STEPS)}..{MAX_STEPS}, got {max_steps}")
    if not MIN_MAX_NUMBER <= max_number <= MAX_NUMBER:
        raise ValueError(f"math_qa max_number must be in {MIN_MAX_NUMBER}..{MAX_NUMBER}, got {max_number}")
    rng = random.Random(f"math_qa:{int(seed)}:{int(index)}")
    allowed = [i for i, n in enumerate(TEMPLATE_STEPS) if n <= max_steps]
    template = allowed[rng.randrange(len(allowed))]
    for _ in range(_DRAWS):
        question, steps = TEMPLATES[template](rng)
        numbers = [int(x) for x in re.findall(r"\d+", question)]
        numbers += [n for step in steps for n in (step.left, step.right, step.result)]
        if max(numbers) <= max_number:
            return Problem(template, question, tuple(steps))
    raise RuntimeError(f"math_qa template {template} drew no item within max_number={max_number} in {_DRAWS} draws")


# ----- files -----------------------------------------------------------------------------------------
def metamathqa_label(response: str) -> str | None:
    """RAGEN's ``_extract_answer``: ``re.search(r"The answer is: (.*?)$", response, re.DOTALL)``, stripped."""
    match = re.search(r"The answer is: (.*?)$", response, re.DOTALL)
    return match.group(1).strip() if match else None


def _metamathqa_item(record: dict) -> tuple[str, str | None, str]:
    response = str(record["response"])
    cut = response.find("The answer is: ")
    solution = response[:cut] if cut >= 0 else response
    return str(record["query"]), metamathqa_label(response), " ".join(solution.split())


def _gsm8k_item(record: dict) -> tuple[str, str | None, str]:
    answer = str(record["answer"])
    if "####" not in answer:
        return str(record["question"]), None, ""
    reasoning, label = answer.split("####", 1)
    reasoning = re.sub(r"<<[^>]*>>", "", reasoning)  # GSM8K's calculator annotations
    return str(record["question"]), label.strip(), " ".join(reasoning.split())


def _records(path: str) -> list[dict]:
    if path.endswith(".parquet"):
        raise ValueError(f"math_qa reads JSON / JSONL files, not parquet ({path!r}): pyarrow is not a declared "
                         "dependency; convert the file to JSONL once (e.g. with pandas: "
                         "read_parquet(path).to_json(out, orient='records', lines=True))")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    stripped = text.lstrip()
    if stripped.startswith("["):
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def read_file(path: str) -> tuple[str, list[tuple[str, str | None, str]]]:
    """(format, [(question, label or None, solution)]) of a local MetaMathQA or GSM8K file."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"math_qa data file {path!r} does not exist; set env.params.data_path to a "
                                "local MetaMathQA (.json/.jsonl) or GSM8K (.jsonl) file, or '' for generated problems")
    records = _records(path)
    if not records:
        raise ValueError(f"math_qa data file {path!r} has no records")
    keys = set(records[0])
    if {"query", "response"} <= keys:
        return "metamathqa", [_metamathqa_item(r) for r in records]
    if {"question", "answer"} <= keys:
        return "gsm8k", [_gsm8k_item(r) for r in records]
    raise ValueError(f"math_qa data file {path!r}: records need 'query' and 'response' (MetaMathQA) or "
                     f"'question' and 'answer' (GSM8K); the first record has {sorted(keys)}")


# ----- the item table --------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ItemTable:
    """The items an env draws from. questions, labels, solutions: N strings (host);
    label_bytes: uint8[N, A] (UTF-8 of ``normalize(label)``, zero-padded); label_lengths: int32[N]."""

    questions: tuple[str, ...]
    labels: tuple[str, ...]
    solutions: tuple[str, ...]
    label_bytes: np.ndarray
    label_lengths: np.ndarray
    dropped: int = 0

    def __len__(self) -> int:
        return len(self.questions)


def _usable(label: str | None, question: str, max_label_bytes: int, max_question_bytes: int) -> bool:
    if label is None:
        return False
    norm = normalize(label).encode("utf-8")
    return (0 < len(norm) <= max_label_bytes and "\ufffd" not in label
            and (max_question_bytes <= 0 or len(question.encode("utf-8")) <= max_question_bytes))


def build_table(items: Iterable[tuple[str, str | None, str]], max_label_bytes: int, max_question_bytes: int = 0,
                max_items: int = 0, seed: int = 0) -> ItemTable:
    """The usable items (see the module docstring); with ``max_items`` > 0 and more usable items, a
    seeded random subset of that many, kept in file order."""
    items = list(items)
    usable = [it for it in items if _usable(it[1], it[0], max_label_bytes, max_question_bytes)]
    if max_items > 0 and len(usable) > max_items:
        keep = np.sort(np.random.default_rng(seed).permutation(len(usable))[:max_items])
        usable = [usable[i] for i in keep]
    if not usable:
        raise ValueError(f"no usable math_qa items (of {len(items)}): each needs a label whose normalised form "
                         f"has 1..{max_label_bytes} bytes (max_label_bytes) and a question within max_question_bytes")
    label_bytes = np.zeros((len(usable), max_label_bytes), np.uint8)
    label_lengths = np.zeros((len(usable),), np.int32)
    for i, (_, label, _) in enumerate(usable):
        norm = normalize(label).encode("utf-8")
        label_bytes[i, : len(norm)] = np.frombuffer(norm, np.uint8)
        label_lengths[i] = len(norm)
    return ItemTable(
        questions=tuple(it[0] for it in usable), labels=tuple(it[1] for it in usable),
        solutions=tuple(it[2] for it in usable), label_bytes=label_bytes, label_lengths=label_lengths,
        dropped=len(items) - len(usable),
    )


def generated_items(seed: int, count: int, max_steps: int = MAX_STEPS,
                    max_number: int = MAX_NUMBER) -> list[tuple[str, str, str]]:
    problems = (generate_problem(seed, i, max_steps, max_number) for i in range(count))
    return [(p.question, str(p.answer), p.solution) for p in problems]


@functools.lru_cache(maxsize=8)
def load_table(data_path: str, num_items: int, data_seed: int, max_label_bytes: int,
               max_question_bytes: int, max_steps: int = MAX_STEPS, max_number: int = MAX_NUMBER) -> ItemTable:
    """The table of an env's settings (cached: built once per process): ``num_items`` generated problems
    of ``data_seed``, at most ``max_steps`` steps and numbers up to ``max_number`` when ``data_path`` is
    "", else the usable items of the file (at most ``num_items``, 0 = all)."""
    if not data_path:
        if num_items < 1:
            raise ValueError(f"math_qa num_items must be >= 1 for generated problems, got {num_items}")
        items = generated_items(data_seed, num_items, max_steps, max_number)
        return build_table(items, max_label_bytes, max_question_bytes)
    _, items = read_file(os.path.expanduser(data_path))
    return build_table(items, max_label_bytes, max_question_bytes, num_items, data_seed)
