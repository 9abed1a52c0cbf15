"""SearchQA data: passages to search and questions to answer, from the shipped files or the user's.

- Corpus JSONL: one ``{"id", "text"}`` per line (``"title"`` optional: it is searched and shown with
  the text). The shipped one is ``envs/data/search_corpus.jsonl`` (``envs/search_world.py``).
- Questions JSONL: one ``{"question", "answer"}`` per line; the answer may be a list of accepted
  answers, RAGEN's column name ``ground_truth`` is read too, and ``gold_ids`` (supporting passage ids)
  is optional. The shipped one is ``envs/data/search_questions.jsonl``.
- HotpotQA JSON (the official ``hotpot_*_v1.json`` files: a list of ``{"question", "answer",
  "supporting_facts": [[title, sentence], ...], "context": [[title, [sentences]], ...]}``): the
  questions, and a corpus of one passage per distinct context title (its sentences joined), so the
  distractor setting gives a small local corpus; gold ids = the supporting titles.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Any

from envs.search_world import CORPUS_PATH, QUESTIONS_PATH


@dataclasses.dataclass(frozen=True)
class Passage:
    id: str
    text: str
    title: str = ""


@dataclasses.dataclass(frozen=True)
class Question:
    question: str
    answers: tuple[str, ...]
    gold_ids: tuple[str, ...] = ()


def _jsonl(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path!r} does not exist")
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@functools.lru_cache(maxsize=8)
def load_corpus(path: str = CORPUS_PATH) -> tuple[Passage, ...]:
    passages = []
    for n, row in enumerate(_jsonl(path)):
        if "text" not in row:
            raise ValueError(f"{path}, line {n + 1}: a corpus row needs 'text' (and 'id'); got keys {sorted(row)}")
        passages.append(Passage(str(row.get("id", n)), str(row["text"]), str(row.get("title", ""))))
    if not passages:
        raise ValueError(f"{path} holds no passages")
    return tuple(passages)


def question_from_row(row: dict[str, Any]) -> Question:
    answer = row.get("answer", row.get("ground_truth"))
    if answer is None:
        raise ValueError(f"a question row needs 'answer' (or 'ground_truth'); got keys {sorted(row)}")
    answers = tuple(str(a) for a in answer) if isinstance(answer, (list, tuple)) else (str(answer),)
    return Question(str(row["question"]), answers, tuple(str(g) for g in row.get("gold_ids", ())))


@functools.lru_cache(maxsize=8)
def load_questions(path: str = QUESTIONS_PATH) -> tuple[Question, ...]:
    questions = tuple(question_from_row(row) for row in _jsonl(path))
    if not questions:
        raise ValueError(f"{path} holds no questions")
    return questions


@functools.lru_cache(maxsize=4)
def load_hotpotqa(path: str) -> tuple[tuple[Question, ...], tuple[Passage, ...]]:
    """(questions, corpus) of a HotpotQA JSON file; passage id = the context title."""
    with open(path, encoding="utf-8") as f:
        rows = json.load(f)
    passages: dict[str, Passage] = {}
    questions = []
    for row in rows:
        for title, sentences in row.get("context", []):
            if title not in passages:
                passages[title] = Passage(title, " ".join(s.strip() for s in sentences), title)
        gold = tuple(dict.fromkeys(title for title, _ in row.get("supporting_facts", [])))
        questions.append(Question(row["question"], (str(row["answer"]),), gold))
    if not questions or not passages:
        raise ValueError(f"{path} holds no HotpotQA questions with context")
    return tuple(questions), tuple(passages.values())
