"""The cross-scoring matrix of the MI proxies: every reasoning z_m scored under every prompt x_j.

    logp_sum[m, j]  = sum_t log pi(z_m,t | x_j, z_m,<t)      (teacher forcing, current policy)
    logp_mean[m, j] = logp_sum[m, j] / max(1, |z_m|)

with log pi = log softmax(logits / temperature) in float32; RAGEN scores with the rollout temperature
(the same compute_log_prob call as the old log-probs; 1.0 by default).

Prefix reuse: the N column prompts are prefilled once into a KV cache of batch N. Then, one column at
a time (`lax.map`, `columns_per_step` columns vmapped together), the column's cache rows are broadcast
to the M rows and only the M reasonings run through the cached forward: M * N * Lz token positions
instead of M * N * (Lx + Lz) for the naive grid. The first reasoning token is predicted from the
prompt's last hidden state, which the prefill keeps.

Real widths: a rollout leaves its arrays at static widths (prompts at the cache length, reasonings
at max_new_tokens), mostly padding. Before the jitted program, on the host, the prompts are cropped
from the left and the reasonings from the right to the widest real one, rounded up to one of
`width_buckets` bucket widths (`ragen_jax.rl.update.update_width`, the update step's buckets), so the
prefill, the caches and the M * N continuations cost the real tokens and the program compiles at most
once per bucket pair. Only slots that are padding in every row are dropped; padding never shifts RoPE
positions and masked keys carry exactly zero attention weight, so the scores equal the full-width ones
up to the float32 reduction order.

Sharding: with a mesh, rows are split over its 'data' axis (padded to a multiple of its size, the
padding dropped from the result); prompts, their caches and the parameters stay as the caller placed
them (replicated by default). The same code runs on one device without a mesh.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ragen_jax.diagnostics.mi import EMA_DECAY, MarginalStdEma, mi_metrics, mi_metrics_with_ema
from ragen_jax.diagnostics.mi_sampling import MIPairs
from ragen_jax.models.kv_cache import init_cache, repeat_rows
from ragen_jax.models.logprobs import chunked_token_logprobs, sequence_logprobs
from ragen_jax.rl.update import update_width
from ragen_jax.rollout.trajectories import host_copy

# Python-side trace counts of the jitted bodies (tests assert one trace per shape), in total and by
# (prompt width, reasoning width).
TRACE_COUNTS = {"cross_score": 0, "naive_cross_score": 0}
TRACES_BY_WIDTH: dict[str, dict[tuple[int, int], int]] = {"cross_score": {}, "naive_cross_score": {}}
WIDTH_BUCKETS = 8


def _count_trace(name: str, prompt_len: int, reasoning_len: int) -> None:
    TRACE_COUNTS[name] += 1
    by_width = TRACES_BY_WIDTH[name]
    by_width[(prompt_len, reasoning_len)] = by_width.get((prompt_len, reasoning_len), 0) + 1


def real_widths(x_valid, z_valid, width_buckets: int = WIDTH_BUCKETS) -> tuple[int, int]:
    """(prompt_width, reasoning_width): the bucket widths the cross-scoring runs at (host ints).

    x_valid: bool[N, Lx]; z_valid: bool[M, Lz] (host or device arrays). The prompt extent counts from
    the first slot that is real in any row to the end (prompts keep their right end), the reasoning
    extent from the start to the last slot that is real in any row (reasonings keep their left end);
    each is rounded up by `update_width(extent, static width, width_buckets)`, the smallest bucket
    that holds it. `width_buckets` = 1 keeps the static widths.
    """
    x_any = host_copy(x_valid).astype(bool).any(axis=0)
    z_any = host_copy(z_valid).astype(bool).any(axis=0)
    prompt_extent = x_any.size - int(np.argmax(x_any)) if x_any.any() else 0
    reasoning_extent = z_any.size - int(np.argmax(z_any[::-1])) if z_any.any() else 0
    return (update_width(prompt_extent, x_any.size, width_buckets),
            update_width(reasoning_extent, z_any.size, width_buckets))


def crop_to_real_widths(
    x_tokens: jax.Array, x_valid: jax.Array, z_tokens: jax.Array, z_valid: jax.Array,
    width_buckets: int = WIDTH_BUCKETS,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The four arrays cropped to `real_widths`: [N, Lx] -> [N, prompt_width] keeping the last slots,
    [M, Lz] -> [M, reasoning_width] keeping the first slots. Every dropped slot is padding in every row,
    whatever the alignment (a left-aligned prompt array, say, is just not cropped)."""
    if width_buckets < 1:
        raise ValueError(f"width_buckets must be >= 1; got {width_buckets}.")
    # Cropped on the host (the masks are read there anyway): slicing device arrays op by op compiles a
    # small program per new width.
    x_valid, z_valid = host_copy(x_valid), host_copy(z_valid)
    prompt_width, reasoning_width = real_widths(x_valid, z_valid, width_buckets)
    prompt_len, reasoning_len = x_valid.shape[1], z_valid.shape[1]
    if prompt_width < prompt_len:
        x_tokens, x_valid = host_copy(x_tokens)[:, prompt_len - prompt_width:], x_valid[:, prompt_len - prompt_width:]
    if reasoning_width < reasoning_len:
        z_tokens, z_valid = host_copy(z_tokens)[:, :reasoning_width], z_valid[:, :reasoning_width]
    return x_tokens, x_valid, z_tokens, z_valid


def _previous_valid_index(valid: jax.Array) -> jax.Array:
    """int32[B, T]: for each position, the last valid position strictly before it (-1 if none)."""
    index = jnp.arange(valid.shape[1])
    last_valid = jax.lax.cummax(jnp.where(valid, index, -1), axis=1)
    return jnp.concatenate([jnp.full_like(last_valid[:, :1], -1), last_valid[:, :-1]], axis=1)


def _row_sums(logp: jax.Array, z_valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(sum over valid z tokens, the same divided by max(1, count)); both f32[M]."""
    total = jnp.sum(jnp.where(z_valid, logp, 0.0), axis=1)
    count = jnp.maximum(jnp.sum(z_valid, axis=1), 1).astype(jnp.float32)
    return total, total / count


def _constrain_rows(array: jax.Array, row_sharding: NamedSharding | None) -> jax.Array:
    return array if row_sharding is None else jax.lax.with_sharding_constraint(array, row_sharding)


@functools.partial(jax.jit, static_argnames=("graphdef", "columns_per_step", "row_sharding"))
def _cross_score_jit(
    graphdef, state, x_tokens, x_valid, z_tokens, z_valid, temperature,
    columns_per_step, row_sharding,
):
    model = nnx.merge(graphdef, state)
    num_cols, prompt_len = x_tokens.shape
    num_rows, reasoning_len = z_tokens.shape
    _count_trace("cross_score", prompt_len, reasoning_len)

    # Prefill every column prompt once.  hidden_x: [N, Lx, d]
    cache = init_cache(model.cfg, num_cols, prompt_len + reasoning_len)
    hidden_x, cache = model(x_tokens, x_valid, cache=cache, return_hidden=True)
    last = jnp.max(jnp.where(x_valid, jnp.arange(prompt_len), 0), axis=1)
    prompt_last_hidden = hidden_x[jnp.arange(num_cols), last]  # [N, d]: predicts the first z token

    # z position t is predicted from the last valid z position before t, or from the prompt's last.
    prev = _previous_valid_index(z_valid) + 1  # index into [prompt_last ; hidden_z]
    z_tokens = _constrain_rows(z_tokens, row_sharding)
    z_valid = _constrain_rows(z_valid, row_sharding)

    def score_column(j):
        rows_cache = repeat_rows(cache, jnp.full((num_rows,), j))
        hidden_z, _ = model(z_tokens, z_valid, cache=rows_cache, return_hidden=True)
        hidden_z = _constrain_rows(hidden_z, row_sharding)
        start = jnp.broadcast_to(prompt_last_hidden[j], (num_rows, 1, hidden_z.shape[-1]))
        stacked = jnp.concatenate([start.astype(hidden_z.dtype), hidden_z], axis=1)
        hidden_prev = jnp.take_along_axis(stacked, prev[..., None], axis=1)
        logp, _ = chunked_token_logprobs(hidden_prev, z_tokens, model.lm_logits, temperature)
        return _row_sums(logp, z_valid)

    sums, means = jax.lax.map(score_column, jnp.arange(num_cols), batch_size=columns_per_step)
    return _constrain_rows(sums.T, row_sharding), _constrain_rows(means.T, row_sharding)


@functools.partial(jax.jit, static_argnames=("graphdef", "columns_per_step", "row_sharding"))
def _naive_cross_score_jit(
    graphdef, state, x_tokens, x_valid, z_tokens, z_valid, temperature,
    columns_per_step, row_sharding,
):
    model = nnx.merge(graphdef, state)
    num_cols, prompt_len = x_tokens.shape
    num_rows = z_tokens.shape[0]
    _count_trace("naive_cross_score", prompt_len, z_tokens.shape[1])
    z_tokens = _constrain_rows(z_tokens, row_sharding)
    z_valid = _constrain_rows(z_valid, row_sharding)

    def score_column(j):
        tokens = jnp.concatenate([jnp.broadcast_to(x_tokens[j], (num_rows, prompt_len)), z_tokens], 1)
        valid = jnp.concatenate([jnp.broadcast_to(x_valid[j], (num_rows, prompt_len)), z_valid], 1)
        logp, _ = sequence_logprobs(model, tokens, valid, temperature)
        return _row_sums(logp[:, prompt_len:], z_valid)

    sums, means = jax.lax.map(score_column, jnp.arange(num_cols), batch_size=columns_per_step)
    return _constrain_rows(sums.T, row_sharding), _constrain_rows(means.T, row_sharding)


def _run(
    jitted, model, x_tokens, x_valid, z_tokens, z_valid, temperature, mesh, columns_per_step, width_buckets
) -> tuple[jax.Array, jax.Array]:
    x_tokens = jnp.asarray(x_tokens, jnp.int32)
    x_valid = jnp.asarray(x_valid, bool)
    z_tokens = jnp.asarray(z_tokens, jnp.int32)
    z_valid = jnp.asarray(z_valid, bool)
    if x_tokens.ndim != 2 or x_valid.shape != x_tokens.shape:
        raise ValueError(f"x_tokens / x_valid must both be [N, Lx]; got {x_tokens.shape}, {x_valid.shape}.")
    if z_tokens.ndim != 2 or z_valid.shape != z_tokens.shape:
        raise ValueError(f"z_tokens / z_valid must both be [M, Lz]; got {z_tokens.shape}, {z_valid.shape}.")
    num_cols = x_tokens.shape[0]
    if columns_per_step < 1:
        raise ValueError(f"columns_per_step must be >= 1; got {columns_per_step}.")
    columns_per_step = min(columns_per_step, num_cols)
    x_tokens, x_valid, z_tokens, z_valid = crop_to_real_widths(x_tokens, x_valid, z_tokens, z_valid, width_buckets)

    num_rows = z_tokens.shape[0]
    row_sharding = None
    if mesh is not None:
        if "data" not in mesh.axis_names:
            raise ValueError(f"the mesh needs a 'data' axis to split rows over; it has {mesh.axis_names}.")
        shards = mesh.shape["data"]
        padded = -(-num_rows // shards) * shards
        # Padding rows repeat the last row (as RAGEN pads to the data-parallel world size); dropped below.
        if padded != num_rows:
            extra = jnp.full((padded - num_rows,), num_rows - 1)
            z_tokens = jnp.concatenate([z_tokens, z_tokens[extra]], axis=0)
            z_valid = jnp.concatenate([z_valid, z_valid[extra]], axis=0)
        row_sharding = NamedSharding(mesh, PartitionSpec("data"))
        z_tokens = jax.device_put(z_tokens, row_sharding)
        z_valid = jax.device_put(z_valid, row_sharding)
        replicated = NamedSharding(mesh, PartitionSpec())
        x_tokens = jax.device_put(x_tokens, replicated)
        x_valid = jax.device_put(x_valid, replicated)

    graphdef, state = nnx.split(model)
    temperature = jnp.asarray(temperature, jnp.float32)
    sums, means = jitted(
        graphdef, state, x_tokens, x_valid, z_tokens, z_valid, temperature,
        columns_per_step=columns_per_step, row_sharding=row_sharding,
    )
    if sums.shape[0] != num_rows:
        sums, means = sums[:num_rows], means[:num_rows]
    return sums, means


def cross_score(
    model: nnx.Module,
    x_tokens: jax.Array,
    x_valid: jax.Array,
    z_tokens: jax.Array,
    z_valid: jax.Array,
    temperature: float | jax.Array = 1.0,
    *,
    mesh: Mesh | None = None,
    columns_per_step: int = 1,
    width_buckets: int = WIDTH_BUCKETS,
) -> tuple[jax.Array, jax.Array]:
    """Score every reasoning under every prompt, reusing each prompt's KV cache for all rows.

    Args:
      model: the policy (`Transformer`); its parameters are jit arguments (an update never recompiles).
      x_tokens: int32[N, Lx], x_valid: bool[N, Lx]: column prompts (padding anywhere; at least one
        valid token per real column). `MIPairs.x_tokens` is right-aligned, which suits this.
      z_tokens: int32[M, Lz], z_valid: bool[M, Lz]: row reasonings (padding anywhere).
      temperature: the rollout temperature (a traced scalar: changing it does not recompile).
      mesh: optional; rows are split over its 'data' axis.
      columns_per_step: columns scored together (vmapped) per step of the column loop. Memory grows
        with columns_per_step * M * (Lx + Lz) cache slots; 1 bounds it, more trades memory for speed.
      width_buckets: Lx and Lz are first cropped to their real extents rounded up to one of this many
        bucket widths (`real_widths`); 1 keeps the static widths.

    Returns: (logp_sum f32[M, N], logp_mean f32[M, N]); a row with no valid z token scores 0.
    Compiles once per (N, M, bucket widths, columns_per_step, mesh).
    """
    return _run(
        _cross_score_jit, model, x_tokens, x_valid, z_tokens, z_valid, temperature, mesh,
        columns_per_step, width_buckets,
    )


def naive_cross_score(
    model: nnx.Module,
    x_tokens: jax.Array,
    x_valid: jax.Array,
    z_tokens: jax.Array,
    z_valid: jax.Array,
    temperature: float | jax.Array = 1.0,
    *,
    mesh: Mesh | None = None,
    columns_per_step: int = 1,
    width_buckets: int = WIDTH_BUCKETS,
) -> tuple[jax.Array, jax.Array]:
    """The same matrices by a full causal forward over every [x_j ; z_m] sequence (no cache).

    What RAGEN does (N forward batches of M sequences); kept as the peer of the benchmark and as an
    executable definition of what `cross_score` computes. Same arguments and results.
    """
    return _run(
        _naive_cross_score_jit, model, x_tokens, x_valid, z_tokens, z_valid, temperature, mesh,
        columns_per_step, width_buckets,
    )


@functools.partial(jax.jit, static_argnames=("std_eps", "ema_decay"))
def pair_metrics(
    logp_sum: jax.Array,
    logp_mean: jax.Array,
    pairs: MIPairs,
    ema: MarginalStdEma,
    std_eps: float = 1e-3,
    ema_decay: float = EMA_DECAY,
) -> tuple[dict[str, jax.Array], MarginalStdEma]:
    """The MI metrics of cross-scored ``pairs`` and the updated EMA: every key of `mi_metrics` and
    `mi_metrics_with_ema`, plus `num_truncated` and `num_inconsistent` from the sampling (see `MIPairs`).
    One jitted program per matrix shape (std_eps and ema_decay are static)."""
    metrics = mi_metrics(
        logp_sum, logp_mean, pairs.true_col, pairs.col_signature, std_eps,
        row_valid=pairs.row_valid, col_valid=pairs.col_valid,
    )
    metrics, new_ema = mi_metrics_with_ema(ema, metrics, ema_decay, std_eps)
    metrics["num_truncated"] = pairs.num_truncated.astype(jnp.float32)
    metrics["num_inconsistent"] = pairs.num_inconsistent.astype(jnp.float32)
    return metrics, new_ema


def score_pairs(
    model: nnx.Module,
    pairs: MIPairs,
    ema: MarginalStdEma,
    temperature: float | jax.Array = 1.0,
    *,
    mesh: Mesh | None = None,
    columns_per_step: int = 1,
    width_buckets: int = WIDTH_BUCKETS,
    std_eps: float = 1e-3,
    ema_decay: float = EMA_DECAY,
) -> tuple[dict[str, jax.Array], MarginalStdEma]:
    """One strategy's whole diagnostic: cross-score the pairs, reduce (`pair_metrics`), update that
    strategy's EMA. The caller prefixes the metric keys with the strategy label (RAGEN:
    collapse_first_turn_sample/, collapse_trajectory_sample/)."""
    logp_sum, logp_mean = cross_score(
        model, pairs.x_tokens, pairs.x_valid, pairs.z_tokens, pairs.z_valid, temperature,
        mesh=mesh, columns_per_step=columns_per_step, width_buckets=width_buckets,
    )
    return pair_metrics(logp_sum, logp_mean, pairs, ema, std_eps, ema_decay)
