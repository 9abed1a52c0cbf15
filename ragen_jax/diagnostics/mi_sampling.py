"""Which (prompt, reasoning) pairs the MI proxies score (RAGEN ``collapse_metrics.py``, ``ctx_manager.py``).

A trajectory batch (one row per sampled multi-turn episode, full-context mode) is given as plain arrays:

    tokens:         int32[B, L]  the whole multi-turn sequence (prompt, assistant turns, observations)
    token_valid:    bool[B, L]   real tokens (padding may sit anywhere)
    reasoning_mask: bool[B, L]   the reasoning *content* tokens: inside <think>...</think>, tags excluded
    turn_ids:       int32[B, L]  the assistant turn each token belongs to (0-based; any value elsewhere)
    group_ids:      int32[B]     the prompt group of each trajectory, in [0, num_groups)

For turn t of trajectory b:
  Z = the tokens with reasoning_mask & turn_ids == t, in order;
  X = every real token before the first of them: system prompt, earlier turns and observations, the
      assistant prefix and the literal <think> tag (the tokens the policy saw before reasoning).
A turn is valid when its Z is non-empty (an empty reasoning, e.g. a format failure, is not scored)
and its X is non-empty.

Two strategies build the rows (reasonings z_m) and columns (prompts x_j) of the cross-scoring matrix:
  first-turn:   rows = `num_samples` valid first turns drawn uniformly without replacement;
                columns = prompt groups (all members of a group share the first-turn prompt), so
                N = num_groups and several rows share a column.
  trajectory:   `num_samples` draws with replacement: a trajectory uniformly among those with a valid
                turn, then one of its valid turns uniformly (Pr(m, t) = 1/M' * 1/T_m); every draw is its
                own column (N = num_samples), the column prompt being the full context up to that turn.
In both, columns whose prompt tokens are identical get the same signature (equivalent for retrieval
accuracy only). Packed outputs: prompts are right-aligned (left-padded) in [N, prompt_len], so every
prompt ends at the last slot; reasonings are left-aligned in [M, reasoning_len]. Tokens that do not
fit are dropped (a prompt keeps its most recent tokens) and counted in `num_truncated`.

Both strategies are jitted (one program per batch shape and static size): run op by op, their few
dozen small operations would each compile on first use, seconds of every training process's start.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp


class MIPairs(NamedTuple):
    """The selection one strategy hands to the cross-scoring and to `mi_metrics`.

    x_tokens: int32[N, prompt_len], x_valid: bool[N, prompt_len]: column prompts, right-aligned.
    z_tokens: int32[M, reasoning_len], z_valid: bool[M, reasoning_len]: row reasonings, left-aligned.
    true_col: int32[M]: the column each row was sampled from.
    row_valid: bool[M], col_valid: bool[N]: real rows / columns (static shapes may hold fewer).
    col_signature: int32[N]: equal for columns with identical prompt tokens (first such column index).
    row_traj, row_turn: int32[M]: the (trajectory, turn) each row came from.
    num_truncated: int32[]: real rows whose reasoning or real columns whose prompt did not fit.
    num_inconsistent: int32[]: first-turn only: real rows whose own prompt differs from their group's
      column prompt (RAGEN treats this as an error: a group must share one prompt); 0 otherwise.
    """

    x_tokens: jax.Array
    x_valid: jax.Array
    z_tokens: jax.Array
    z_valid: jax.Array
    true_col: jax.Array
    row_valid: jax.Array
    col_valid: jax.Array
    col_signature: jax.Array
    row_traj: jax.Array
    row_turn: jax.Array
    num_truncated: jax.Array
    num_inconsistent: jax.Array


def _as_arrays(tokens, token_valid, reasoning_mask, turn_ids) -> tuple[jax.Array, ...]:
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be int32[B, L]; got shape {tokens.shape}.")
    others = (
        jnp.asarray(token_valid, bool), jnp.asarray(reasoning_mask, bool), jnp.asarray(turn_ids, jnp.int32)
    )
    for name, array in zip(("token_valid", "reasoning_mask", "turn_ids"), others):
        if array.shape != tokens.shape:
            raise ValueError(f"{name} must have the shape of tokens {tokens.shape}; got {array.shape}.")
    return (tokens, *others)


def turn_layout(
    token_valid: jax.Array, reasoning_mask: jax.Array, turn_ids: jax.Array, max_turns: int
) -> tuple[jax.Array, jax.Array]:
    """(turn_valid: bool[B, T], reasoning_start: int32[B, T]) for T = max_turns.

    reasoning_start[b, t] = position of the first reasoning token of turn t (L when there is none);
    turn_valid = the turn has reasoning and at least one real token before it.
    """
    length = reasoning_mask.shape[1]
    positions = jnp.arange(length)
    turns = jnp.arange(max_turns)
    in_turn = (reasoning_mask & token_valid)[:, None, :] & (turn_ids[:, None, :] == turns[None, :, None])
    start = jnp.min(jnp.where(in_turn, positions, length), axis=2)  # [B, T]
    prompt_count = jnp.sum(token_valid[:, None, :] & (positions < start[..., None]), axis=2)
    return (start < length) & (prompt_count > 0), start.astype(jnp.int32)


def _pack(tokens: jax.Array, mask: jax.Array, out_len: int, right_align: bool) -> tuple[jax.Array, ...]:
    """Gather the masked tokens of each row, in order, into [R, out_len].

    Returns (packed int32[R, out_len] with 0 in empty slots, valid bool[R, out_len], dropped int32[R]).
    Left alignment drops the tail when a row has more than out_len tokens; right alignment drops
    the head (keeps the most recent tokens).
    """
    rows = tokens.shape[0]
    running = jnp.cumsum(mask, axis=1)
    total = running[:, -1:]
    dest = out_len - 1 - (total - running) if right_align else running - 1
    keep = mask & (dest >= 0) & (dest < out_len)
    dest = jnp.where(keep, dest, out_len)  # out of range: dropped by the scatter
    row_index = jnp.broadcast_to(jnp.arange(rows)[:, None], dest.shape)
    packed = jnp.zeros((rows, out_len), jnp.int32).at[row_index, dest].set(tokens, mode="drop")
    valid = jnp.zeros((rows, out_len), bool).at[row_index, dest].set(True, mode="drop")
    dropped = jnp.sum(mask, axis=1) - jnp.sum(keep, axis=1)
    return packed, valid, dropped.astype(jnp.int32)


def _pack_pairs(
    tokens: jax.Array,
    token_valid: jax.Array,
    reasoning_mask: jax.Array,
    turn_ids: jax.Array,
    start: jax.Array,
    traj: jax.Array,
    turn: jax.Array,
    prompt_len: int,
    reasoning_len: int,
) -> tuple[jax.Array, ...]:
    """Pack X and Z of the pairs (traj[i], turn[i]): (x, x_valid, x_dropped, z, z_valid, z_dropped)."""
    row_tokens = tokens[traj]
    positions = jnp.arange(tokens.shape[1])
    prompt_mask = token_valid[traj] & (positions[None, :] < start[traj, turn][:, None])
    z_mask = reasoning_mask[traj] & token_valid[traj] & (turn_ids[traj] == turn[:, None])
    x, x_valid, x_dropped = _pack(row_tokens, prompt_mask, prompt_len, right_align=True)
    z, z_valid, z_dropped = _pack(row_tokens, z_mask, reasoning_len, right_align=False)
    return x, x_valid, x_dropped, z, z_valid, z_dropped


def prompt_signatures(x_tokens: jax.Array, x_valid: jax.Array, col_valid: jax.Array) -> jax.Array:
    """int32[N]: for each column, the index of the first real column with identical prompt tokens.

    Packed prompts are aligned the same way, so identical token sequences have identical arrays.
    Padded columns get their own index (they never match anything in `mi_metrics`).
    """
    num_cols = x_tokens.shape[0]
    same_tokens = jnp.all(
        (x_tokens[:, None, :] == x_tokens[None, :, :]) & (x_valid[:, None, :] == x_valid[None, :, :]),
        axis=2,
    )
    same = same_tokens & col_valid[:, None] & col_valid[None, :]
    first = jnp.argmax(same, axis=1)
    return jnp.where(col_valid, first, jnp.arange(num_cols)).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("num_samples", "num_groups", "prompt_len", "reasoning_len"))
def sample_first_turn_pairs(
    key: jax.Array,
    tokens: jax.Array,
    token_valid: jax.Array,
    reasoning_mask: jax.Array,
    turn_ids: jax.Array,
    group_ids: jax.Array,
    *,
    num_samples: int,
    num_groups: int,
    prompt_len: int,
    reasoning_len: int,
) -> MIPairs:
    """First-turn strategy: M = min(num_samples, B) rows, N = num_groups columns (one per group).

    Rows: valid first turns drawn uniformly without replacement (all of them, when there are no more
    than num_samples; then the surplus rows are padding). Column g: the first-turn prompt of the
    first drawn row of group g; a group with no drawn row is a padded column.
    """
    tokens, token_valid, reasoning_mask, turn_ids = _as_arrays(tokens, token_valid, reasoning_mask, turn_ids)
    group_ids = jnp.asarray(group_ids, jnp.int32)
    batch = tokens.shape[0]
    num_rows = min(num_samples, batch)
    turn_valid, start = turn_layout(token_valid, reasoning_mask, turn_ids, max_turns=1)
    first_valid = turn_valid[:, 0]
    # Uniform subset without replacement: the top-k of iid uniform scores; invalid turns rank last.
    scores = jnp.where(first_valid, jax.random.uniform(key, (batch,)), -1.0)
    _, traj = jax.lax.top_k(scores, num_rows)
    row_valid = first_valid[traj]
    turn = jnp.zeros(num_rows, jnp.int32)
    x_row, x_row_valid, x_dropped, z, z_valid, z_dropped = _pack_pairs(
        tokens, token_valid, reasoning_mask, turn_ids, start, traj, turn, prompt_len, reasoning_len
    )

    true_col = group_ids[traj].astype(jnp.int32)
    in_group = row_valid[None, :] & (true_col[None, :] == jnp.arange(num_groups)[:, None])  # [N, M]
    col_valid = jnp.any(in_group, axis=1)
    representative = jnp.argmax(in_group, axis=1)  # first drawn row of each group
    x_tokens = x_row[representative]
    x_valid = x_row_valid[representative] & col_valid[:, None]
    x_tokens = jnp.where(x_valid, x_tokens, 0)

    own_prompt_matches = jnp.all(
        (x_row == x_tokens[true_col]) & (x_row_valid == x_valid[true_col]), axis=1
    )
    truncated = jnp.sum(row_valid & (z_dropped > 0)) + jnp.sum(col_valid & (x_dropped[representative] > 0))
    return MIPairs(
        x_tokens=x_tokens,
        x_valid=x_valid,
        z_tokens=z,
        z_valid=z_valid & row_valid[:, None],
        true_col=jnp.where(row_valid, true_col, 0),
        row_valid=row_valid,
        col_valid=col_valid,
        col_signature=prompt_signatures(x_tokens, x_valid, col_valid),
        row_traj=traj.astype(jnp.int32),
        row_turn=turn,
        num_truncated=truncated.astype(jnp.int32),
        num_inconsistent=jnp.sum(row_valid & ~own_prompt_matches).astype(jnp.int32),
    )


@functools.partial(jax.jit, static_argnames=("num_samples", "max_turns", "prompt_len", "reasoning_len"))
def sample_trajectory_pairs(
    key: jax.Array,
    tokens: jax.Array,
    token_valid: jax.Array,
    reasoning_mask: jax.Array,
    turn_ids: jax.Array,
    *,
    num_samples: int,
    max_turns: int,
    prompt_len: int,
    reasoning_len: int,
) -> MIPairs:
    """Trajectory-uniform strategy: M = N = num_samples, row m is column m (true_col = arange).

    Each draw: a trajectory uniformly among those with at least one valid turn, then a valid turn of
    it uniformly, with replacement. RAGEN draws the trajectory among all of them and drops the draw
    when it has no valid turn; conditioning on a kept draw gives the same distribution, and keeping
    the count fixed keeps the shape static. As in RAGEN, at most (number of valid turns) draws are
    made; the rest are padding rows and columns.
    """
    tokens, token_valid, reasoning_mask, turn_ids = _as_arrays(tokens, token_valid, reasoning_mask, turn_ids)
    batch = tokens.shape[0]
    turn_valid, start = turn_layout(token_valid, reasoning_mask, turn_ids, max_turns)
    has_turn = jnp.any(turn_valid, axis=1)
    key_traj, key_turn = jax.random.split(key)
    traj = jax.random.categorical(
        key_traj, jnp.where(has_turn, 0.0, -jnp.inf), shape=(num_samples,)
    )
    traj = jnp.clip(traj, 0, batch - 1)
    turn_logits = jnp.where(turn_valid[traj], 0.0, -jnp.inf)  # [M, T]
    turn = jax.random.categorical(key_turn, turn_logits, axis=1)
    turn = jnp.clip(turn, 0, max_turns - 1).astype(jnp.int32)
    total_pairs = jnp.sum(turn_valid)
    row_valid = (jnp.arange(num_samples) < total_pairs) & turn_valid[traj, turn]

    x, x_valid, x_dropped, z, z_valid, z_dropped = _pack_pairs(
        tokens, token_valid, reasoning_mask, turn_ids, start, traj, turn, prompt_len, reasoning_len
    )
    x_valid = x_valid & row_valid[:, None]
    truncated = jnp.sum(row_valid & ((z_dropped > 0) | (x_dropped > 0)))
    return MIPairs(
        x_tokens=jnp.where(x_valid, x, 0),
        x_valid=x_valid,
        z_tokens=z,
        z_valid=z_valid & row_valid[:, None],
        true_col=jnp.arange(num_samples, dtype=jnp.int32),
        row_valid=row_valid,
        col_valid=row_valid,
        col_signature=prompt_signatures(x, x_valid, row_valid),
        row_traj=traj.astype(jnp.int32),
        row_turn=turn,
        num_truncated=truncated.astype(jnp.int32),
        num_inconsistent=jnp.zeros((), jnp.int32),
    )
