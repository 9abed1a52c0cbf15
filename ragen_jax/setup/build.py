"""Build a run's tokenizer, environment and policy (actor and critic) from its config."""

from __future__ import annotations

import functools
from typing import Any, Callable

from flax import nnx

from envs.registry import HOST_REGISTRY, make, make_host
from ragen_jax.models.config import get_preset
from ragen_jax.models.critic import Critic
from ragen_jax.models.tokenizers import CharTokenizer, Tokenizer
from ragen_jax.models.transformer import Transformer


def build_tokenizer(config) -> Tokenizer:
    """The character tokenizer, or the checkpoint's own tokenizer when ``model.hf_path`` is set."""
    if config.model.hf_path:
        from ragen_jax.models.hf_io import read_hf_config
        from ragen_jax.models.hf_tokenizer import HFTokenizer

        return HFTokenizer(config.model.hf_path, vocab_size=read_hf_config(config.model.hf_path).vocab_size)
    if config.model.gguf_path:
        return _gguf(config.model.gguf_path, config.model.dtype)[2]
    if config.model.tokenizer != "char":
        raise ValueError("config.model.tokenizer='hf' needs config.model.hf_path (the tokenizer comes from it)")
    return CharTokenizer()


@functools.lru_cache(maxsize=1)
def _gguf(path: str, compute_dtype: str):
    """(model, config, tokenizer) of a .gguf file, parsed once per run (parsing takes seconds)."""
    from ragen_jax.models.gguf import load_gguf

    return load_gguf(path, dtype="float32", compute_dtype=compute_dtype)


def build_env(config) -> tuple[Any, Any]:
    return make(config.env.name, **dict(config.env.params))


def is_host_env(config) -> bool:
    """Whether ``env.name`` names a plain-Python host env (``envs.registry.HOST_REGISTRY``)."""
    return config.env.name in HOST_REGISTRY


def build_host_env(config) -> Callable[[], Any]:
    """The picklable factory of one episode's host env: ``make_host(env.name, **env.params)``."""
    return make_host(config.env.name, **dict(config.env.params))


def model_overrides(config) -> dict[str, Any]:
    """``config.model.overrides``: ModelConfig fields replaced in the preset (optional key; e.g. a smaller
    model for tests: {"hidden_size": 64, "num_layers": 2, ...})."""
    overrides = config.model.get("overrides", None) or {}
    return dict(overrides.to_dict() if hasattr(overrides, "to_dict") else overrides)


def build_preset_model(config, tokenizer: Tokenizer, seed: int) -> Transformer:
    """A freshly initialised ``model.preset`` (with ``model.overrides``) from ``nnx.Rngs(seed)``."""
    cfg = get_preset(config.model.preset, dtype=config.model.dtype, **model_overrides(config))
    if cfg.vocab_size < tokenizer.vocab_size:
        raise ValueError(
            f"model preset {config.model.preset!r} has vocab_size {cfg.vocab_size} < the tokenizer's "
            f"{tokenizer.vocab_size}; use preset 'tiny' with the character tokenizer, or model.hf_path"
        )
    return Transformer(cfg, rngs=nnx.Rngs(seed))


def build_policy(config, tokenizer: Tokenizer, warm_start: Callable[[Any, nnx.Module], Any] | None = None,
                 ) -> tuple[Transformer, Any]:
    """(actor, critic or None). The critic (PPO/GAE only) starts as a copy of the actor's backbone.

    warm_start(config, actor) -> the actor's parameters (nnx.State) when ``config.init == "sft"``: the
    caller passes ``ragen_jax.sft.warm_start.load_warm_start`` (``train.loop.build_run`` does), so that
    setup does not depend on the supervised pipeline (docs/architecture.md).
    """
    if config.model.hf_path:
        from ragen_jax.models.hf_io import load_hf_checkpoint

        actor, _ = load_hf_checkpoint(config.model.hf_path, compute_dtype=config.model.dtype)
    elif config.model.gguf_path:
        actor = _gguf(config.model.gguf_path, config.model.dtype)[0]
    else:
        actor = build_preset_model(config, tokenizer, config.seed)
    if config.init == "sft":
        if warm_start is None:
            raise ValueError("config.init='sft' needs the warm start: pass "
                             "build_policy(..., warm_start=ragen_jax.sft.warm_start.load_warm_start)")
        # Before the critic copies the actor's backbone, so the critic starts from the warm start too.
        nnx.update(actor, warm_start(config, actor))
    critic = None
    if config.algorithm.adv_estimator == "gae":
        critic = Critic.from_actor(actor, nnx.Rngs(config.seed + 1))
    return actor, critic
