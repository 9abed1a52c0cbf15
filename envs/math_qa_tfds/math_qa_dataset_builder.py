"""MathQA items as a ``tensorflow-datasets`` builder that needs no TensorFlow and downloads nothing.

Build and read (array_record files, random access through ``as_data_source``)::

    from envs.math_qa_tfds import MathQA, MathQAConfig
    config = MathQAConfig(name="metamathqa", source_path="/data/MetaMathQA-395K.json")
    builder = MathQA(data_dir="/path/to/tfds", config=config)
    builder.download_and_prepare()                     # reads the local file; nothing is downloaded
    train = builder.as_data_source(split="train")      # len(train), train[i] -> dict of numpy values
    example = train[0]  # {"question": bytes, "label": bytes, "normalized_label": bytes, "solution": bytes}

``tfds.load`` / ``as_dataset`` would need TensorFlow; use the data source instead.

Sources (``envs/math_qa_data.py``):
- ``source_path`` = "" (config "generated"): the procedural word problems; split ``train`` is problems
  0..train_size-1 of ``train_seed`` and ``validation`` those of ``validation_seed`` (the env's table
  with ``data_seed`` = train_seed holds the same first problems).
- a local MetaMathQA file (JSON list or JSONL of {"query", "response"}; label after "The answer is: ")
  or GSM8K file (JSONL of {"question", "answer"}; label after "####"): one split
  ``train`` with every usable item in file order (RAGEN samples MetaMathQA's train split for training
  and validation alike). Unusable items (no label, an empty or over-long normalised label) are dropped.
"""

from __future__ import annotations

import dataclasses

import tensorflow_datasets as tfds

from envs.math_qa_data import build_table, generated_items, normalize, read_file


@dataclasses.dataclass
class MathQAConfig(tfds.core.BuilderConfig):
    """source_path: "" (generated) or a local MetaMathQA / GSM8K file; sizes and seeds of the generated
    splits; max_label_bytes: the widest normalised label kept (the env's ``max_label_bytes``)."""

    source_path: str = ""
    train_size: int = 10_000
    validation_size: int = 1_000
    train_seed: int = 0
    validation_seed: int = 1
    max_label_bytes: int = 32


class MathQA(tfds.core.GeneratorBasedBuilder):
    """Math questions with exact-match labels (RAGEN's MetaMathQA env)."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Generated word problems, or a local MetaMathQA / GSM8K file."}
    BUILDER_CONFIGS = [MathQAConfig(name="generated", description="Procedural grade-school word problems.")]
    DEFAULT_CONFIG_NAME = "generated"

    def __init__(self, *, file_format: str | None = "array_record", **kwargs):
        super().__init__(file_format=file_format, **kwargs)

    def _info(self) -> tfds.core.DatasetInfo:
        return self.dataset_info_from_configs(
            features=tfds.features.FeaturesDict(
                {
                    "question": tfds.features.Text(),
                    "label": tfds.features.Text(),
                    "normalized_label": tfds.features.Text(),
                    "solution": tfds.features.Text(),
                }
            ),
            supervised_keys=None,
            disable_shuffling=True,  # example i of a split is item i of its source
            homepage="https://github.com/mll-lab-nu/RAGEN",
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # nothing to download
        config = self.builder_config
        if config.source_path:
            _, items = read_file(config.source_path)
            return {"train": self._generate_examples(items)}
        return {
            "train": self._generate_examples(generated_items(config.train_seed, config.train_size)),
            "validation": self._generate_examples(generated_items(config.validation_seed, config.validation_size)),
        }

    def _generate_examples(self, items):
        if not items:
            return
        table = build_table(items, self.builder_config.max_label_bytes)
        for index, (question, label, solution) in enumerate(zip(table.questions, table.labels, table.solutions)):
            yield index, {"question": question, "label": label, "normalized_label": normalize(label),
                          "solution": solution}


def load_data_sources(data_dir: str, config: MathQAConfig | str = "generated") -> dict:
    """Build (if needed) into ``data_dir`` and return {split: source} for the splits the config has."""
    builder = MathQA(data_dir=data_dir, config=config)
    builder.download_and_prepare()
    return {split: builder.as_data_source(split=split) for split in builder.info.splits}
