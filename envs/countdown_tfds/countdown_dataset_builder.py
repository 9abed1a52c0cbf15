"""Countdown tasks as a ``tensorflow-datasets`` builder that needs no TensorFlow.

Build and read (array_record files, random access through ``as_data_source``)::

    from envs.countdown_tfds import Countdown, CountdownConfig
    builder = Countdown(data_dir="/path/to/tfds")            # config "add_sub" (the paper's data)
    builder.download_and_prepare()                            # nothing is downloaded: tasks are generated
    train = builder.as_data_source(split="train")             # len(train), train[i] -> dict of numpy values
    example = train[0]  # {"numbers": int32[n], "target": int32, "solution": bytes}

or ``tfds.data_source("countdown/add_sub", data_dir=...)`` once the module is imported.
``tfds.load`` / ``as_dataset`` would need TensorFlow; use the data source instead.

Splits: ``train`` and ``validation``, each deterministic from its seed: example i (files keep the
generation order) is
``generate_task(fold_in(PRNGKey(seed), i), params)`` (``envs.countdown``), and its ``solution`` is the
search solver's equation (``envs.countdown_solver``; +- only when ``only_add_sub_solvable``).
Sizes, seeds and the task ranges are ``CountdownConfig`` fields; pass a custom config to change them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import tensorflow_datasets as tfds

from envs.countdown import CountdownParams, check_params, generate_task
from envs.countdown_solver import solve


@dataclasses.dataclass
class CountdownConfig(tfds.core.BuilderConfig):
    """Split sizes and seeds, and the task ranges of ``envs.countdown.CountdownParams``."""

    train_size: int = 10_000
    validation_size: int = 1_000
    train_seed: int = 0
    validation_seed: int = 1
    min_count: int = 3
    max_count: int = 4
    min_number: int = 1
    max_number: int = 99
    min_target: int = 1
    max_target: int = 100
    only_add_sub_solvable: bool = True

    def params(self) -> CountdownParams:
        params = CountdownParams(
            min_count=self.min_count,
            max_count=self.max_count,
            min_number=self.min_number,
            max_number=self.max_number,
            min_target=self.min_target,
            max_target=self.max_target,
            only_add_sub_solvable=self.only_add_sub_solvable,
        )
        check_params(params)
        return params


_CHUNK = 256  # tasks per compiled call (one compile per params, whatever the split size)


@functools.lru_cache(maxsize=8)
def _task_generator(params: CountdownParams):
    """jit: (seed int32[], indices uint32[_CHUNK]) -> generate_task(fold_in(PRNGKey(seed), i)) for each i."""

    def one(seed, index):
        return generate_task(jax.random.fold_in(jax.random.PRNGKey(seed), index), params)

    return jax.jit(jax.vmap(one, in_axes=(None, 0)))


def generate_tasks(params: CountdownParams, size: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tasks 0..size-1 of a seed: (numbers int32[size, max_count], counts int32[size], targets int32[size])."""
    generate = _task_generator(params)
    chunks = []
    for start in range(0, size, _CHUNK):
        indices = np.arange(start, start + _CHUNK, dtype=np.uint32)
        chunks.append([np.asarray(x) for x in generate(np.int32(seed), indices)])
    if not chunks:
        return np.zeros((0, params.max_count), np.int32), np.zeros((0,), np.int32), np.zeros((0,), np.int32)
    return tuple(np.concatenate([c[k] for c in chunks])[:size] for k in range(3))


def generate_split(config: CountdownConfig, size: int, seed: int) -> list[dict]:
    """The examples of one split, in index order (see the module docstring)."""
    if size < 0:
        raise ValueError(f"split sizes must be >= 0, got {size}")
    numbers, counts, targets = generate_tasks(config.params(), size, seed)
    examples = []
    for i in range(size):
        nums = numbers[i, : counts[i]].astype(np.int32)
        solution = solve(nums.tolist(), int(targets[i]), only_add_sub=config.only_add_sub_solvable)
        if solution is None:  # generate_task builds solvable tasks; this would be a generator bug
            raise RuntimeError(f"no solution found for generated task {nums.tolist()} -> {int(targets[i])}")
        examples.append({"numbers": nums, "target": np.int32(targets[i]), "solution": solution})
    return examples


class Countdown(tfds.core.GeneratorBasedBuilder):
    """Countdown tasks (RAGEN's Countdown env): 3-4 numbers, a target, one solving equation."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Procedurally generated Countdown tasks."}
    BUILDER_CONFIGS = [
        CountdownConfig(name="add_sub", description="Solvable with only + and - over all numbers (RAGEN's data)."),
        CountdownConfig(
            name="all_ops",
            description="Targets of random + - * / expressions over all numbers.",
            only_add_sub_solvable=False,
        ),
    ]
    DEFAULT_CONFIG_NAME = "add_sub"

    def __init__(self, *, file_format: str | None = "array_record", **kwargs):
        super().__init__(file_format=file_format, **kwargs)

    def _info(self) -> tfds.core.DatasetInfo:
        return self.dataset_info_from_configs(
            features=tfds.features.FeaturesDict(
                {
                    "numbers": tfds.features.Tensor(shape=(None,), dtype=np.int32),
                    "target": tfds.features.Scalar(dtype=np.int32),
                    "solution": tfds.features.Text(),
                }
            ),
            supervised_keys=None,
            disable_shuffling=True,  # example i of a split is task i of its seed
            homepage="https://github.com/mll-lab-nu/RAGEN",
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # nothing to download
        config = self.builder_config
        return {
            "train": self._generate_examples(config.train_size, config.train_seed),
            "validation": self._generate_examples(config.validation_size, config.validation_seed),
        }

    def _generate_examples(self, size: int, seed: int):
        for index, example in enumerate(generate_split(self.builder_config, size, seed)):
            yield index, example


def load_data_sources(data_dir: str, config: CountdownConfig | str = "add_sub") -> dict:
    """Build (if needed) into ``data_dir`` and return {"train": source, "validation": source}."""
    builder = Countdown(data_dir=data_dir, config=config)
    builder.download_and_prepare()
    return {split: builder.as_data_source(split=split) for split in ("train", "validation")}
