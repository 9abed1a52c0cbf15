"""Static settings and bookkeeping of a lock-step multi-turn rollout: config, chat template, layout.

Sequence layout (full-history context, RAGEN-2's default)
--------------------------------------------------------
The conversation goes into the KV cache block after block, each block of a static width::

    [prompt 1   ] = begin + system_start + system + eot + after_eot + user_start + user_1 + eot + after_eot
                    + assistant_start + "<think>"                                   width P1
    [response 1 ] = up to N = max_new_tokens generated tokens                         width N
    [prompt k   ] = ([eot] unless response k-1 ended with it) + after_eot + user_start
                    + "Reward:\\n{r_(k-1)}\\n" + user_k + eot + after_eot + assistant_start + "<think>"   width Pk
    [response k ] ...                                                               width N

with user_k = the env's turn text ("\\nTurn k:\\nState:\\n{obs}\\n...") and, for ChatML,
eot = "<|im_end|>", after_eot = "\\n". A block's tokens sit at its front (right padding); the
padding slots are holes the cache masks out (they never shift RoPE positions). Rows whose episode
has ended get all-padding blocks. The cache length is the static sum

    S = P1 + N + (max_turns - 1) * (Pk + N)                                            (cache_len)

and the rollout's memory is dominated by the KV cache of B rows x S slots:
``kv_cache.cache_bytes(cfg, B, S) = 2 * layers * B * kv_heads * S * head_dim * itemsize + B * S``,
plus the per-slot bookkeeping (tokens, masks, log-probs: about 14 bytes per slot and row) and one
decode step's activations; nothing grows with the number of turns beyond S.

Keys and seeds
--------------
- Env seeds (RAGEN): training step s uses seeds ``train_seed + s * n_groups + g`` for group g; all
  ``group_size`` rows of a group reset from the same seed. Validation uses ``val_seed + i``.
- Env randomness is a function of the seed only (RAGEN seeds gymnasium's RNG at reset, so two rows of a
  group that issue the same actions see the same slips): ``env_keys(seed) -> (reset_key, step_base)``
  and the key of a turn is ``fold_in(step_base, actions executed so far)``.
- Sampling randomness: turn t (0-based) draws from ``fold_in(key, t)``.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ragen_jax.models.config import ModelConfig
from ragen_jax.models.kv_cache import cache_bytes
from ragen_jax.models.tokenizers import Tokenizer
from ragen_jax.sampling.sampler import Sampler, SamplingConfig

CONTEXT_MODES = ("full", "limited")
ROLLOUT_MODES = ("fused", "host")
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
ANSWER_CLOSE = "</answer>"


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """The strings around chat messages. message = role_start + content + end_of_turn + after_eot."""

    name: str
    begin: str
    system_start: str
    user_start: str
    assistant_start: str
    end_of_turn: str
    after_end_of_turn: str

    def message(self, role_start: str, content: str) -> str:
        return role_start + content + self.end_of_turn + self.after_end_of_turn

    def first_prompt(self, system: str, user: str) -> str:
        """The text of block 1: system and first user message, then the assistant header and <think>."""
        return (self.begin + self.message(self.system_start, system) + self.message(self.user_start, user)
                + self.assistant_start + THINK_OPEN)

    def later_prompt(self, user: str, response_ended_turn: bool) -> str:
        """The text of block k > 1: close the previous assistant turn, the user message, the header."""
        close = ("" if response_ended_turn else self.end_of_turn) + self.after_end_of_turn
        return close + self.user_start + user + self.end_of_turn + self.after_end_of_turn + (
            self.assistant_start + THINK_OPEN)


CHAT_TEMPLATES: dict[str, ChatTemplate] = {
    # Qwen2 / Qwen2.5 ChatML.
    "qwen": ChatTemplate(
        name="qwen", begin="", system_start="<|im_start|>system\n", user_start="<|im_start|>user\n",
        assistant_start="<|im_start|>assistant\n", end_of_turn="<|im_end|>", after_end_of_turn="\n",
    ),
    # Llama 3.x.
    "llama3": ChatTemplate(
        name="llama3", begin="<|begin_of_text|>",
        system_start="<|start_header_id|>system<|end_header_id|>\n\n",
        user_start="<|start_header_id|>user<|end_header_id|>\n\n",
        assistant_start="<|start_header_id|>assistant<|end_header_id|>\n\n",
        end_of_turn="<|eot_id|>", after_end_of_turn="",
    ),
}


def get_chat_template(name: str) -> ChatTemplate:
    if name not in CHAT_TEMPLATES:
        close = difflib.get_close_matches(name, CHAT_TEMPLATES, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown chat template {name!r}; known: {sorted(CHAT_TEMPLATES)}.{hint}")
    return CHAT_TEMPLATES[name]


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Static rollout settings (hashable: part of the jit cache key). Temperature is traced.

    n_groups x group_size = B rows; max_turns; max_new_tokens = N per turn; max_actions_per_turn
    (RAGEN 2); prompt_style "ragen" | "compact"; chat_template "qwen" | "llama3"; context_mode
    "full" (one sequence per episode) | "limited" (each turn sees the system prompt and the last
    ``context_window`` turns, the current one included, and becomes its own sample; host mode only);
    mode "fused" (on-device envs, one jitted program) | "host" (turn by turn); temperature: the
    training default; val_temperature (RAGEN 0.5) and val_greedy for validation; train_seed /
    val_seed: seed bases (RAGEN 10000 / 123); format_penalty (RAGEN -0.1 per invalid turn);
    max_user_tokens: the static width of one user message for host envs (0: derived from the
    on-device text layer); host_error_penalty: the penalty of the turn whose host-env call failed
    (timeout, exception, dead worker: ``host_pool``), which ends the episode; kv_block / prefill_chunk: the sampler's attention block and prompt chunk
    (see ``sampling/sampler.py``);
    parse_bytes_per_token / parse_answer_window: the on-device parse's cost knobs (``envs/base.py``
    TextLayer; None = exact RAGEN parsing of any response, the default here; e.g. 4 / 64 bound the
    parse's work for long responses and BPE vocabularies, and the host adapter mirrors them).
    """

    n_groups: int = 8
    group_size: int = 16
    max_turns: int = 5
    max_new_tokens: int = 400
    max_actions_per_turn: int = 2
    prompt_style: str = "ragen"
    chat_template: str = "qwen"
    context_mode: str = "full"
    context_window: int = 0
    mode: str = "fused"
    temperature: float = 1.0
    val_temperature: float = 0.5
    val_greedy: bool = False
    train_seed: int = 10000
    val_seed: int = 123
    format_penalty: float = -0.1
    max_user_tokens: int = 0
    host_error_penalty: float = -0.1
    kv_block: int = 64
    prefill_chunk: int = 64
    parse_bytes_per_token: int | None = None
    parse_answer_window: int | None = None

    def __post_init__(self):
        for name in ("n_groups", "group_size", "max_turns", "max_new_tokens", "max_actions_per_turn"):
            if getattr(self, name) < 1:
                raise ValueError(f"RolloutConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.context_mode not in CONTEXT_MODES:
            raise ValueError(f"context_mode must be one of {CONTEXT_MODES}, got {self.context_mode!r}")
        if self.mode not in ROLLOUT_MODES:
            raise ValueError(f"rollout mode must be one of {ROLLOUT_MODES}, got {self.mode!r}")
        if self.context_mode == "limited" and self.context_window < 1:
            raise ValueError("context_mode='limited' needs context_window >= 1 (the turns kept, current included)")
        if self.temperature <= 0 or self.val_temperature <= 0:
            raise ValueError("temperatures must be > 0 (use val_greedy=True for argmax decoding)")
        get_chat_template(self.chat_template)

    @property
    def batch(self) -> int:
        return self.n_groups * self.group_size

    def train_seeds(self, step: int) -> np.ndarray:
        """int32[n_groups]: the env seed of each group at training step ``step`` (RAGEN seed_counter)."""
        base = self.train_seed + step * self.n_groups
        return np.arange(base, base + self.n_groups, dtype=np.int32)


def rollout_config(config) -> RolloutConfig:
    r, v, e = config.rollout, config.validation, config.env
    return RolloutConfig(
        n_groups=r.n_groups, group_size=r.group_size, max_turns=r.max_turns, max_new_tokens=r.max_new_tokens,
        max_actions_per_turn=e.max_actions_per_turn, prompt_style=e.prompt_style,
        chat_template=config.model.chat_style, context_mode=r.context_mode,
        context_window=r.context_window if r.context_mode == "limited" else 0, mode=r.mode,
        temperature=r.temperature, val_temperature=v.temperature, val_greedy=v.greedy,
        train_seed=r.train_seed, val_seed=v.seed, format_penalty=r.format_penalty,
        max_user_tokens=r.get("max_user_tokens", 0), host_error_penalty=r.get("host_error_penalty", -0.1),
    )


# ------------------------------------------------------------------------------------------------
# Keys
# ------------------------------------------------------------------------------------------------
def env_keys(seed: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(reset_key, step_base) of one env seed (int32[]); a function of the seed only."""
    reset_key, step_base = jax.random.split(jax.random.key(seed))
    return reset_key, step_base


def step_key(step_base: jax.Array, actions_done: jax.Array) -> jax.Array:
    """The env key of a turn: fold_in(step_base, number of actions executed before it)."""
    return jax.random.fold_in(step_base, actions_done)


def sample_key(key: jax.Array, turn: int) -> jax.Array:
    """The sampler's key for turn ``turn`` (0-based)."""
    return jax.random.fold_in(key, turn)


# ------------------------------------------------------------------------------------------------
# Token pieces and the static layout
# ------------------------------------------------------------------------------------------------
def single_byte_ids(tokenizer: Tokenizer) -> dict[int, int]:
    """byte value -> the id of a non-special token that is exactly that byte (when one exists)."""
    out: dict[int, int] = {}
    for i, piece in enumerate(tokenizer.token_bytes()):
        if len(piece) == 1 and i != tokenizer.pad_id and piece[0] not in out:
            text = piece.decode("latin-1")
            if tokenizer.special_id(text) is None:
                out[piece[0]] = i
    return out


def stop_sequences(tokenizer: Tokenizer, text: str = ANSWER_CLOSE) -> tuple[tuple[int, ...], ...]:
    """Token forms of ``text`` the sampler stops on: ``encode(text)`` and, when every byte has a
    single-byte token, the byte-by-byte spelling (a char/byte tokenizer can write "</answer>" both as
    its special token and as 9 byte tokens). Other spellings of a BPE vocabulary do not stop
    generation (it then runs to EOS or the cap; the parse reads bytes and is unaffected)."""
    forms = [tuple(int(i) for i in tokenizer.encode(text))]
    by_byte = single_byte_ids(tokenizer)
    raw = text.encode("utf-8")
    if all(b in by_byte for b in raw):
        forms.append(tuple(by_byte[b] for b in raw))
    return tuple(dict.fromkeys(forms))


def make_sampler(graphdef: nnx.GraphDef, tokenizer: Tokenizer, config: RolloutConfig, greedy: bool) -> Sampler:
    """The sampler a rollout uses: N = max_new_tokens, stop at EOS or "</answer>", full-vocab log-probs."""
    return Sampler(graphdef, SamplingConfig(
        max_new_tokens=config.max_new_tokens, greedy=greedy, eos_ids=tuple(tokenizer.eos_ids),
        stop_sequences=stop_sequences(tokenizer), pad_id=tokenizer.pad_id, kv_block=config.kv_block,
        prefill_chunk=config.prefill_chunk,
    ))


@dataclasses.dataclass(frozen=True)
class PromptPieces:
    """Token ids of the fixed parts of the prompt blocks (see the module docstring).

    first_prefix = begin + system message + user_start; first_suffix = suffix = eot + after_eot +
    assistant_start + "<think>"; close_eot = eot; close_after = after_eot + user_start.
    """

    first_prefix: tuple[int, ...]
    suffix: tuple[int, ...]
    close_eot: tuple[int, ...]
    close_after: tuple[int, ...]

    @classmethod
    def build(cls, tokenizer: Tokenizer, chat: ChatTemplate, system: str) -> "PromptPieces":
        enc = lambda s: tuple(int(i) for i in tokenizer.encode(s))  # noqa: E731
        for piece in (chat.end_of_turn, chat.assistant_start, THINK_OPEN):
            if tokenizer.decode(list(enc(piece))) != piece:
                raise ValueError(f"the tokenizer does not round-trip the chat piece {piece!r}")
        return cls(
            first_prefix=enc(chat.begin + chat.message(chat.system_start, system) + chat.user_start),
            suffix=enc(chat.end_of_turn + chat.after_end_of_turn + chat.assistant_start + THINK_OPEN),
            close_eot=enc(chat.end_of_turn),
            close_after=enc(chat.after_end_of_turn + chat.user_start),
        )


@dataclasses.dataclass(frozen=True)
class SequenceLayout:
    """Static widths of the blocks; see the module docstring for the formula."""

    first_prompt: int  # P1
    later_prompt: int  # Pk
    response: int  # N
    max_turns: int

    @property
    def cache_len(self) -> int:
        """S = P1 + N + (max_turns - 1) * (Pk + N)."""
        return self.first_prompt + self.response + (self.max_turns - 1) * (self.later_prompt + self.response)

    def block_offsets(self) -> list[tuple[int, int]]:
        """[(prompt slot offset, response slot offset)] per turn."""
        out, offset = [], 0
        for turn in range(self.max_turns):
            width = self.first_prompt if turn == 0 else self.later_prompt
            out.append((offset, offset + width))
            offset += width + self.response
        return out

    def cache_bytes(self, cfg: Any, batch: int) -> int:
        return cache_bytes(cfg, batch, self.cache_len)


def pad_right(rows: Sequence[Sequence[int]], width: int, pad_id: int, what: str) -> tuple[np.ndarray, np.ndarray]:
    """(tokens int32[B, width], valid bool[B, width]) with each row at the front."""
    tokens = np.full((len(rows), width), pad_id, np.int32)
    valid = np.zeros((len(rows), width), bool)
    for i, row in enumerate(rows):
        if len(row) > width:
            raise ValueError(
                f"{what} of row {i} has {len(row)} tokens, more than its static width {width}; "
                "raise RolloutConfig.max_user_tokens (host envs) or shorten the prompt"
            )
        tokens[i, : len(row)] = row
        valid[i, : len(row)] = True
    return tokens, valid


def compact_rows(valid: jax.Array, *arrays: jax.Array) -> tuple[jax.Array, ...]:
    """Per-row stable compaction: the valid entries of each row moved to its front, zeros after.

    valid: bool[B, S]; arrays: [B, S]. Returns (*compacted [B, S], counts int32[B]).
    dest[b, s] = (number of valid entries of row b before s) where valid, else out of range (dropped).
    """
    b, s = valid.shape
    dest = jnp.where(valid, jnp.cumsum(valid, axis=1) - 1, s)
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, s))
    out = tuple(jnp.zeros_like(a).at[rows, dest].set(a, mode="drop") for a in arrays)
    return (*out, jnp.sum(valid, axis=1, dtype=jnp.int32))


def model_graphdef(model: nnx.Module | nnx.GraphDef, model_cfg: ModelConfig | None) -> tuple[nnx.GraphDef, ModelConfig]:
    """(graphdef, config) of a rollout's model, given as the module itself or as its graphdef + config
    (the parameters are passed to every run, never kept)."""
    if isinstance(model, nnx.Module):
        model_cfg = model.cfg
        model, _ = nnx.split(model)
    if model_cfg is None:
        raise ValueError("pass model_cfg=ModelConfig(...) when giving a graphdef instead of the model")
    return model, model_cfg
