"""Host envs: environments written in plain Python (text in, text out), and an adapter for TextEnvs.

The protocol (``HostEnv``, ``HostStep``) is ``envs/host.py``: one instance per episode row, ``reset(seed)``
gives the first user message, ``step(response_text)`` the turn's result. ``HostStep.next_user_text`` is
the next user message (RAGEN: "Reward:\\n{r}\\n" + the next turn text); it is ignored once ``done``. The
rollout adds the chat template around these messages, tokenizes them with ``tokenizer.encode`` and keeps
prefill and decode batched on device (``host_rollout``).

``TextEnvHost`` runs any on-device ``TextEnv`` this way, through its Python-side pieces only: the text
layer's ``system_text`` / ``turn_text`` / ``reward_text``, a plain-Python ``re`` parse of RAGEN's format
written independently of ``envs/text.py`` (``parse_response``), the env's ``parse_pieces`` (its action
names, or its free-text action, from the answer pieces) and the env's ``step_turn`` applied to one row. It is the reference the fused rollout is tested against.
``TextEnvHostFactory`` is a picklable ``make_env`` of it, for the worker processes of ``host_pool``.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import jax.numpy as jnp

from envs.base import TextLayer
from envs.host import HostEnv, HostStep
from envs.registry import make
from ragen_jax.models.tokenizers import Tokenizer
from ragen_jax.rollout.layout import env_keys, step_key

# RAGEN ctx_manager._parse_response: the response is prefixed with the prompt's "<think>".
ANSWER_PATTERN = re.compile(r"<think>(.*?)</think>\s*<answer>(.*?)</answer>", re.DOTALL)
REMOVED_SPECIALS = ("<think>", "</think>", "<answer>", "</answer>", "<|im_start|>", "<|im_end|>")


@dataclasses.dataclass(frozen=True)
class ParsedText:
    """RAGEN's parse of one response: matched the format regex; the kept answer pieces (<= K)."""

    matched: bool
    pieces: tuple[str, ...]
    complete: bool = True


def _clean(answer: str) -> str:
    for special in REMOVED_SPECIALS:
        answer = answer.replace(special, "")
    return answer


def parse_response(response_text: str, max_actions: int, answer_window: int | None = None) -> ParsedText:
    """RAGEN's parse: match on "<think>" + text, strip the special strings from the answer (one
    ``str.replace`` after another), split on "||", strip, drop empty pieces, keep the first K.

    answer_window (the text layer's cost knob, None = exact RAGEN): an answer of more than that many
    UTF-8 bytes is read from its first ``answer_window`` bytes only; the pieces closed by "||" inside
    them count, and when fewer than K such non-empty pieces exist the turn is incomplete: matched,
    no pieces (``complete`` False), which the env scores as an invalid turn.
    """
    match = ANSWER_PATTERN.search("<think>" + response_text)
    if match is None:
        return ParsedText(False, ())
    raw = match.group(2).encode("utf-8")
    if answer_window is None or len(raw) <= answer_window:
        pieces = [piece.strip() for piece in _clean(match.group(2)).split("||")]
        return ParsedText(True, tuple(piece for piece in pieces if piece)[:max_actions])
    window = _clean(raw[:answer_window].decode("utf-8", errors="replace"))
    closed = [piece.strip() for piece in window.split("||")[:-1]]
    closed = [piece for piece in closed if piece]
    if len(closed) >= max_actions:
        return ParsedText(True, tuple(closed[:max_actions]))
    return ParsedText(True, (), complete=False)


class TextEnvHost:
    """One episode of an on-device ``TextEnv`` driven from the host (text in, text out).

    Keys follow ``rollout_layout``: reset from ``env_keys(seed)``, each turn from the number of actions
    executed so far, so a row reproduces the fused rollout's env randomness exactly.
    """

    def __init__(self, layer: TextLayer, env_params: Any = None, max_new_tokens: int | None = None) -> None:
        self.layer = layer
        self.env = layer.env
        self.params = layer.params if env_params is None else env_params
        self.max_actions = layer.max_actions_per_turn
        # The layer's response-bytes cap (R * min(W, bytes_per_token) for a response buffer of R tokens):
        # the host driver cuts the response bytes there before decoding, as the device parse does.
        width = int(layer.response_bytes.table.shape[1])
        self.max_response_bytes = (
            None if layer.bytes_per_token is None or max_new_tokens is None
            else max_new_tokens * min(width, layer.bytes_per_token)
        )
        self.state: Any = None
        self.turn = 0
        self._step_base: Any = None

    def system_text(self) -> str:
        return self.layer.system_text()

    def reset(self, seed: int) -> str:
        reset_key, self._step_base = env_keys(jnp.int32(seed))
        _, self.state = _reset(self.env, reset_key, self.params)
        self.turn = 1
        return self.layer.turn_text(self.state, 1, warning=False)

    def step(self, response_text: str) -> HostStep:
        parsed_text = parse_response(response_text, self.max_actions, self.layer.answer_window)
        parsed, n_valid = self._parsed(parsed_text)
        key = step_key(self._step_base, self.state.time)
        self.state, reward, done, info = _step(self.env, key, self.state, parsed, self.params)
        reward, done = float(reward), bool(done)
        self.turn += 1
        next_text = self.layer.reward_text(reward) + self.layer.turn_text(self.state, self.turn, warning=n_valid == 0)
        return HostStep(
            reward=reward, done=done, success=bool(info["success"]), format_ok=bool(info["format_ok"]),
            n_valid=n_valid, n_executed=int(info["n_executed"]), next_user_text=next_text,
        )

    def _parsed(self, parsed_text: ParsedText) -> tuple[Any, int]:
        """The env's parsed-turn struct built from the Python parse (the env maps the pieces itself)."""
        return self.env.parse_pieces(
            parsed_text.pieces, parsed_text.matched, parsed_text.complete, self.state, self.params, self.max_actions
        )


@dataclasses.dataclass
class TextEnvHostFactory:
    """``make_env`` of ``TextEnvHost`` rows of the registered on-device env ``env_name``: picklable (names
    and numbers only), it builds the text layer once per process, on first use."""

    env_name: str
    tokenizer: Tokenizer
    env_params: dict
    prompt_style: str
    max_actions_per_turn: int
    max_new_tokens: int | None = None
    bytes_per_token: int | None = None
    answer_window: int | None = None
    _layer: Any = dataclasses.field(default=None, repr=False, compare=False)

    def layer(self) -> TextLayer:
        if self._layer is None:
            env, params = make(self.env_name, **self.env_params)
            self._layer = env.text_layer(self.tokenizer, params, self.prompt_style, self.max_actions_per_turn,
                                         bytes_per_token=self.bytes_per_token, answer_window=self.answer_window)
        return self._layer

    def __call__(self) -> TextEnvHost:
        return TextEnvHost(self.layer(), None, self.max_new_tokens)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_layer": None}  # device arrays stay in the process that built them


# One compiled reset / step per (env, params structure), shared by every row and every rollout.
_reset = jax.jit(lambda env, key, params: env.reset_env(key, params), static_argnums=(0,))
_step = jax.jit(lambda env, key, state, parsed, params: env.step_turn(key, state, parsed, params), static_argnums=(0,))
