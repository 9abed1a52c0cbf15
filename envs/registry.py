"""``make(name, **params) -> (env, params)``, like ``gymnax.make``: the env and its ``EnvParams`` with
the given fields replaced. Registered: "frozen_lake", "bandit", "sokoban", "countdown",
"math_qa".

``HOST_REGISTRY`` names the host environments (plain-Python classes satisfying ``envs.host.HostEnv``,
stepped by ``rollout.mode = "host"``): "code_exec" (``envs/code_exec.py``) and "search_qa"
(``envs/search_qa.py``); ``make_host(name, **params)`` returns a picklable factory of one
episode's env, called once per row (in worker processes too)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

from envs.bandit import Bandit
from envs.base import TextEnv
from envs.code_exec import CodeExecEnv
from envs.countdown import Countdown
from envs.frozen_lake import FrozenLake
from envs.host import HostEnv
from envs.math_qa import MathQA
from envs.search_qa import SearchQAEnv
from envs.sokoban import SokobanEnv

REGISTRY: dict[str, Callable[[], TextEnv]] = {
    "frozen_lake": FrozenLake,
    "bandit": Bandit,
    "sokoban": SokobanEnv,
    "countdown": Countdown,
    "math_qa": MathQA,
}


def make(name: str, **params: Any) -> tuple[TextEnv, Any]:
    if name not in REGISTRY:
        raise ValueError(f"unknown env {name!r}; registered envs: {sorted(REGISTRY)}")
    env = REGISTRY[name]()
    defaults = env.default_params
    fields = {f.name for f in dataclasses.fields(defaults)}
    unknown = sorted(set(params) - fields)
    if unknown:
        raise ValueError(f"{name} has no parameter(s) {unknown}; its parameters are {sorted(fields)}")
    return env, defaults.replace(**params)


HOST_REGISTRY: dict[str, Callable[..., HostEnv]] = {
    "code_exec": CodeExecEnv,  # needs bubblewrap (envs/sandbox.py)
    "search_qa": SearchQAEnv,
}


def make_host(name: str, **params: Any) -> Callable[[], HostEnv]:
    if name not in HOST_REGISTRY:
        raise ValueError(f"unknown host env {name!r}; registered host envs: {sorted(HOST_REGISTRY)}")
    return functools.partial(HOST_REGISTRY[name], **params)
