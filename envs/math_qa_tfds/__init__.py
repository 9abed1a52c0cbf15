"""TFDS builder for MathQA items (``tfds`` name ``math_qa``); see ``math_qa_dataset_builder``."""

from envs.math_qa_tfds.math_qa_dataset_builder import MathQA, MathQAConfig, load_data_sources

__all__ = ["MathQA", "MathQAConfig", "load_data_sources"]
