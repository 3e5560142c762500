"""Grouped GEMM in plain JAX for CPU: one loop step per non-empty group, each group's rows as a few row windows.

On CPU a matmul costs a fixed part (streaming the group's weights) plus a part per row, so each group should cost
one weight pass on barely padded rows. A group's rows are a contiguous range: whole tiles, then one window of the
smallest static size that covers the rest. Work is ~ the routed FLOPs, where `ragged_dot` and the dense
all-experts product pay for much more (see `python -m launch.bench kernels`).
"""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from moejax.buckets import bucket
from moejax.kernels.grouped_matmul.groups import zero_rows_of_no_group
from moejax.kernels.precision import f32_dot

_f32 = jnp.float32


def window_sizes(rows: int, groups: int, quantum: int = 8) -> list[int]:
    """Static window sizes, largest last: multiples of `quantum` up to 8 quanta, then 8 steps per doubling (at
    most ~12% padding per window) up to the tile, ~2x the mean rows per group (at most 256)."""
    tile = min(max(bucket(2 * rows // max(groups, 1)), quantum), 256, bucket(max(rows, 1), quantum))
    sizes, m = [], quantum
    while m < tile:
        sizes.append(m)
        m += max(quantum, (1 << (m.bit_length() - 1)) // 8)
    return sizes + [tile]


def for_each_group(xs: jax.Array, group_sizes: jax.Array, out_dim: int,
                   body: Callable[[jax.Array, jax.Array], jax.Array]) -> jax.Array:
    """xs [M, K] rows grouped in order; body(g, rows [m, K]) -> float32 [m, out_dim] for group g's weights.
    Returns float32 [M, out_dim]; rows past sum(group_sizes) are 0.

    A window may run past its group into the next groups' rows (or the zero padding at the end); groups run in
    ascending order, so those rows are rewritten by their own group later, and rows past the sum are masked."""
    M = xs.shape[0]
    G = group_sizes.shape[0]
    sizes = window_sizes(M, G)
    tile = sizes[-1]
    group_sizes = group_sizes.astype(jnp.int32)
    starts = jnp.cumsum(group_sizes) - group_sizes
    xs = jnp.concatenate([xs, jnp.zeros((tile, xs.shape[1]), xs.dtype)])
    active = jnp.nonzero(group_sizes > 0, size=G, fill_value=0)[0]  # ascending group ids
    size_of = jnp.asarray(sizes, jnp.int32)

    def group(i: jax.Array, ys: jax.Array) -> jax.Array:
        g = active[i]
        c, s0 = group_sizes[g], starts[g]

        def window(size: int, off: jax.Array) -> jax.Array:
            return body(g, jax.lax.dynamic_slice_in_dim(xs, off, size))

        full = c // tile
        ys = jax.lax.fori_loop(0, full, lambda t, ys: jax.lax.dynamic_update_slice_in_dim(
            ys, window(tile, s0 + t * tile), s0 + t * tile, 0), ys)
        off, rest = s0 + full * tile, c - full * tile
        # Every branch returns a full tile so that the update of `ys` stays outside the switch (in place);
        # branch 0 (nothing left) writes zeros past this group, rewritten later as above.
        branches = [lambda: jnp.zeros((tile, out_dim), _f32)] + [
            (lambda s=s: jnp.pad(window(s, off), ((0, tile - s), (0, 0)))) for s in sizes]
        which = jnp.where(rest == 0, 0, 1 + jnp.sum(size_of < rest))
        return jax.lax.dynamic_update_slice_in_dim(ys, jax.lax.switch(which, branches), off, 0)

    ys = jax.lax.fori_loop(0, jnp.sum(group_sizes > 0), group, jnp.zeros((M + tile, out_dim), _f32))[:M]
    return zero_rows_of_no_group(ys, group_sizes)


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """x [M, K], w [G, K, N] -> float32 [M, N]."""
    return for_each_group(x, group_sizes, w.shape[2],
                          lambda g, rows: f32_dot(rows, w[g]))
