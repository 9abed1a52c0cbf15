"""The training state: one pytree that the update step takes and returns and a checkpoint holds.

``TrainState`` is a ``flax.struct.dataclass`` (immutable: ``state.replace(actor=...)`` makes a new one), so
it passes through ``jax.jit`` (and ``jax.tree.map``, ``device_put``, shardings) as a whole:

    actor       nnx.State   the policy's parameters (``nnx.split(actor)[1]``)
    critic      nnx.State | None     the value model's parameters (GAE only)
    actor_opt   optax state of the actor's optimizer (``actor_tx.init(actor)``)
    critic_opt  optax state | None   the critic's optimizer state (GAE only)
    ref         nnx.State | None     the frozen reference policy (only with the KL loss)
    mi_ema      dict[str, MarginalStdEma]   the MI z-score's running marginal std, one per MI strategy
                (``ragen_jax.diagnostics.mi``); the update passes it through unchanged

The update step donates the trained part (``trained()``: actor, critic and their optimizer states) and
only reads ``ref``; ``mi_ema`` never enters it (``rl/update.py``).

The checkpoint tree (``tree()`` / ``from_tree``) is a plain dict with exactly these six keys, the layout
every checkpoint written so far has.
"""

from __future__ import annotations

from typing import Any

import flax.struct

STATE_KEYS = ("actor", "critic", "actor_opt", "critic_opt", "ref", "mi_ema")
TRAINED_KEYS = ("actor", "critic", "actor_opt", "critic_opt")  # what an update changes


@flax.struct.dataclass
class TrainState:
    """What one training step carries from the last (see the module docstring for each field)."""

    actor: Any
    critic: Any = None
    actor_opt: Any = None
    critic_opt: Any = None
    ref: Any = None
    mi_ema: dict = flax.struct.field(default_factory=dict)

    def trained(self) -> dict:
        """{"actor", "critic", "actor_opt", "critic_opt"}: what an update step changes (and donates)."""
        return {k: getattr(self, k) for k in TRAINED_KEYS}

    def tree(self) -> dict:
        """The checkpoint tree: {"actor", "critic", "actor_opt", "critic_opt", "ref", "mi_ema"}."""
        return {k: getattr(self, k) for k in STATE_KEYS}

    @classmethod
    def from_tree(cls, tree: dict) -> "TrainState":
        """Inverse of ``tree()`` (a restored checkpoint tree)."""
        return cls(**{k: tree[k] for k in STATE_KEYS})


__all__ = ["STATE_KEYS", "TRAINED_KEYS", "TrainState"]
