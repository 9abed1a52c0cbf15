"""Solver demonstrations for the supervised warm start, written in the rollout's exact token layout.

For every seed: reset the env exactly as the rollout does (``env_keys(seed)``), then turn by turn let
the env's solver choose up to ``max_actions_per_turn`` actions from the CURRENT state (so it re-plans
after every turn, after a noisy action and after a slip), write the assistant response

    "{reasoning}</think><answer>{A1} || {A2}</answer>"      (the prompt already ends with "<think>")

where the reasoning states the facts the actions depend on, taken from the state. Solver and reasoning
are the env's own (``env.demo_policy()``, the contract in ``envs/demos.py``): this module knows no env.
Then step the env with the env's own device parse and ``step_turn`` (same keys as the rollout:
``step_key(step_base, actions executed so far)``), so rewards and the next observation are the real
ones. With probability ``noisy_fraction`` an episode gets one noisy turn (drawn uniformly among the
turns the solver's first plan needs): its first action is a random valid action other than the
solver's (preferring ones that keep the episode solvable), the rest of that turn and every later turn
come from the solver again; the reasoning still describes the state and the chosen actions truthfully.
With probability ``no_reasoning_fraction`` (drawn independently) every response of an episode leaves the
reasoning out ("</think><answer>...</answer>"): the same actions, decided without the written steps, so a
warm start can hold two ways of answering whose success differs and RL has a choice to learn.

Token layout (``ragen_jax.rollout.layout``, full-history context), built from the same pieces:

    tokens = encode(chat.first_prompt(system, turn_text(state_1, 1)))  + encode(response_1)
           + encode(chat.later_prompt(reward_text(r_1) + turn_text(state_2, 2), False)) + encode(response_2)
           + ...                                                        (until done or max_turns)

loss_mask marks the response tokens (what the rollout's loss_mask covers: the generated tokens, up to
and including the stop "</answer>"); a response never ends with the end-of-turn token, so every later
prompt starts by closing the previous assistant turn. For the character tokenizer, host ``encode`` of
the text equals the device render, so these are the tokens a rollout producing the same responses holds.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from envs.base import TextEnv
from envs.demos import DemoPolicy, TurnChoice
from ragen_jax.models.tokenizers import Tokenizer
from ragen_jax.rollout.layout import RolloutConfig, env_keys, get_chat_template, step_key

# Demonstration seeds live far from RAGEN's validation (123+) and training (10000+) seed ranges.
DEMO_SEED_BASE = 5_000_000


def response_text(choice: TurnChoice) -> str:
    """The assistant response after the prompt's "<think>": reasoning, then the "||"-joined answer."""
    return f"{choice.reasoning}</think><answer>{' || '.join(choice.actions)}</answer>"


@dataclasses.dataclass(frozen=True)
class DemoEpisode:
    """One demonstration in the rollout's compacted layout.

    tokens: int32[L]; loss_mask: bool[L] (the response tokens); turn_ids: int32[L] (0-based turn of
    every token). Per turn: prompt_lengths, response_lengths (tokens), responses (text), actions (the
    answer pieces), rewards (env turn rewards), format_ok (the device parse's verdict).
    noisy_turn: the turn with the random action, -1 for a clean episode. reasoned: False when the
    responses leave the reasoning out.
    """

    seed: int
    tokens: np.ndarray
    loss_mask: np.ndarray
    turn_ids: np.ndarray
    prompt_lengths: tuple[int, ...]
    response_lengths: tuple[int, ...]
    responses: tuple[str, ...]
    actions: tuple[tuple[str, ...], ...]
    rewards: tuple[float, ...]
    format_ok: tuple[bool, ...]
    success: bool
    noisy_turn: int
    reasoned: bool = True

    @property
    def length(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_turns(self) -> int:
        return len(self.responses)

    @property
    def episode_reward(self) -> float:
        return float(sum(self.rewards))


class _Building:
    """The growing token sequence of one episode."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.loss: list[bool] = []
        self.turn: list[int] = []
        self.prompt_lengths: list[int] = []
        self.response_lengths: list[int] = []
        self.responses: list[str] = []
        self.actions: list[tuple[str, ...]] = []
        self.rewards: list[float] = []
        self.format_ok: list[bool] = []

    def add(self, ids: Sequence[int], turn: int, loss: bool) -> None:
        self.tokens += [int(i) for i in ids]
        self.loss += [loss] * len(ids)
        self.turn += [turn] * len(ids)


class DemoWriter:
    """Writes demonstrations of one (env, env params, tokenizer, rollout settings).

    The text layer is built exactly as ``Rollout`` builds it (prompt style, max_actions_per_turn, the
    env's default response budget), so prompts and the parse match the RL-time rollout. policy: the
    solver that chooses each turn (``envs.demos.DemoPolicy``); None = the env's ``demo_policy()``.
    """

    def __init__(
        self,
        env: TextEnv,
        env_params: Any,
        tokenizer: Tokenizer,
        config: RolloutConfig,
        policy: DemoPolicy | None = None,
    ) -> None:
        self.env, self.tokenizer, self.config = env, tokenizer, config
        self.env_params = env.default_params if env_params is None else env_params
        self.layer = env.text_layer(tokenizer, self.env_params, config.prompt_style, config.max_actions_per_turn)
        self.chat = get_chat_template(config.chat_template)
        self.system = self.layer.system_text()
        self.policy = env.demo_policy() if policy is None else policy
        layer, params = self.layer, self.env_params

        def reset_one(seed):
            reset_key, step_base = env_keys(seed)
            return env.reset_env(reset_key, params)[1], step_base

        def turn_one(tokens, length, state, step_base):
            # The rollout's turn: device parse of the generated tokens, then the env's step_turn.
            parsed = layer.parse(tokens, length, state)
            new_state, reward, done, info = layer.step_turn(step_key(step_base, state.time), state, parsed)
            return new_state, reward, done, info["success"], parsed.format_ok, parsed.n_valid

        self._reset = jax.jit(jax.vmap(reset_one))
        self._turn = jax.jit(jax.vmap(turn_one))

    def write(
        self, seeds: Sequence[int], noisy_fraction: float = 0.0, rng_seed: int = 0, chunk: int = 256,
        no_reasoning_fraction: float = 0.0,
    ) -> list[DemoEpisode]:
        """One demonstration per seed (in order). noisy_fraction: probability of a noisy episode;
        no_reasoning_fraction: probability of an episode whose responses leave the reasoning out."""
        for name, value in (("noisy_fraction", noisy_fraction), ("no_reasoning_fraction", no_reasoning_fraction)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value}; set sft.{name}.")
        seeds = [int(s) for s in seeds]
        rng = np.random.default_rng(rng_seed)
        # A stream of its own, so the noisy draws (and every warm start built without this setting) stay as they were.
        unreasoned = np.random.default_rng([rng_seed, 1]).random(len(seeds)) < no_reasoning_fraction
        out: list[DemoEpisode] = []
        width = min(chunk, max(len(seeds), 1))
        for start in range(0, len(seeds), width):
            part = seeds[start:start + width]
            # Every chunk has the same number of rows (the last one padded), so reset and step compile once.
            pad = width - len(part)
            padded = part + [part[-1]] * pad
            reasoned = np.concatenate([~unreasoned[start:start + width], np.ones((pad,), bool)])
            out += self._write_chunk(padded, noisy_fraction, rng, reasoned)[: len(part)]
        return out

    # ------------------------------------------------------------------------------------------------
    def _write_chunk(self, seeds: list[int], noisy_fraction: float, rng: np.random.Generator,
                     reasoned: np.ndarray) -> list[DemoEpisode]:
        cfg, tok = self.config, self.tokenizer
        b, width = len(seeds), cfg.max_new_tokens
        states, step_bases = self._reset(jnp.asarray(seeds, jnp.int32))
        rows = [_Building() for _ in range(b)]
        noisy_turn = self._noisy_turns(jax.device_get(states), noisy_fraction, rng)
        success = np.zeros((b,), bool)
        active = np.ones((b,), bool)
        for t in range(cfg.max_turns):
            tokens = np.full((b, width), tok.pad_id, np.int32)
            lengths = np.zeros((b,), np.int32)
            host_states = jax.device_get(states)
            for i in np.flatnonzero(active):
                ids = self._demo_turn(rows[i], _row(host_states, i), t, t == noisy_turn[i], rng, bool(reasoned[i]))
                tokens[i, : len(ids)] = ids
                lengths[i] = len(ids)
            new_states, reward, done, succ, ok, n_valid = jax.device_get(
                self._turn(jnp.asarray(tokens), jnp.asarray(lengths), states, step_bases))
            for i in np.flatnonzero(active):
                if n_valid[i] != len(rows[i].actions[-1]) or not ok[i]:
                    raise RuntimeError(
                        f"the env's parse read {n_valid[i]} valid actions (format_ok={bool(ok[i])}) from the "
                        f"demonstration {rows[i].responses[-1]!r}; the demo policy must write valid answers"
                    )
                rows[i].rewards.append(float(reward[i]))
                rows[i].format_ok.append(bool(ok[i]))
                success[i] = bool(succ[i])
            live = jnp.asarray(active)
            states = jax.tree.map(
                lambda new, old: jnp.where(jnp.reshape(live, (b,) + (1,) * (new.ndim - 1)), new, old),
                new_states, states)
            active = active & ~np.asarray(done, bool)
            if not active.any():
                break
        return [
            DemoEpisode(
                seed=seeds[i], tokens=np.asarray(r.tokens, np.int32), loss_mask=np.asarray(r.loss, bool),
                turn_ids=np.asarray(r.turn, np.int32), prompt_lengths=tuple(r.prompt_lengths),
                response_lengths=tuple(r.response_lengths), responses=tuple(r.responses),
                actions=tuple(r.actions), rewards=tuple(r.rewards), format_ok=tuple(r.format_ok),
                success=bool(success[i]), noisy_turn=int(noisy_turn[i]), reasoned=bool(reasoned[i]),
            )
            for i, r in enumerate(rows)
        ]

    def _noisy_turns(self, host_states: Any, noisy_fraction: float, rng: np.random.Generator) -> np.ndarray:
        """int[b]: the turn each episode writes with the policy's deliberate mistake, -1 for none (a
        ``noisy_fraction`` of the episodes, the turn uniform over the turns its plan needs)."""
        b = len(jax.tree.leaves(host_states)[0])
        k, noisy_turn = self.config.max_actions_per_turn, np.full((b,), -1, np.int64)
        for i in range(b):
            if rng.random() < noisy_fraction:
                host = _row(host_states, i)
                turns_needed = -(-max(self.policy.plan_length(host, self.env_params), 1) // k)
                noisy_turn[i] = rng.integers(min(turns_needed, self.config.max_turns))
        return noisy_turn

    def _demo_turn(self, row: "_Building", host: Any, t: int, noisy: bool, rng: np.random.Generator,
                   reasoned: bool = True) -> list[int]:
        """Turn ``t`` of one episode: the policy's response to the state ``host`` (without its reasoning
        unless ``reasoned``), appended to ``row`` after the turn's prompt; returns the response's token ids."""
        cfg, tok, layer, chat = self.config, self.tokenizer, self.layer, self.chat
        width = cfg.max_new_tokens
        left = int(self.env.max_actions_per_episode(self.env_params)) - int(host.time)
        choice = self.policy.turn(host, self.env_params, min(cfg.max_actions_per_turn, max(left, 1)), noisy, rng)
        if not reasoned:
            choice = dataclasses.replace(choice, reasoning="")
        text = response_text(choice)
        ids = tok.encode(text)
        if len(ids) > width:
            raise ValueError(
                f"a demonstration response has {len(ids)} tokens, more than rollout.max_new_tokens="
                f"{width}; raise rollout.max_new_tokens (response: {text!r})"
            )
        if t == 0:
            prompt = chat.first_prompt(self.system, layer.turn_text(host, 1))
        else:
            user = layer.reward_text(row.rewards[-1]) + layer.turn_text(host, t + 1)
            prompt = chat.later_prompt(user, response_ended_turn=False)
        prompt_ids = tok.encode(prompt)
        row.add(prompt_ids, t, False)
        row.add(ids, t, True)
        row.prompt_lengths.append(len(prompt_ids))
        row.response_lengths.append(len(ids))
        row.responses.append(text)
        row.actions.append(tuple(choice.actions))
        return ids


def _row(states: Any, i: int) -> Any:
    """Row i of a batched (numpy) env state: the host-side view the policies read."""
    return jax.tree.map(lambda x: np.asarray(x[i]), states)


def demo_seeds(count: int, base: int = DEMO_SEED_BASE) -> np.ndarray:
    """int32[count]: the env seeds of the demonstrations (disjoint from validation and RL seeds)."""
    return base + np.arange(count, dtype=np.int32)


def demo_stats(episodes: Sequence[DemoEpisode]) -> dict[str, float]:
    """Token lengths and outcomes of a demonstration set (for logs and the benchmark)."""
    first = [e.prompt_lengths[0] for e in episodes]
    later = [p for e in episodes for p in e.prompt_lengths[1:]]
    responses = [r for e in episodes for r in e.response_lengths]
    lengths = [e.length for e in episodes]
    clean = [e for e in episodes if e.noisy_turn < 0]
    noisy = [e for e in episodes if e.noisy_turn >= 0]
    unreasoned = [e for e in episodes if not e.reasoned]
    mean = lambda xs: float(np.mean(xs)) if len(xs) else 0.0  # noqa: E731
    return {
        "episodes": float(len(episodes)),
        "noisy_episodes": float(len(noisy)),
        "success": mean([e.success for e in episodes]),
        "clean_success": mean([e.success for e in clean]),
        "noisy_success": mean([e.success for e in noisy]),
        "no_reasoning_episodes": float(len(unreasoned)),
        "turns": mean([e.num_turns for e in episodes]),
        "first_prompt_tokens": mean(first),
        "later_prompt_tokens": mean(later),
        "response_tokens": mean(responses),
        "max_response_tokens": float(max(responses)) if responses else 0.0,
        "sequence_tokens": mean(lengths),
        "max_sequence_tokens": float(max(lengths)) if lengths else 0.0,
        "reasoning_chars": mean([len(r.split("</think>")[0]) for e in episodes for r in e.responses]),
    }
