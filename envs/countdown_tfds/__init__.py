"""TFDS builder for Countdown tasks (``tfds`` name ``countdown``); see ``countdown_dataset_builder``."""

from envs.countdown_tfds.countdown_dataset_builder import (
    Countdown,
    CountdownConfig,
    generate_tasks,
    load_data_sources,
)

__all__ = ["Countdown", "CountdownConfig", "generate_tasks", "load_data_sources"]
