"""``Trajectories``: the static-shape batch a rollout hands to the trainer, the diagnostics and the logs.

One row per sampled episode (full-history context) or per (episode, turn) sample (limited window).
R rows, L = the static sequence length (the rollout's cache length), T = max_turns.

Per token (the conversation with the cache's holes removed, right-padded):
  tokens int32[R, L]; valid bool[R, L] (= position < lengths);
  loss_mask bool[R, L]: exactly the tokens the model generated (the trainer's assistant mask);
  logprobs f32[R, L]: the sampler's log p(token) under softmax(logits / T) over the full vocabulary,
    0 off the loss mask; equal to ``sequence_logprobs(model, tokens, valid, T)`` on the loss mask, so the
    trainer may use them as the old log-probs;  entropy f32[R, L]: the sampler's per-token entropy;
  turn_ids int32[R, L]: the 0-based turn of each token (its prompt block and its response), -1 on padding;
  reasoning_mask bool[R, L]: generated tokens before the response's first "</think>" (the opening
    "<think>" is in the prompt); empty for a response that never closes its reasoning;
  reward_tokens f32[R, L]: the sample's reward (``episode_reward``) at its last generated token, 0 elsewhere.
Per turn:
  prompt_spans int32[R, T, 2]: [start, end) of the prompt block of each turn in token coordinates (turn 1's
    block holds the system prompt); [0, 0] for turns not played;
  turn_active bool[R, T]: the turn was played; turn_rewards f32[R, T]: the env reward of the turn (what the
    next "Reward:" line shows); turn_penalties f32[R, T]: the format penalty (-0.1 when the turn was not
    format_ok), or the host-error penalty of a turn whose host-env call failed; turn_format_ok bool[R, T]; turn_valid_actions int32[R, T] (actions recognised);
    turn_executed int32[R, T] (actions the env executed); response_lengths int32[R, T].
Per row:
  episode_reward f32[R] = sum(turn_rewards) + sum(turn_penalties); success bool[R]; num_actions int32[R]
  (executed); num_valid_actions int32[R]; num_turns int32[R]; lengths int32[R]; last_token int32[R];
  group_ids int32[R]; seeds int32[R]; episode_ids int32[R]; sample_turn int32[R] (the turn a limited-window
  sample trains; -1 for full-history rows); host_error int32[R]: why a host env ended the episode early
  (``rollout.host_pool``: 0 none, 1 timeout, 2 exception, 3 crash; always 0 for on-device envs).
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from ragen_jax.models.tokenizers import Tokenizer

TOKEN_FIELDS = ("tokens", "valid", "loss_mask", "logprobs", "entropy", "turn_ids", "reasoning_mask", "reward_tokens")
TURN_FIELDS = (
    "prompt_spans", "turn_active", "turn_rewards", "turn_penalties", "turn_format_ok", "turn_valid_actions",
    "turn_executed", "response_lengths",
)
ROW_FIELDS = (
    "episode_reward", "success", "num_actions", "num_valid_actions", "num_turns", "lengths", "last_token",
    "group_ids", "seeds", "episode_ids", "sample_turn", "host_error",
)


def host_copy(x) -> np.ndarray:
    """``x`` as a numpy array on the host; a replicated multi-host array is read from this process's copy
    (np.asarray refuses an array that is not fully addressable)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        x = x.addressable_data(0)
    return np.asarray(x)


@flax.struct.dataclass
class Trajectories:
    tokens: jax.Array
    valid: jax.Array
    loss_mask: jax.Array
    logprobs: jax.Array
    entropy: jax.Array
    turn_ids: jax.Array
    reasoning_mask: jax.Array
    reward_tokens: jax.Array
    prompt_spans: jax.Array
    turn_active: jax.Array
    turn_rewards: jax.Array
    turn_penalties: jax.Array
    turn_format_ok: jax.Array
    turn_valid_actions: jax.Array
    turn_executed: jax.Array
    response_lengths: jax.Array
    episode_reward: jax.Array
    success: jax.Array
    num_actions: jax.Array
    num_valid_actions: jax.Array
    num_turns: jax.Array
    lengths: jax.Array
    last_token: jax.Array
    group_ids: jax.Array
    seeds: jax.Array
    episode_ids: jax.Array
    sample_turn: jax.Array
    host_error: jax.Array

    @property
    def num_rows(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.tokens.shape[1])

    def crop(self, width: int) -> "Trajectories":
        """The same batch with every per-token field cut to its first ``width`` positions.

        Rows are right-padded (valid = position < lengths; past a row's length its tokens are padding and
        its masks False), so any width >= max(lengths) keeps every real token: the trainer's forward sees
        the same tokens at the same positions and attends the same keys. Per-turn spans stay
        in token coordinates, which cropping the padding does not move.
        """
        if not 0 < width <= self.seq_len:
            raise ValueError(f"crop width must be in [1, {self.seq_len}], got {width}")
        return self.replace(**{name: getattr(self, name)[:, :width] for name in TOKEN_FIELDS})

    def with_episode_reward(self, episode_reward: jax.Array) -> "Trajectories":
        """The same batch learning from other episode rewards f32[R]: ``episode_reward`` and ``reward_tokens``
        replaced (placed at each row's last generated token, as ``finalize`` places the env's); the per-turn
        rewards, penalties and ``success`` stay the env's."""
        episode_reward = jnp.asarray(episode_reward, jnp.float32)
        return self.replace(episode_reward=episode_reward,
                            reward_tokens=_reward_tokens(episode_reward, self.last_token, self.seq_len, jnp))

    def to_numpy(self) -> "Trajectories":
        return jax.tree.map(np.asarray, self)

    def to_text(self, i: int, tokenizer: Tokenizer) -> str:
        """Row i as the readable conversation (special tokens written out, padding dropped)."""
        n = int(np.asarray(self.lengths)[i])
        return tokenizer.decode([int(t) for t in np.asarray(self.tokens)[i, :n]])

    def response_text(self, i: int, turn: int, tokenizer: Tokenizer) -> str:
        """The generated text of row i in turn ``turn`` (0-based)."""
        tokens = np.asarray(self.tokens)[i]
        mask = np.asarray(self.loss_mask)[i] & (np.asarray(self.turn_ids)[i] == turn)
        return tokenizer.decode([int(t) for t in tokens[mask]])


def _reward_tokens(episode_reward, last_token, length: int, xp: Any = jnp):
    """f32[R, L]: each row's episode reward at its last generated token, 0 elsewhere."""
    positions = xp.arange(length)
    return xp.where(positions[None, :] == last_token[:, None], episode_reward[:, None], 0.0).astype(xp.float32)


def finalize(
    *,
    tokens: jax.Array,
    valid: jax.Array,
    loss_mask: jax.Array,
    logprobs: jax.Array,
    entropy: jax.Array,
    turn_ids: jax.Array,
    reasoning_mask: jax.Array,
    prompt_spans: jax.Array,
    turn_active: jax.Array,
    turn_rewards: jax.Array,
    turn_penalties: jax.Array,
    turn_format_ok: jax.Array,
    turn_valid_actions: jax.Array,
    turn_executed: jax.Array,
    response_lengths: jax.Array,
    success: jax.Array,
    group_ids: jax.Array,
    seeds: jax.Array,
    episode_ids: jax.Array,
    sample_turn: jax.Array,
    host_error: jax.Array | None = None,
    xp: Any = jnp,
) -> Trajectories:
    """Derive the per-row summaries and the reward placement from compacted per-token arrays.

    Works on jax arrays inside jit (xp=jnp) and on numpy arrays on the host (xp=np), so the fused and
    the host-stepped rollouts share one definition of the derived fields.
    episode_reward = sum_t turn_rewards + sum_t turn_penalties; last_token = the last loss-mask position.
    host_error: None = no host-env failures (zeros).
    """
    length = tokens.shape[1]
    positions = xp.arange(length)
    episode_reward = (xp.sum(turn_rewards, axis=1) + xp.sum(turn_penalties, axis=1)).astype(xp.float32)
    last_token = xp.max(xp.where(loss_mask, positions[None, :], -1), axis=1).astype(xp.int32)
    reward_tokens = _reward_tokens(episode_reward, last_token, length, xp)
    return Trajectories(
        tokens=tokens.astype(xp.int32),
        valid=valid,
        loss_mask=loss_mask,
        logprobs=logprobs.astype(xp.float32),
        entropy=entropy.astype(xp.float32),
        turn_ids=xp.where(valid, turn_ids, -1).astype(xp.int32),
        reasoning_mask=reasoning_mask,
        reward_tokens=reward_tokens,
        prompt_spans=prompt_spans.astype(xp.int32),
        turn_active=turn_active,
        turn_rewards=turn_rewards.astype(xp.float32),
        turn_penalties=turn_penalties.astype(xp.float32),
        turn_format_ok=turn_format_ok,
        turn_valid_actions=turn_valid_actions.astype(xp.int32),
        turn_executed=turn_executed.astype(xp.int32),
        response_lengths=response_lengths.astype(xp.int32),
        episode_reward=episode_reward,
        success=success,
        num_actions=xp.sum(turn_executed, axis=1).astype(xp.int32),
        num_valid_actions=xp.sum(turn_valid_actions, axis=1).astype(xp.int32),
        num_turns=xp.sum(turn_active, axis=1).astype(xp.int32),
        lengths=xp.sum(valid, axis=1).astype(xp.int32),
        last_token=last_token,
        group_ids=group_ids.astype(xp.int32),
        seeds=seeds.astype(xp.int32),
        episode_ids=episode_ids.astype(xp.int32),
        sample_turn=sample_turn.astype(xp.int32),
        host_error=(xp.zeros(success.shape, xp.int32) if host_error is None else host_error.astype(xp.int32)),
    )
