"""Block-sparse attention in plain JAX: queries in static blocks, each reading only static key ranges.

Which keys a block may see is known before tracing: for causal attention over a call's own tokens, keys up to
the block's end (the triangle); for packed token trees (moejax.models.attention.TreeMask), the prior keys, a
shared head of the row and a window before the block's end, sized on the host from the rows' DFS spans
(moejax.sched.packing.tree_span). Keys outside those ranges are never loaded, so work follows each token's own
context instead of the row length; inside them a mask decides exactly. Query heads of one kv head are packed as
rows of one matmul (GQA), which XLA:CPU runs ~4x faster than the head-split einsum of `reference`.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from moejax.kernels.precision import for_operands

BLOCK = 128  # queries per block: [G * BLOCK, keys] logits per kv head live at once
_f32 = jnp.float32

Ranges = tuple[tuple[int, int], ...]


def attention(q: jax.Array, k: jax.Array, v: jax.Array, blocks: Sequence[tuple[int, int, Ranges]], visible: Callable,
              scale: float, sinks: jax.Array | None = None, return_lse: bool = False
              ) -> tuple[jax.Array, jax.Array | None]:
    """q [B,T,Hq,D], k [B,S,Hkv,D], v [B,S,Hkv,Dv]; blocks: (q_start, q_end, key ranges) covering [0, T);
    visible(q_start, q_end, key_idx int array [K]) -> bool [B, q_end - q_start, K].
    -> (out [B,T,Hq,Dv] in q.dtype, lse [B,T,Hq] float32 without sinks, or None)."""
    B, T, Hq, D = q.shape
    Hkv, Dv = k.shape[2], v.shape[-1]
    G = Hq // Hkv
    prec = for_operands(q.dtype)
    # Query rows group-major (g, t): a head split over devices stays a split of the leading part of the merged
    # axis, which the partitioner keeps (t-major merges would gather the heads), and masks broadcast over g.
    q_h = q.reshape(B, T, Hkv, G, D).transpose(0, 2, 3, 1, 4)  # [B, Hkv, G, T, D]
    k_h, v_h = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, Hkv, S, D]
    sink = None if sinks is None else sinks.astype(_f32).reshape(1, Hkv, G, 1)
    outs, lses = [], []
    for qs, qe, ranges in blocks:
        n = qe - qs
        idx = np.concatenate([np.arange(lo, hi, dtype=np.int32) for lo, hi in ranges])
        kb = _take(k_h, ranges)
        vb = _take(v_h, ranges)
        s = jnp.einsum("bhtd,bhsd->bhts", q_h[:, :, :, qs:qe].reshape(B, Hkv, G * n, D), kb,
                       preferred_element_type=_f32, precision=prec).reshape(B, Hkv, G, n, idx.size) * scale
        s = jnp.where(visible(qs, qe, idx)[:, None, None], s, -jnp.inf)
        m = jnp.max(s, axis=-1)  # [B, Hkv, G, n]
        top = m if sink is None else jnp.maximum(m, sink)
        top = jnp.where(jnp.isfinite(top), top, 0.0)  # a query that sees nothing: exp(-inf) = 0, never NaN
        p = jnp.exp(s - top[..., None])
        l = jnp.sum(p, axis=-1)
        denom = l if sink is None else l + jnp.exp(sink - top)
        # Weights stay float32 against the values (as in `reference`): rounding them to bfloat16 lets the fused
        # and layer-by-layer steps of a bf16 model drift apart by ~6% instead of ~1%.
        o = jnp.einsum("bhts,bhsd->bhtd", p.reshape(B, Hkv, G * n, idx.size), vb.astype(_f32),
                       preferred_element_type=_f32, precision=prec).reshape(B, Hkv, G, n, Dv)
        outs.append(o / jnp.where(denom == 0, 1.0, denom)[..., None])
        if return_lse:
            lses.append(jnp.where(l > 0, top + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf))
    out = jnp.concatenate(outs, axis=3).transpose(0, 3, 1, 2, 4).reshape(B, T, Hq, Dv).astype(q.dtype)
    if not return_lse:
        return out, None
    return out, jnp.concatenate(lses, axis=3).transpose(0, 3, 1, 2).reshape(B, T, Hq)


def _take(x: jax.Array, ranges: Ranges) -> jax.Array:
    parts = [x[:, :, lo:hi] for lo, hi in ranges]
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=2)


def causal_blocks(T: int, S: int, window: int | None = None, block: int = BLOCK) -> list[tuple[int, int, Ranges]]:
    """Queries are the last T of S keys: block [qs, qe) reads keys [lo, S - T + qe), lo the first key its
    first query's window reaches."""
    out: list[tuple[int, int, Ranges]] = []
    for qs in range(0, T, block):
        qe = min(qs + block, T)
        lo = 0 if window is None else max(0, S - T + qs - window + 1)
        out.append((qs, qe, ((lo, S - T + qe),)))
    return out


def tree_blocks(T: int, prior: int, head: int, window: int | None, block: int = BLOCK) -> list[tuple[int, int, Ranges]]:
    """Packed tree rows: P prior keys, then the row's own T tokens. Block [qs, qe) reads every prior key, the
    row's head [0, head) and the window [qe - window, qe) (all of [0, qe) when window is None); the host
    chose head and window so that they hold every key a query of the block can see (packing.tree_span)."""
    out = []
    for qs in range(0, T, block):
        qe = min(qs + block, T)
        start = 0 if window is None else max(0, qe - window)
        ranges = [(0, prior)] if prior else []
        if start <= head:
            ranges.append((prior, prior + qe))
        else:
            ranges += [(prior, prior + head)] if head else []
            ranges.append((prior + start, prior + qe))
        out.append((qs, qe, _merge(ranges)))
    return out


def _merge(ranges: list[tuple[int, int]]) -> Ranges:
    merged: list[tuple[int, int]] = []
    for lo, hi in ranges:
        if merged and merged[-1][1] == lo:
            merged[-1] = (merged[-1][0], hi)
        elif hi > lo:
            merged.append((lo, hi))
    return tuple(merged)
