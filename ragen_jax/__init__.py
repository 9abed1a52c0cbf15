"""ragen_jax: JAX-native reinforcement learning of multi-turn LLM agents (RAGEN-2)."""

__version__ = "0.1.0"
