"""Host-stepped rollouts: envs step on the host turn by turn; prefill and decode stay batched on device.

Full-history mode (``run_host_rollout``) builds exactly the cache layout of the fused rollout: each
turn's prompt block is the chat-templated user message tokenized with ``tokenizer.encode`` and placed
at the front of a block of the static width, then one batched ``Sampler.append`` and one batched
``Sampler.generate`` run on device; the generated text goes to each row's ``HostEnv.step``. For the
character tokenizer ``encode`` of the text equals the device render's tokens, which is what makes the
fused and host-stepped rollouts identical; a BPE tokenizer may merge across the rendered fragments,
so the two tokenizations of the same text can differ there (both are valid, the rollouts then differ).

Everything after decoding (reasoning masks, spans, compaction) is plain Python / numpy here, an
implementation independent of the fused path's device code.

Limited-window mode (``run_host_limited_rollout``, RAGEN ``limited_multi_turn``): the prompt of turn t is
the system message and the last ``context_window`` turns (the current one included), re-prefilled into a
fresh cache every turn; every played (episode, turn) is its own sample row (row = episode * T + turn),
training only that turn's response, with the episode's reward at its last token.

The envs of a rollout are an ``EnvBatch`` (``host_pool``): a list of env instances (stepped here, their
exceptions propagate: the reference), ``InProcessEnvs`` or a ``HostEnvPool`` of worker processes. A row
whose env call fails (``Failure``: timeout, exception, dead worker) ends there: the failed turn is played
(its response is kept and trained) with no env reward and ``config.host_error_penalty`` as its penalty,
and ``Trajectories.host_error`` holds the failure's kind; a row whose reset failed plays no turn.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx

from ragen_jax.models.config import ModelConfig
from ragen_jax.models.tokenizers import Tokenizer
from ragen_jax.rollout.host_envs import HostEnv, HostStep
from ragen_jax.rollout.host_pool import EnvBatch, Failure, InProcessEnvs
from ragen_jax.rollout.layout import (
    model_graphdef,
    THINK_CLOSE,
    ChatTemplate,
    PromptPieces,
    RolloutConfig,
    SequenceLayout,
    get_chat_template,
    make_sampler,
    pad_right,
    sample_key,
)
from ragen_jax.rollout.trajectories import Trajectories, finalize
from ragen_jax.sampling.sampler import Sampler, init_sampler_state


def host_layout(tokenizer: Tokenizer, chat: ChatTemplate, env: HostEnv, config: RolloutConfig) -> SequenceLayout:
    """Block widths for host envs: a user message takes at most ``config.max_user_tokens`` tokens."""
    if config.max_user_tokens < 1:
        raise ValueError("host envs need RolloutConfig.max_user_tokens >= 1 (the static width of a user message)")
    pieces = PromptPieces.build(tokenizer, chat, env.system_text())
    u = config.max_user_tokens
    first = len(pieces.first_prefix) + u + len(pieces.suffix)
    later = len(pieces.close_eot) + len(pieces.close_after) + u + len(pieces.suffix)
    return SequenceLayout(first, later, config.max_new_tokens, config.max_turns)


def reasoning_flags(tokenizer: Tokenizer, response: Sequence[int]) -> np.ndarray:
    """bool[len(response)]: tokens whose bytes end at or before the first "</think>" (none if absent)."""
    table = tokenizer.token_bytes()
    pieces = [b"" if t == tokenizer.pad_id or not 0 <= t < len(table) else table[t] for t in response]
    close = b"".join(pieces).find(THINK_CLOSE.encode())
    ends = np.cumsum([len(p) for p in pieces]) if pieces else np.zeros((0,), np.int64)
    return (ends <= close) if close >= 0 else np.zeros((len(response),), bool)


def response_text(tokenizer: Tokenizer, response: Sequence[int], limit: int | None) -> str:
    """The text a host env reads: the response's bytes, cut at ``limit`` (the env's
    ``max_response_bytes`` when it declares one: an on-device parse's byte cap), decoded as UTF-8 with
    replacement."""
    if limit is None:
        return tokenizer.decode(list(response))
    table = tokenizer.token_bytes()
    raw = b"".join(b"" if t == tokenizer.pad_id else table[t] for t in response)
    return raw[:limit].decode("utf-8", errors="replace")


class _Row:
    """The growing conversation of one episode (compacted: no holes)."""

    def __init__(self, num_turns: int) -> None:
        self.tokens: list[int] = []
        self.loss: list[bool] = []
        self.logp: list[float] = []
        self.ent: list[float] = []
        self.turn: list[int] = []
        self.reason: list[bool] = []
        self.spans = np.zeros((num_turns, 2), np.int32)

    def add(self, tokens, turn, loss=False, logp=None, ent=None, reason=None) -> None:
        n = len(tokens)
        self.tokens += [int(t) for t in tokens]
        self.loss += [loss] * n
        self.logp += list(np.zeros(n) if logp is None else logp)
        self.ent += list(np.zeros(n) if ent is None else ent)
        self.turn += [turn] * n
        self.reason += list(np.zeros(n, bool) if reason is None else reason)


def _generate(sampler: Sampler, params, state, blocks: list[list[int]], width: int, key, temperature, active, pad_id,
              timer: dict[str, float] | None = None):
    """Prefill the blocks and decode one turn; ``timer`` (optional) accumulates seconds per phase."""
    start = time.perf_counter()
    tokens, valid = pad_right(blocks, width, pad_id, "prompt block")
    state = sampler.append(params, state, tokens, valid)
    if timer is not None:
        jax.block_until_ready(state)
        timer["prefill"] = timer.get("prefill", 0.0) + time.perf_counter() - start
        start = time.perf_counter()
    out, state = sampler.generate(params, state, key, temperature, np.asarray(active))
    out = jax.tree.map(np.asarray, out)
    if timer is not None:
        timer["decode"] = timer.get("decode", 0.0) + time.perf_counter() - start
    return out, state


def _stack_rows(rows: list[_Row], length: int, per_turn: dict[str, np.ndarray], success, group_ids, seeds,
                episode_ids, sample_turn, host_error) -> Trajectories:
    r = len(rows)
    arrays = {k: np.zeros((r, length), dt) for k, dt in (
        ("tokens", np.int32), ("loss", bool), ("logp", np.float32), ("ent", np.float32), ("turn", np.int32), ("reason", bool))}
    lengths = np.zeros((r,), np.int32)
    for i, row in enumerate(rows):
        n = len(row.tokens)
        if n > length:
            raise ValueError(f"row {i} has {n} tokens, more than the static length {length}")
        for name, values in (("tokens", row.tokens), ("loss", row.loss), ("logp", row.logp), ("ent", row.ent),
                             ("turn", row.turn), ("reason", row.reason)):
            arrays[name][i, :n] = values
        lengths[i] = n
    valid = np.arange(length)[None, :] < lengths[:, None]
    return finalize(
        tokens=arrays["tokens"], valid=valid, loss_mask=arrays["loss"], logprobs=arrays["logp"],
        entropy=arrays["ent"], turn_ids=arrays["turn"], reasoning_mask=arrays["reason"],
        prompt_spans=np.stack([row.spans for row in rows]), turn_active=per_turn["active"],
        turn_rewards=per_turn["reward"], turn_penalties=per_turn["penalty"], turn_format_ok=per_turn["ok"],
        turn_valid_actions=per_turn["n_valid"], turn_executed=per_turn["n_exec"],
        response_lengths=per_turn["resp_len"], success=np.asarray(success, bool), group_ids=np.asarray(group_ids),
        seeds=np.asarray(seeds), episode_ids=np.asarray(episode_ids), sample_turn=np.asarray(sample_turn),
        host_error=np.asarray(host_error), xp=np,
    )


def _per_turn(b: int, t: int) -> dict[str, np.ndarray]:
    return {"active": np.zeros((b, t), bool), "reward": np.zeros((b, t), np.float32),
            "penalty": np.zeros((b, t), np.float32), "ok": np.zeros((b, t), bool),
            "n_valid": np.zeros((b, t), np.int32), "n_exec": np.zeros((b, t), np.int32),
            "resp_len": np.zeros((b, t), np.int32)}


def _record(per_turn, i: int, t: int, step: HostStep | Failure, length: int, config: RolloutConfig) -> None:
    per_turn["active"][i, t] = True
    per_turn["resp_len"][i, t] = length
    if isinstance(step, Failure):
        per_turn["penalty"][i, t] = config.host_error_penalty
        return
    per_turn["reward"][i, t] = step.reward
    per_turn["penalty"][i, t] = 0.0 if step.format_ok else config.format_penalty
    per_turn["ok"][i, t] = step.format_ok
    per_turn["n_valid"][i, t] = step.n_valid
    per_turn["n_exec"][i, t] = step.n_executed


class _Episodes:
    """The rows' env side: the batch of envs, what reset reported, each row's error kind."""

    def __init__(self, envs: Sequence[HostEnv] | EnvBatch, row_seeds: np.ndarray) -> None:
        self.batch = InProcessEnvs(envs=envs, catch=False) if isinstance(envs, (list, tuple)) else envs
        b = len(row_seeds)
        self.active = np.ones((b,), bool)
        self.success = np.zeros((b,), bool)
        self.error = np.zeros((b,), np.int32)
        self.systems, self.users, self.limits = [""] * b, [""] * b, [None] * b
        for i, start in enumerate(self.batch.reset([int(s) for s in row_seeds])):
            if isinstance(start, Failure):
                self.active[i], self.error[i] = False, start.kind
            else:
                self.systems[i], self.users[i], self.limits[i] = start.system_text, start.user_text, start.max_response_bytes

    def step(self, texts: dict[int, str]) -> dict[int, HostStep | Failure]:
        results = self.batch.step(texts)
        for i, result in results.items():
            if isinstance(result, Failure):
                self.error[i] = result.kind
                self.active[i] = False
                self.success[i] = False
            else:
                self.active[i] = not result.done
        return results


def run_host_rollout(
    sampler: Sampler, params: nnx.State, model_cfg: ModelConfig, envs: Sequence[HostEnv], seeds: np.ndarray,
    key: jax.Array, temperature: Any, layout: SequenceLayout, tokenizer: Tokenizer, chat: ChatTemplate,
    config: RolloutConfig, timer: dict[str, float] | None = None,
) -> Trajectories:
    """Full-history rollout of B = len(envs) host envs; row b resets from seeds[b // group_size].

    timer: optional dict that accumulates seconds of "prefill", "decode" and "env" (rendering,
    tokenizing, parsing and stepping on the host)."""
    if config.context_mode == "limited":
        return run_host_limited_rollout(sampler, params, model_cfg, envs, seeds, key, temperature, layout,
                                        tokenizer, chat, config, timer)
    n_turns = config.max_turns
    env_start = time.perf_counter()
    row_seeds = np.repeat(np.asarray(seeds, np.int32), config.group_size)
    b = len(row_seeds)
    episodes = _Episodes(envs, row_seeds)
    rows = [_Row(n_turns) for _ in range(b)]
    per_turn = _per_turn(b, n_turns)
    success, active, users, systems = episodes.success, episodes.active, episodes.users, episodes.systems
    ended_turn = np.zeros((b,), bool)
    state = init_sampler_state(model_cfg, b, layout.cache_len)
    eot = tokenizer.encode(chat.end_of_turn)
    for t in range(n_turns):
        blocks = []
        for i in range(b):
            if not active[i]:
                blocks.append([])
                continue
            text = chat.first_prompt(systems[i], users[i]) if t == 0 else chat.later_prompt(users[i], ended_turn[i])
            blocks.append(tokenizer.encode(text))
        width = layout.first_prompt if t == 0 else layout.later_prompt
        if timer is not None:
            timer["env"] = timer.get("env", 0.0) + time.perf_counter() - env_start
        out, state = _generate(sampler, params, state, blocks, width, sample_key(key, t), temperature, active,
                               tokenizer.pad_id, timer)
        env_start = time.perf_counter()
        texts = {}
        for i in np.flatnonzero(active):
            n = int(out.lengths[i])
            response = [int(x) for x in out.tokens[i, :n]]
            rows[i].spans[t] = (len(rows[i].tokens), len(rows[i].tokens) + len(blocks[i]))
            rows[i].add(blocks[i], t)
            rows[i].add(response, t, True, out.logprobs[i, :n], out.entropy[i, :n], reasoning_flags(tokenizer, response))
            texts[int(i)] = response_text(tokenizer, response, episodes.limits[i])
            ended_turn[i] = len(response) >= len(eot) and response[len(response) - len(eot):] == list(eot)
        for i, step in episodes.step(texts).items():
            _record(per_turn, i, t, step, int(out.lengths[i]), config)
            if not isinstance(step, Failure):
                success[i] = step.success
                users[i] = step.next_user_text
    if timer is not None:
        timer["env"] = timer.get("env", 0.0) + time.perf_counter() - env_start
    return _stack_rows(rows, layout.cache_len, per_turn, success, np.arange(b) // config.group_size, row_seeds,
                       np.arange(b), np.full((b,), -1), episodes.error)


def limited_prompt_len(layout: SequenceLayout, window: int) -> int:
    """Static width of a limited-window prompt: block 1 + (window - 1) x (response + later block),
    an upper bound because every windowed user message fits a later block."""
    return layout.first_prompt + layout.later_prompt + (window - 1) * (layout.response + layout.later_prompt)


def run_host_limited_rollout(
    sampler: Sampler, params: nnx.State, model_cfg: ModelConfig, envs: Sequence[HostEnv], seeds: np.ndarray,
    key: jax.Array, temperature: Any, layout: SequenceLayout, tokenizer: Tokenizer, chat: ChatTemplate,
    config: RolloutConfig, timer: dict[str, float] | None = None,
) -> Trajectories:
    """Limited-window rollout; returns B x T sample rows (row = episode * T + turn; unplayed turns are
    empty rows with turn_active all False). Prompt of turn t = system + turns max(0, t-k+1)..t."""
    n_turns, k = config.max_turns, config.context_window
    width = limited_prompt_len(layout, k)
    row_seeds = np.repeat(np.asarray(seeds, np.int32), config.group_size)
    b = len(row_seeds)
    episodes = _Episodes(envs, row_seeds)
    per_turn = _per_turn(b, n_turns)
    success, active, systems = episodes.success, episodes.active, episodes.systems
    users = [[user] for user in episodes.users]
    responses: list[list[list[int]]] = [[] for _ in range(b)]
    samples = [[_Row(n_turns) for _ in range(n_turns)] for _ in range(b)]
    eot = tokenizer.encode(chat.end_of_turn)
    for t in range(n_turns):
        prompts: list[list[list[int]]] = []  # per row: the prompt as (message block tokens, response) pieces
        for i in range(b):
            if not active[i]:
                prompts.append([])
                continue
            first = max(0, t - k + 1)
            pieces = [tokenizer.encode(chat.first_prompt(systems[i], users[i][first]))]
            for j in range(first + 1, t + 1):
                previous = responses[i][j - 1]
                ended = len(previous) >= len(eot) and previous[len(previous) - len(eot):] == list(eot)
                pieces += [previous, tokenizer.encode(chat.later_prompt(users[i][j], ended))]
            prompts.append(pieces)
        state = init_sampler_state(model_cfg, b, width + layout.response)
        blocks = [[tok for piece in pieces for tok in piece] for pieces in prompts]
        out, _ = _generate(sampler, params, state, blocks, width, sample_key(key, t), temperature, active,
                           tokenizer.pad_id, timer)
        texts = {}
        for i in np.flatnonzero(active):
            n = int(out.lengths[i])
            response = [int(x) for x in out.tokens[i, :n]]
            row = samples[i][t]
            first = max(0, t - k + 1)
            for p, piece in enumerate(prompts[i]):
                row.add(piece, first + p // 2)
            row.spans[t] = (len(row.tokens) - len(prompts[i][-1]), len(row.tokens))
            row.add(response, t, True, out.logprobs[i, :n], out.entropy[i, :n], reasoning_flags(tokenizer, response))
            responses[i].append(response)
            texts[int(i)] = response_text(tokenizer, response, episodes.limits[i])
        for i, step in episodes.step(texts).items():
            _record(per_turn, i, t, step, int(out.lengths[i]), config)
            if not isinstance(step, Failure):
                success[i] = step.success
                users[i].append(step.next_user_text)
    flat = [samples[i][t] for i in range(b) for t in range(n_turns)]
    episode = np.repeat(np.arange(b), n_turns)
    per_sample = {name: value[episode] for name, value in per_turn.items()}
    return _stack_rows(flat, width + layout.response, per_sample, success[episode],
                       episode // config.group_size, row_seeds[episode], episode, np.tile(np.arange(n_turns), b),
                       episodes.error[episode])


class HostRollout:
    """Rollouts of envs written in plain Python (the ``HostEnv`` protocol).

    make_env: a callable returning a fresh ``HostEnv`` (one per row and episode). envs: where they run,
    an ``EnvBatch`` shared by every rollout that uses it (a ``HostEnvPool`` of worker processes; default
    ``InProcessEnvs(make_env)``, here, exceptions caught). ``run(params, key, seeds, temperature=None,
    env_params=None, greedy=False) -> Trajectories`` with seeds int[n_groups]. The block widths come from
    ``config.max_user_tokens`` (``host_layout``; the system message from one ``make_env()`` built here),
    or ``layout`` when given (e.g. the fused rollout's, to compare the two). ``close()`` closes the envs.
    """

    trace_count = 0  # nothing of a host rollout is one jitted program (the sampler's are counted there)

    def __init__(self, model: nnx.Module | nnx.GraphDef, tokenizer: Tokenizer, make_env: Any, config: RolloutConfig,
                 envs: EnvBatch | None = None, model_cfg: ModelConfig | None = None,
                 layout: SequenceLayout | None = None) -> None:
        self.graphdef, self.model_cfg = model_graphdef(model, model_cfg)
        self.tokenizer, self.make_env, self.config = tokenizer, make_env, config
        self.envs = InProcessEnvs(make_env) if envs is None else envs
        self.chat = get_chat_template(config.chat_template)
        self.layout = host_layout(tokenizer, self.chat, make_env(), config) if layout is None else layout
        self.samplers = {g: make_sampler(self.graphdef, tokenizer, config, g) for g in (False, True)}

    @property
    def cache_len(self) -> int:
        return self.layout.cache_len

    def run(self, params: nnx.State, key: jax.Array, seeds: Any, temperature: Any = None, env_params: Any = None,
            greedy: bool = False, mode: str | None = None, timer: dict[str, float] | None = None) -> Trajectories:
        """env_params and mode are accepted for the signature of ``Rollout.run`` (a host env takes its
        parameters when it is built; mode must be "host"). timer: see ``run_host_rollout``."""
        if env_params is not None or mode not in (None, "host"):
            raise ValueError("a HostRollout takes no env_params and runs in mode 'host' only")
        seeds = np.asarray(seeds, np.int32)
        if seeds.shape != (self.config.n_groups,):
            raise ValueError(f"seeds must have shape ({self.config.n_groups},) (one per group), got {seeds.shape}")
        temperature = self.config.temperature if temperature is None else temperature
        return run_host_rollout(self.samplers[greedy], params, self.model_cfg, self.envs, seeds, key, temperature,
                                self.layout, self.tokenizer, self.chat, self.config, timer)

    def close(self) -> None:
        self.envs.close()
