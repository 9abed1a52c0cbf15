"""The protocol of a host environment: an episode written in plain Python, text in and text out.

One instance is one episode row; the rollout makes one per row and calls, in order::

    class MyEnv:                                  # satisfies HostEnv
        def system_text(self) -> str: ...          # the system message (same for every episode)
        def reset(self, seed: int) -> str: ...     # the first user message ("\\nTurn 1:\\nState:...")
        def step(self, response_text: str) -> HostStep: ...   # the generated text, without the prompt's
                                                               # leading "<think>"

It lives in ``envs`` (not in the rollout) so that an environment that needs Python, a sandbox or a
server implements it without importing the trainer; ``ragen_jax.rollout`` drives it.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, runtime_checkable


@dataclasses.dataclass(frozen=True)
class HostStep:
    """What one host-env turn reports. reward: the env reward of the turn (without the format penalty);
    format_ok: False adds the rollout's format penalty; n_valid: recognised actions (0 makes the next
    prompt carry the warning, which the env writes into next_user_text itself); n_executed: actions run."""

    reward: float
    done: bool
    success: bool
    format_ok: bool
    n_valid: int
    n_executed: int
    next_user_text: str


@runtime_checkable
class HostEnv(Protocol):
    def system_text(self) -> str: ...

    def reset(self, seed: int) -> str: ...

    def step(self, response_text: str) -> HostStep: ...
