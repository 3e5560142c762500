"""Expert FFN over rows sorted by expert: the CPU paths (expert slots for small batches, else per-group row
windows), the Pallas Triton kernels and the Mosaic GPU kernels."""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from moejax.buckets import fine_bucket
from moejax.kernels.activation import glu_of
from moejax.kernels.expert_ffn import parts
from moejax.kernels.grouped_matmul.xla import for_each_group
from moejax.kernels.precision import f32_dot, f32_einsum
from moejax.kernels.routing import Routing, combine, dispatch, gather_rows

_f32 = jnp.float32


def ffn_rows(xs: jax.Array, wgu: jax.Array, wd: jax.Array, bgu: jax.Array | None, bd: jax.Array | None, act: str,
             limit: float, alpha: float) -> jax.Array:
    """One expert's FFN on rows xs [m, D] -> float32 [m, D]."""
    h = f32_dot(xs, wgu)
    if bgu is not None:
        h = h + bgu.astype(_f32)
    y = f32_dot(glu_of(h, act, limit, alpha).astype(xs.dtype), wd)
    return y if bd is None else y + bd.astype(_f32)


CAPACITY_MAX_MEAN_ROWS = 32  # measured (N=8..4096 tokens, 32 experts top-4): slots win up to here, the loop after


def xla(x: jax.Array, idx: jax.Array, weights: jax.Array, wgu: jax.Array, wd: jax.Array, bgu: jax.Array | None,
        bd: jax.Array | None, act: str, limit: float, alpha: float) -> jax.Array:
    N, k = idx.shape
    E = wgu.shape[0]
    routing = dispatch(idx, E)
    if N * k <= CAPACITY_MAX_MEAN_ROWS * E:  # decode and small batches: static shapes decide
        return capacity(x, routing, weights, wgu, wd, bgu, bd, act, limit, alpha)
    return _loop(x, routing, weights, wgu, wd, bgu, bd, act, limit, alpha)


def _loop(x: jax.Array, routing: Routing, weights: jax.Array, wgu: jax.Array, wd: jax.Array, bgu: jax.Array | None,
          bd: jax.Array | None, act: str, limit: float, alpha: float) -> jax.Array:
    pick = lambda b, g: None if b is None else b[g]  # noqa: E731
    ys = for_each_group(gather_rows(x, routing, weights.shape[1]), routing.group_sizes, x.shape[1],
                        lambda g, rows: ffn_rows(rows, wgu[g], wd[g], pick(bgu, g), pick(bd, g), act, limit, alpha))
    return combine(ys, routing, weights)


def slot_sizes(N: int, k: int, E: int) -> list[int]:
    """Static slot counts per expert: about 2x, 3x and 4x the mean rows per expert (fine buckets, at least 8) and
    N, the cost of the dense product (enough unless a token names an expert twice, as the cached placement's
    stand-ins do). Decode at 32 rows (mean 4) mostly takes 12 where pow2 tiers took 16: 5% of a step."""
    mean = -(-N * k // E)
    return sorted({min(N, max(8, fine_bucket(f * mean))) for f in (2, 3, 4)} | {N})


def capacity(x: jax.Array, routing: Routing, weights: jax.Array, wgu: jax.Array, wd: jax.Array, bgu: jax.Array | None,
             bd: jax.Array | None, act: str, limit: float, alpha: float) -> jax.Array:
    """Each expert's rows in C static slots: one batched matmul over the weights as stored, where the loop pays a
    step per expert. C is the smallest of `slot_sizes` that holds the busiest expert of this batch; the loop takes
    what none holds."""
    (N, k), E = weights.shape, wgu.shape[0]
    tiers = slot_sizes(N, k, E)
    start = jnp.cumsum(routing.group_sizes) - routing.group_sizes
    slot = jnp.arange(N * k, dtype=jnp.int32) - start[routing.expert_of_row]
    rows = gather_rows(x, routing, k)

    def slots(C: int) -> jax.Array:
        buf = jnp.zeros((E, C, x.shape[1]), x.dtype).at[routing.expert_of_row, slot].set(rows, mode="drop")
        h = f32_einsum("ecd,edf->ecf", buf, wgu)
        if bgu is not None:
            h = h + bgu.astype(_f32)[:, None]
        y = f32_einsum("ecf,efd->ecd", glu_of(h, act, limit, alpha).astype(x.dtype), wd)
        if bd is not None:
            y = y + bd.astype(_f32)[:, None]
        return combine(y[routing.expert_of_row, slot], routing, weights)

    busiest = jnp.max(routing.group_sizes)
    which = sum((busiest > C).astype(jnp.int32) for C in tiers)
    loop = functools.partial(_loop, x, routing, weights, wgu, wd, bgu, bd, act, limit, alpha)
    return jax.lax.switch(which, [functools.partial(slots, C) for C in tiers] + [loop])


def _pallas(x: jax.Array, idx: jax.Array, weights: jax.Array, wgu: jax.Array, wd: jax.Array, bgu: jax.Array | None,
            bd: jax.Array | None, act: str, limit: float, alpha: float, *, interpret: bool) -> jax.Array:
    """Route, the fused gate/up kernel, the down kernel, combine (parts.pallas_parts)."""
    state = parts.start(x, idx, weights, wgu, wd, bgu, bd)
    return parts.run(parts.pallas_parts(state, act, limit, alpha, interpret), state)


def mosaic(x: jax.Array, idx: jax.Array, weights: jax.Array, wgu: jax.Array, wd: jax.Array, bgu: jax.Array | None,
           bd: jax.Array | None, act: str, limit: float, alpha: float) -> jax.Array:
    """Route into the group-aligned layout, the Mosaic GPU gate/up product, the activation in XLA, the down
    product, combine (parts.mosaic_parts)."""
    state = parts.start(x, idx, weights, wgu, wd, bgu, bd)
    return parts.run(parts.mosaic_parts(state, act, limit, alpha), state)


def pallas(*args: Any) -> jax.Array:
    return _pallas(*args, interpret=False)


def pallas_interpret(*args: Any) -> jax.Array:
    return _pallas(*args, interpret=True)
