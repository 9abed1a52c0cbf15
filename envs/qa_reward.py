"""SearchQA's reward: exact match and token F1 with SQuAD / HotpotQA normalisation, as RAGEN scores it
(``ragen/env/search/reward.py``, from rllm).

normalise(s) = collapse whitespace(remove the words a / an / the(remove ASCII punctuation(lower(s)))).
EM = normalise(pred) == normalise(gold). F1 over whitespace tokens of the normalised strings, with
HotpotQA's rule that a "yes" / "no" / "noanswer" on either side scores 0 unless both are equal.
Against several gold answers: the first exact match wins, else the best F1.
reward = 1.0 on an exact match; F1 when F1 >= ``f1_threshold`` (0.3); else 0.
success = an exact match or a reward > 0.
"""

from __future__ import annotations

import dataclasses
import re
import string
from collections import Counter
from typing import Sequence

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_BINARY = ("yes", "no", "noanswer")


def normalize_answer(s: str) -> str:
    text = "".join(ch for ch in s.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, gold: str) -> bool:
    return normalize_answer(prediction) == normalize_answer(gold)


def f1_score(prediction: str, gold: str) -> float:
    pred, ref = normalize_answer(prediction), normalize_answer(gold)
    if (pred in _BINARY or ref in _BINARY) and pred != ref:
        return 0.0
    common = Counter(pred.split()) & Counter(ref.split())
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred.split()), same / len(ref.split())
    return 2 * precision * recall / (precision + recall)


@dataclasses.dataclass(frozen=True)
class AnswerScore:
    reward: float
    exact: bool
    f1: float

    @property
    def success(self) -> bool:
        return self.exact or self.reward > 0


def score_answer(prediction: str, golds: str | Sequence[str], f1_threshold: float = 0.3) -> AnswerScore:
    golds = [golds] if isinstance(golds, str) else list(golds)
    best = 0.0
    for gold in golds:
        gold = str(gold).strip()
        if exact_match(prediction, gold):
            return AnswerScore(1.0, True, 1.0)
        best = max(best, f1_score(prediction, gold))
    return AnswerScore(best if best >= f1_threshold else 0.0, False, best)


def extract_answer(response: str) -> str:
    """RAGEN's fallback for an action that is neither search[...] nor finish[...]: \\boxed{...}, then bold
    text, then "the answer is ..." / "therefore ...", then the first sentence longer than 5 characters."""
    text = re.sub(r"\s+", " ", re.sub(r"<think>.*?</think>", "", response.strip(), flags=re.DOTALL)).strip()
    if not text:
        return ""
    boxed = re.search(r"\\boxed\{([^}]+)\}", text)
    if boxed:
        return boxed.group(1).strip()
    for pattern in (r"\*\*([^*]+)\*\*", r"\*([^*]+)\*"):
        found = [m.strip() for m in re.findall(pattern, text) if len(m.strip()) > 2 and not re.match(r"^[^\w]*$", m.strip())]
        if found:
            return found[0]
    for pattern in (r"(?:the\s+)?(?:correct\s+)?answer\s+is\s*:?\s*([^.!?]+)", r"(?:therefore|thus|so|hence)\s*,?\s*([^.!?]+)"):
        match = re.search(pattern, text, re.IGNORECASE)
        if match:
            answer = re.sub(r"^\W+|\W+$", "", match.group(1).strip())
            if len(answer) > 3:
                return answer
    sentences = [s.strip() for s in re.split(r"[.!?]+", text) if len(s.strip()) > 5]
    return sentences[0] if sentences else text[:100].strip()
