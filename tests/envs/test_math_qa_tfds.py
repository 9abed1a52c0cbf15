"""The MathQA TFDS builder builds from local files and generated problems, offline and without
TensorFlow (array_record + data source)."""

from __future__ import annotations

import json
import re
import sys

from envs.math_qa_data import generate_problem
from envs.math_qa_tfds import MathQA, MathQAConfig, load_data_sources

METAMATHQA = [
    {"query": "What is 2 + 3?", "response": "2 + 3 = 5.\nThe answer is: 5", "type": "GSM_Rephrased"},
    {"query": "Simplify 2/4.", "response": "Halve both.\nThe answer is: \\frac{1}{2}\n", "type": "MATH_AnsAug"},
    {"query": "Unlabelled.", "response": "No final line.", "type": "MATH_SV"},
    {"query": "Greek?", "response": "It is.\nThe answer is: ΟΔΟΣ ", "type": "MATH_FOBAR"},
]
GSM8K = [
    {"question": "Ann has 3 apples and buys 4. How many?", "answer": "3+4=<<3+4=7>>7 apples.\n#### 7"},
    {"question": "How many days?", "answer": "Count them.\n#### 1,000"},
    {"question": "No marker?", "answer": "none"},
]


def rows(source) -> list[dict]:
    text = lambda v: v.decode() if isinstance(v, bytes) else str(v)  # noqa: E731
    return [{k: text(v) for k, v in source[i].items()} for i in range(len(source))]


def test_builds_from_local_files_without_tensorflow(tmp_path):
    tf_before = "tensorflow" in sys.modules
    meta = tmp_path / "MetaMathQA-395K.json"
    meta.write_text(json.dumps(METAMATHQA, ensure_ascii=False), encoding="utf-8")
    gsm = tmp_path / "train.jsonl"
    gsm.write_text("\n".join(json.dumps(r) for r in GSM8K), encoding="utf-8")
    for path, records, expect in (
        (meta, METAMATHQA, [("What is 2 + 3?", "5", "5"), ("Simplify 2/4.", "\\frac{1}{2}", "\\frac{1}{2}"),
                            ("Greek?", "ΟΔΟΣ", "οδος")]),
        (gsm, GSM8K, [(GSM8K[0]["question"], "7", "7"), ("How many days?", "1,000", "1,000")]),
    ):
        config = MathQAConfig(name=path.stem.lower().replace("-", "_"), source_path=str(path))
        sources = load_data_sources(str(tmp_path / "tfds"), config)
        assert set(sources) == {"train"}
        got = rows(sources["train"])
        assert [(r["question"], r["label"], r["normalized_label"]) for r in got] == expect
        # Read again from the prepared files alone: the same rows.
        again = MathQA(data_dir=str(tmp_path / "tfds"), config=config).as_data_source(split="train")
        assert rows(again) == got
    assert rows(load_data_sources(str(tmp_path / "tfds"), MathQAConfig(name="gsm", source_path=str(gsm)))["train"])[0][
        "solution"] == "3+4=7 apples."
    assert ("tensorflow" in sys.modules) == tf_before


def test_generated_splits_are_the_generator_s_problems(tmp_path):
    config = MathQAConfig(name="small", train_size=12, validation_size=4, train_seed=5, validation_seed=6)
    sources = load_data_sources(str(tmp_path), config)
    for split, seed, size in (("train", 5, 12), ("validation", 6, 4)):
        got = rows(sources[split])
        assert len(got) == size
        for i, row in enumerate(got):
            problem = generate_problem(seed, i)
            assert row["question"] == problem.question and row["label"] == str(problem.answer)
            last = re.findall(r"= (\d+)", row["solution"])[-1]
            assert last == row["label"] == row["normalized_label"]
