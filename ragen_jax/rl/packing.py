"""Rows packed into fewer rows of the same width, so the update's forward and backward run on real tokens.

A rollout row holds one episode right-padded to the batch's width W; on a multi-turn task most rows end
far before W (FrozenLake's default: a 32-row batch of 1,000-slot rows is about 40% tokens). Packing puts
several rows' tokens side by side in one row, each as a contiguous run marked by a segment id, and the
model then keeps them apart (``Transformer.__call__(segments=...)``: attention within a segment,
positions from its start) and the losses count each run as one sequence (``rl/losses.aggregate``). The
packed batch keeps R rows of width W, so its shapes are static; its last rows are empty, and the update
skips micro-batches that hold no token.

    plan = pack_plan(lengths, width)      # lengths int32[R], tokens 0 .. length - 1 of each row
    packed = pack(plan, x)                # x [R, W, ...] -> [R, W, ...], 0 on the packed rows' padding
    plan.segments                         # int32[R, W]: 1 + the source row of each position, 0 = padding

The placement is first-fit decreasing (Johnson 1973): rows by decreasing length, each into the first
packed row with room, so the rows used are a prefix and at most 11/9 of the fewest possible plus one.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class PackPlan(NamedTuple):
    """Where each position of the packed rows reads its token from.

    source int32[R, W]: flat index (row * W + column) into the unpacked [R, W] batch, -1 on padding;
    segments int32[R, W]: 1 + that source row, 0 on padding; rows_used int32[]: packed rows holding a
    token (rows 0 .. rows_used - 1).
    """

    source: jax.Array
    segments: jax.Array
    rows_used: jax.Array


def pack_plan(lengths: jax.Array, width: int) -> PackPlan:
    """First-fit-decreasing placement of R rows of ``lengths`` (int32[R], each <= width) into R rows of
    ``width`` (static), row r's tokens kept in order as one run."""
    rows = lengths.shape[0]
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, width)
    order = jnp.argsort(-lengths, stable=True)

    def place(fill, row):
        # the first packed row with room; one exists, since every row fits an empty one
        target = jnp.argmax(fill + lengths[row] <= width)
        return fill.at[target].add(lengths[row]), (target, fill[target])

    fill, (target, offset) = jax.lax.scan(place, jnp.zeros(rows, jnp.int32), order)
    target = jnp.zeros(rows, jnp.int32).at[order].set(target)
    offset = jnp.zeros(rows, jnp.int32).at[order].set(offset)
    column = jnp.arange(width, dtype=jnp.int32)
    row = jnp.arange(rows, dtype=jnp.int32)
    inside = column[None, :] < lengths[:, None]
    dest = jnp.where(inside, target[:, None] * width + offset[:, None] + column[None, :], rows * width)
    flat = lambda x: x.reshape(-1)  # noqa: E731
    source = jnp.full(rows * width, -1, jnp.int32).at[flat(dest)].set(
        flat(row[:, None] * width + column[None, :]), mode="drop")
    segments = jnp.zeros(rows * width, jnp.int32).at[flat(dest)].set(
        flat(jnp.broadcast_to(row[:, None] + 1, dest.shape)), mode="drop")
    return PackPlan(source.reshape(rows, width), segments.reshape(rows, width), jnp.sum(fill > 0, dtype=jnp.int32))


def pack(plan: PackPlan, x: jax.Array) -> jax.Array:
    """x [R, W, ...] -> the packed [R, W, ...]: position (p, c) holds x at ``plan.source[p, c]``, and zeros
    (False) where that is -1."""
    rows, width = plan.source.shape
    taken = jnp.take(x.reshape(rows * width, *x.shape[2:]), jnp.maximum(plan.source, 0).reshape(-1), axis=0)
    taken = taken.reshape(rows, width, *x.shape[2:])
    on = (plan.source >= 0).reshape(rows, width, *([1] * (x.ndim - 2)))
    return jnp.where(on, taken, jnp.zeros((), x.dtype))


def row_lengths(valid: jax.Array) -> jax.Array:
    """int32[R]: 1 + the last valid column of each row of valid bool[R, W] (0 for an empty row)."""
    column = jnp.arange(1, valid.shape[1] + 1, dtype=jnp.int32)
    return jnp.max(jnp.where(valid, column, 0), axis=1)


def pack_rows(tree: dict) -> dict:
    """Every leaf [R, W, ...] of ``tree`` packed by the plan of its rows' lengths (read from
    ``tree["valid"]``), plus ``"segments"`` int32[R, W]."""
    valid = tree["valid"]
    plan = pack_plan(row_lengths(valid), valid.shape[1])
    packed = {name: pack(plan, x) for name, x in tree.items()}
    packed["segments"] = plan.segments
    return packed


__all__ = ["PackPlan", "pack_plan", "pack", "row_lengths", "pack_rows"]
