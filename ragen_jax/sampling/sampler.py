"""Sampling with a static KV cache: append (prefill) and decode, jitted, with per-token log-probs.

One ``Sampler`` serves single prompts, batched rollouts and multi-turn conversations::

    graphdef, params = nnx.split(model)
    sampler = Sampler(graphdef, SamplingConfig(max_new_tokens=64, eos_ids=tok.eos_ids, pad_id=0))
    state = init_sampler_state(model.cfg, batch=B, max_len=S)
    state = sampler.append(params, state, prompt_tokens, prompt_valid)       # prefill turn 1
    out, state = sampler.generate(params, state, key, temperature, active)   # respond
    state = sampler.append(params, state, obs_tokens, obs_valid)              # turn 2 continues
    out2, state = sampler.generate(params, state, key2, temperature, active)

Shapes: tokens int32[B, T]; valid bool[B, T] (padding may be on either side, or anywhere: RoPE
positions count valid tokens only, so padding never shifts positions); active bool[B].

The cache (``ragen_jax.models.kv_cache``) has one write index shared by every row, ``cache.end``.
The buffers are static, sized for the whole conversation, and ``SamplerState.end`` is a Python int
known from the shapes alone: the most slots the calls so far can have filled (``append`` T,
``generate`` N = ``max_new_tokens``). It sizes what each call may attend: the bound rounded up to
``kv_block`` slots. What is actually filled is smaller and only known on device: ``append`` first
moves every row's tokens to the front of its cache (``kv_cache.compact``), so the holes that padding,
inactive rows and early-stopped rows leave do not pile up turn after turn; ``end`` then advances only
past columns some row filled, and attention (``models.attention.prefix_attention``) walks key blocks
up to ``end`` only. A multi-turn rollout attends its longest row, not the sum of its static blocks.
The decode loop carries the attended slots as a ``KVWindow`` (one buffer per layer, opened once per
``generate`` and widened between decode segments), so that a step reads each layer's keys and values
once and copies none of them.

Log-probs. ``logprobs[b, i]`` is log softmax(logits / T)[token] over the *full* vocabulary, computed by
``ragen_jax.models.logprobs.logprobs_from_logits`` from the float32 logits of the same model the
trainer runs, i.e. exactly what ``sequence_logprobs`` recomputes. Top-k and top-p only restrict the
distribution the token is *drawn* from; they do not change the recorded log-prob (use them for
evaluation, not for training rollouts, or the importance ratios are biased). Greedy decoding also
records the temperature-scaled full-vocabulary log-prob.

Compilation. Parameters and temperature are traced arguments (a weight update or a new temperature
never recompiles); ``SamplingConfig`` and the filled length ``end`` are static, so each function
compiles once per (batch, T, end) — in a lock-step rollout, once per turn. ``Sampler.trace_counts``
counts traces. The sampler state is donated: do not reuse a ``SamplerState`` after passing it in.

Over 400 lines: the sampler's static config, typed state, the two jitted programs (append,
generate) and the token pickers they inline belong together; the helpers at the end are thin.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ragen_jax.models.config import ModelConfig
from ragen_jax.models.kv_cache import (
    KVCache,
    KVWindow,
    close_window,
    compact,
    filled_columns,
    init_cache,
    open_window,
    widen_window,
)
from ragen_jax.models.logprobs import logprobs_from_logits


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Static sampling settings (hashable: part of the jit cache key).

    max_new_tokens: N, the decode steps of one ``generate`` (the cache always advances by N).
    greedy: argmax decoding (temperature then only scales the recorded log-probs).
    top_k: sample among the k most likely tokens (0: off).  top_p: nucleus sampling, keep the
      smallest set of most likely tokens whose probability reaches top_p (1.0: off). Both filter
      only the sampling distribution (see the module docstring).
    eos_ids: a row stops after emitting any of these (the eos token is kept in the output).
    stop_sequences: token-id tuples; a row stops after its response ends with one of them (kept in
      the output). Matched within the current response only.
    pad_id: token written where a row emits nothing.
    kv_block: attend to the filled part of the cache rounded up to a multiple of this many slots
      (0: always attend to the whole cache).
    decode_segment: split the N decode steps into loops of this many steps, each attending only to
      the slots filled by its end (0: one loop over all N steps attending to end + N slots).
    prefill_chunk: an ``append`` of more than this many columns runs the model over them this many at
      a time, and only up to the last column any row fills (0: the whole block at once). A rollout's
      prompt blocks are as wide as the longest prompt the env can render, its real prompts often
      half that: the chunks skip the padding's compute.
    early_exit: leave the decode loop as soon as every row has stopped.
    return_logits: also return the float32 logits every token was sampled from (f32[B, N, V]; for
      tests and debugging, it is B * N * V floats).
    """

    max_new_tokens: int
    greedy: bool = False
    top_k: int = 0
    top_p: float = 1.0
    eos_ids: tuple[int, ...] = ()
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    pad_id: int = 0
    kv_block: int = 64
    decode_segment: int = 0
    prefill_chunk: int = 64
    early_exit: bool = True
    return_logits: bool = False

    def __post_init__(self):
        # Accept lists from users but store tuples, so the config stays hashable.
        object.__setattr__(self, "eos_ids", tuple(int(i) for i in self.eos_ids))
        object.__setattr__(
            self, "stop_sequences", tuple(tuple(int(i) for i in s) for s in self.stop_sequences)
        )
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 turns it off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1.0 turns it off), got {self.top_p}")
        if any(len(s) == 0 for s in self.stop_sequences):
            raise ValueError("stop_sequences must not contain an empty sequence")
        if self.kv_block < 0 or self.decode_segment < 0 or self.prefill_chunk < 0:
            raise ValueError("kv_block, decode_segment and prefill_chunk must be >= 0 (0 turns them off)")


@flax.struct.dataclass
class SamplerState:
    """The conversation so far: the KV cache and the logits that predict each row's next token.

    cache: KVCache, ``cache.end`` slots filled.  last_logits: f32[B, V], the logits after each row's
    last valid token (zeros for a row that has none yet).  end: a static bound on ``cache.end`` (what
    the calls so far may have filled), so that the attended width is known at trace time.
    """

    cache: KVCache
    last_logits: jax.Array
    end: int = flax.struct.field(pytree_node=False)

    @property
    def max_len(self) -> int:
        return self.cache.max_len

    @property
    def batch(self) -> int:
        return self.cache.batch

    @classmethod
    def from_cache(cls, cache: KVCache, last_logits: jax.Array) -> "SamplerState":
        """Wrap a cache filled elsewhere (e.g. by ``repeat_rows``); reads ``cache.end`` once."""
        return cls(cache=cache, last_logits=last_logits.astype(jnp.float32), end=int(cache.end))


@flax.struct.dataclass
class SampleOutput:
    """What one ``generate`` call produced (N = max_new_tokens).

    tokens: int32[B, N], pad_id where valid is False.  logprobs, entropy: f32[B, N], log p(token) and
    the entropy of softmax(logits / T) over the full vocabulary, 0 where invalid.  valid: bool[B, N],
    a prefix of each row.  lengths: int32[B] = valid.sum(1).  stopped: bool[B], the row emitted an
    eos id or completed a stop sequence.  logits: f32[B, N, V] when ``return_logits``, else None.
    """

    tokens: jax.Array
    logprobs: jax.Array
    entropy: jax.Array
    valid: jax.Array
    lengths: jax.Array
    stopped: jax.Array
    logits: jax.Array | None = None


def init_sampler_state(cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> SamplerState:
    """An empty conversation: a zero cache of ``max_len`` slots per row and zero last logits."""
    return SamplerState(
        cache=init_cache(cfg, batch, max_len, dtype),
        last_logits=jnp.zeros((batch, cfg.vocab_size), jnp.float32),
        end=0,
    )


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def filter_logits(scaled: jax.Array, top_k: int, top_p: float) -> jax.Array:
    """Set the logits outside the top-k / top-p set to -inf (top-k first, then top-p).

    scaled: f32[B, V], logits already divided by the temperature.
    top-p keeps token v iff the probability mass of the tokens strictly more likely than v is
    < top_p (so the most likely token is always kept); ties with the cut-off logit are kept.
    """
    z = scaled
    if top_k and top_k < z.shape[-1]:
        kth = jax.lax.top_k(z, top_k)[0][:, -1:]
        z = jnp.where(z < kth, -jnp.inf, z)
    if top_p < 1.0:
        sorted_z = -jnp.sort(-z, axis=-1)
        probs = jax.nn.softmax(sorted_z, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        num_kept = jnp.maximum(jnp.sum(mass_before < top_p, axis=-1, keepdims=True), 1)
        cutoff = jnp.take_along_axis(sorted_z, num_kept - 1, axis=-1)
        z = jnp.where(z < cutoff, -jnp.inf, z)
    return z


def pick_tokens(
    logits: jax.Array, key: jax.Array, temperature: jax.Array, config: SamplingConfig
) -> jax.Array:
    """Next token per row: argmax (greedy) or a draw from filter(softmax(logits / T)).  int32[B]"""
    if config.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits.astype(jnp.float32) / temperature
    scaled = filter_logits(scaled, config.top_k, config.top_p)
    return jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)


@flax.struct.dataclass
class _DecodeCarry:
    step: jax.Array  # int32[]
    cache: KVWindow  # the attended slots of every layer
    logits: jax.Array  # f32[B, V] predicting each row's next token
    tokens: jax.Array  # int32[B, N]
    logprobs: jax.Array  # f32[B, N]
    entropy: jax.Array  # f32[B, N]
    valid: jax.Array  # bool[B, N]
    done: jax.Array  # bool[B]: stopped or inactive
    stopped: jax.Array  # bool[B]
    recent: jax.Array  # int32[B, W]: the last W tokens of the response (-1 before it starts)
    key: jax.Array
    step_logits: jax.Array | None  # f32[B, N, V] when return_logits


class Sampler:
    """Jitted ``append`` and ``generate`` for one model structure and one ``SamplingConfig``.

    graphdef: from ``nnx.split(model)`` (or pass the model itself); the parameters are passed to
    every call, so one sampler serves all weight versions of the model.
    """

    def __init__(self, graphdef: nnx.GraphDef | nnx.Module, config: SamplingConfig):
        if isinstance(graphdef, nnx.Module):
            graphdef, _ = nnx.split(graphdef)
        self.graphdef = graphdef
        self.config = config
        self.trace_counts = {"append": 0, "generate": 0}
        self._append_jit = jax.jit(self._append, donate_argnums=(1,))
        self._generate_jit = jax.jit(self._generate, donate_argnums=(1,))

    # ----------------------------------------------------------------------------- public API

    def append(
        self, params: nnx.State, state: SamplerState, tokens, valid=None
    ) -> SamplerState:
        """Append T tokens to every row (prefill, or the next turn's observation).

        tokens: int32[B, T]; valid: bool[B, T] (default all True). Returns the new state (``state``
        is donated), its bound ``end`` advanced by T; a row with no valid new token keeps its last logits.
        """
        tokens = jnp.asarray(tokens, jnp.int32)
        valid = jnp.ones(tokens.shape, bool) if valid is None else jnp.asarray(valid, bool)
        if tokens.ndim != 2 or valid.shape != tokens.shape:
            raise ValueError(
                f"tokens and valid must both be [B, T]; got {tokens.shape} and {valid.shape}"
            )
        if tokens.shape[0] != state.batch:
            raise ValueError(f"tokens have {tokens.shape[0]} rows but the state has {state.batch}")
        self._check_capacity(state, tokens.shape[1], "append")
        return self._append_jit(params, state, tokens, valid)

    def generate(
        self,
        params: nnx.State,
        state: SamplerState,
        key: jax.Array,
        temperature=1.0,
        active=None,
    ) -> tuple[SampleOutput, SamplerState]:
        """Decode up to N = max_new_tokens tokens per active row; feed every sampled token back.

        key: a PRNG key; temperature: float or f32[] (traced, > 0); active: bool[B] (default all);
        inactive rows emit nothing. Returns the ``SampleOutput`` and the new state (``state`` is
        donated), its bound ``end`` advanced by N.
        """
        if not self.config.greedy and isinstance(temperature, (int, float, np.floating)):
            if temperature <= 0:
                raise ValueError(
                    f"temperature must be > 0 for sampling, got {temperature}; "
                    "use SamplingConfig(greedy=True) for argmax decoding"
                )
        active = jnp.ones((state.batch,), bool) if active is None else jnp.asarray(active, bool)
        if active.shape != (state.batch,):
            raise ValueError(f"active must be bool[{state.batch}], got shape {active.shape}")
        self._check_capacity(state, self.config.max_new_tokens, "generate")
        temperature = jnp.asarray(temperature, jnp.float32)
        return self._generate_jit(params, state, key, temperature, active)

    # ----------------------------------------------------------------------------- internals

    def _check_capacity(self, state: SamplerState, new: int, what: str) -> None:
        if state.end + new > state.max_len:
            raise ValueError(
                f"{what} needs {new} more cache slots but only {state.max_len - state.end} of "
                f"{state.max_len} are free; size the cache with init_sampler_state(max_len=...) to "
                "the whole conversation (prompt + turns x (observation + max_new_tokens))"
            )

    def _kv_len(self, filled: int, max_len: int) -> int:
        """Static attended length: the filled slots rounded up to kv_block, at most the cache."""
        if self.config.kv_block == 0:
            return max_len
        return min(_round_up(filled, self.config.kv_block), max_len)

    def _append(self, params, state: SamplerState, tokens, valid) -> SamplerState:
        self.trace_counts["append"] += 1
        model = nnx.merge(self.graphdef, params)
        t, chunk = tokens.shape[1], self.config.prefill_chunk
        kv_len = self._kv_len(state.end + t, state.max_len)
        cache = compact(state.cache)
        if not chunk or t <= chunk:
            hidden, cache = model(tokens, valid, cache=cache, return_hidden=True, kv_len=kv_len)
            last_logits = _last_valid_logits(model, hidden, valid, state.last_logits)
            return SamplerState(cache=cache, last_logits=last_logits, end=state.end + t)

        # Chunks of columns up to the last one any row fills, appended to a window in place. A chunk
        # writes `chunk` slots from the window's end, which is at most start + (its first column), so
        # the window reaches start + t rounded up to whole chunks (past the cache's slots if need be:
        # only slots [start, start + t) go back to the cache).
        padded = -(-t // chunk) * chunk
        tokens = jnp.pad(tokens, ((0, 0), (0, padded - t)))
        valid = jnp.pad(valid, ((0, 0), (0, padded - t)))
        width = max(kv_len, state.end + padded)
        window = open_window(cache, min(width, state.max_len))
        window = widen_window(window, width)
        used = filled_columns(valid)

        def one_chunk(c, carry):
            window, last_logits = carry
            tok = jax.lax.dynamic_slice_in_dim(tokens, c * chunk, chunk, axis=1)
            val = jax.lax.dynamic_slice_in_dim(valid, c * chunk, chunk, axis=1)
            hidden, window = model(tok, val, cache=window, return_hidden=True)
            return window, _last_valid_logits(model, hidden, val, last_logits)

        window, last_logits = jax.lax.fori_loop(
            0, (used + chunk - 1) // chunk, one_chunk, (window, state.last_logits))
        cache = close_window(cache, window, cache.end, t)
        return SamplerState(cache=cache, last_logits=last_logits, end=state.end + t)

    def _generate(self, params, state: SamplerState, key, temperature, active):
        self.trace_counts["generate"] += 1
        cfg = self.config
        model = nnx.merge(self.graphdef, params)
        b, n = state.batch, cfg.max_new_tokens
        window = max((len(s) for s in cfg.stop_sequences), default=1)
        segment = cfg.decode_segment or n
        stops = [min(start + segment, n) for start in range(0, n, segment)]
        carry = _DecodeCarry(
            step=jnp.zeros((), jnp.int32),
            cache=open_window(state.cache, self._kv_len(state.end + stops[0], state.max_len)),
            logits=state.last_logits,
            tokens=jnp.full((b, n), cfg.pad_id, jnp.int32),
            logprobs=jnp.zeros((b, n), jnp.float32),
            entropy=jnp.zeros((b, n), jnp.float32),
            valid=jnp.zeros((b, n), bool),
            done=~active,
            stopped=jnp.zeros((b,), bool),
            recent=jnp.full((b, window), -1, jnp.int32),
            key=key,
            step_logits=(
                jnp.zeros((b, n, state.last_logits.shape[-1]), jnp.float32)
                if cfg.return_logits else None
            ),
        )
        for stop in stops:
            width = self._kv_len(state.end + stop, state.max_len)
            carry = carry.replace(cache=widen_window(carry.cache, width))

            def cond(c: _DecodeCarry, stop=stop):
                keep_going = c.step < stop
                if cfg.early_exit:
                    keep_going &= ~jnp.all(c.done)
                return keep_going

            def body(c: _DecodeCarry):
                return self._decode_step(model, c, temperature)

            carry = jax.lax.while_loop(cond, body, carry)

        # The window's end has advanced once per step some row emitted in.
        cache = close_window(state.cache, carry.cache, state.cache.end, n)
        out = SampleOutput(
            tokens=carry.tokens,
            logprobs=carry.logprobs,
            entropy=carry.entropy,
            valid=carry.valid,
            lengths=jnp.sum(carry.valid, axis=1, dtype=jnp.int32),
            stopped=carry.stopped,
            logits=carry.step_logits,
        )
        return out, SamplerState(cache=cache, last_logits=carry.logits, end=state.end + n)

    def _decode_step(self, model, c: _DecodeCarry, temperature) -> _DecodeCarry:
        """Sample one token per unfinished row, record it, and feed it into the cache."""
        cfg = self.config
        key, sub = jax.random.split(c.key)
        picked = pick_tokens(c.logits, sub, temperature, cfg)
        logp, entropy = logprobs_from_logits(c.logits, picked, temperature)
        emit = ~c.done
        token = jnp.where(emit, picked, cfg.pad_id)

        def put(buffer, column):
            return jax.lax.dynamic_update_slice_in_dim(buffer, column[:, None], c.step, axis=1)

        recent = jnp.where(
            emit[:, None], jnp.concatenate([c.recent[:, 1:], token[:, None]], axis=1), c.recent
        )
        stop = jnp.zeros_like(emit)
        for eos in cfg.eos_ids:
            stop |= token == eos
        for seq in cfg.stop_sequences:
            tail = recent[:, recent.shape[1] - len(seq):]
            stop |= jnp.all(tail == jnp.asarray(seq, jnp.int32), axis=1)
        stop &= emit

        step_logits = c.step_logits
        if step_logits is not None:
            step_logits = jax.lax.dynamic_update_slice_in_dim(
                step_logits, c.logits[:, None], c.step, axis=1)

        new_logits, cache = model(token[:, None], emit[:, None], cache=c.cache)
        logits = jnp.where(emit[:, None], new_logits[:, 0], c.logits)
        return _DecodeCarry(
            step=c.step + 1,
            cache=cache,
            logits=logits,
            tokens=put(c.tokens, token),
            logprobs=put(c.logprobs, jnp.where(emit, logp, 0.0)),
            entropy=put(c.entropy, jnp.where(emit, entropy, 0.0)),
            valid=put(c.valid, emit),
            done=c.done | stop,
            stopped=c.stopped | stop,
            recent=recent,
            key=key,
            step_logits=step_logits,
        )


def _last_valid_logits(model, hidden: jax.Array, valid: jax.Array, previous: jax.Array) -> jax.Array:
    """f32[B, V]: the logits at each row's last valid position of ``hidden`` [B, T, d], or ``previous``
    for a row with none. Only that position predicts the row's next token, so only it is projected."""
    t = valid.shape[1]
    last = jnp.max(jnp.where(valid, jnp.arange(t), -1), axis=1)
    hidden_last = jnp.take_along_axis(hidden, jnp.maximum(last, 0)[:, None, None], axis=1)[:, 0]
    return jnp.where((last >= 0)[:, None], model.lm_logits(hidden_last), previous)


def left_pad(
    rows: Sequence[Sequence[int]], length: int | None = None, pad_id: int = 0, multiple: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """Left-pad token lists into (tokens int32[B, L], valid bool[B, L]).

    L = ``length`` or the longest row, rounded up to ``multiple`` (a bucket, so that different
    prompts share one compiled function).
    """
    longest = max((len(r) for r in rows), default=0)
    length = longest if length is None else length
    length = _round_up(max(length, 1), multiple)
    if longest > length:
        raise ValueError(f"a row has {longest} tokens, more than the padded length {length}")
    tokens = np.full((len(rows), length), pad_id, np.int32)
    valid = np.zeros((len(rows), length), bool)
    for i, row in enumerate(rows):
        if len(row):
            tokens[i, length - len(row):] = row
            valid[i, length - len(row):] = True
    return tokens, valid


def generate_text(
    model: nnx.Module,
    tokenizer,
    prompts: Sequence[str],
    *,
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    greedy: bool = False,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
) -> list[str]:
    """Complete each prompt (one batch, stops at the tokenizer's eos ids); returns the new text.

    A convenience for people; it builds and compiles a fresh ``Sampler`` on every call.
    """
    config = SamplingConfig(
        max_new_tokens=max_new_tokens, greedy=greedy, top_k=top_k, top_p=top_p,
        eos_ids=tuple(tokenizer.eos_ids), pad_id=tokenizer.pad_id,
    )
    tokens, valid = left_pad([tokenizer.encode(p) for p in prompts], pad_id=tokenizer.pad_id,
                             multiple=16)
    graphdef, params = nnx.split(model)
    sampler = Sampler(graphdef, config)
    state = init_sampler_state(model.cfg, len(prompts), tokens.shape[1] + max_new_tokens)
    state = sampler.append(params, state, tokens, valid)
    out, _ = sampler.generate(params, state, jax.random.key(seed), temperature)
    out_tokens, out_lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    return [tokenizer.decode(out_tokens[i, : out_lengths[i]]) for i in range(len(prompts))]
