"""Materialised attention in plain JAX: the whole [T, S] logit matrix per head. The oracle the others match.

All backends take normalised arguments (see `attention/__init__.py`): q_offset, kv_lengths int32 [B],
scale a float, and return (out [B,T,Hq,Dv] in q.dtype, lse [B,T,Hq] float32 or None). Sinks, when given,
are applied to `out`; `lse` never includes them.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from moejax.kernels.precision import for_operands

_f32 = jnp.float32


def visible(q_pos: jax.Array, key_idx: jax.Array, kv_lengths: jax.Array, causal: bool, window: int | None
            ) -> jax.Array:
    """q_pos [B,T], key_idx [C] -> bool [B,T,C]: key j is visible to the query at q_pos."""
    j = key_idx[None, None, :]
    vis = j < kv_lengths[:, None, None]
    if causal:
        vis &= j <= q_pos[:, :, None]
    if window is not None:
        vis &= j > q_pos[:, :, None] - window
    return vis


@functools.partial(jax.jit, static_argnames=("causal", "window", "scale", "return_lse"))
def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_offset: jax.Array, kv_lengths: jax.Array,
              sinks: jax.Array | None, *, causal: bool, window: int | None, scale: float, return_lse: bool
              ) -> tuple[jax.Array, jax.Array | None]:
    B, T, Hq, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    q_pos = q_offset[:, None] + jnp.arange(T, dtype=jnp.int32)
    vis = visible(q_pos, jnp.arange(S, dtype=jnp.int32), kv_lengths, causal, window)
    s = jnp.einsum("btkgd,bskd->bkgts", q.reshape(B, T, Hkv, G, D), k, preferred_element_type=_f32,
                   precision=for_operands(q.dtype)) * scale
    s = jnp.where(vis[:, None, None], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    if sinks is not None:
        sink = sinks.astype(_f32).reshape(1, Hkv, G, 1, 1)
        m = jnp.maximum(m, sink)
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # a query that sees nothing: exp(-inf) = 0, never NaN
    p = jnp.exp(s - m)
    l = jnp.sum(p, axis=-1, keepdims=True)
    denom = l + jnp.exp(sink - m) if sinks is not None else l
    p = p / jnp.where(denom == 0, 1.0, denom)
    out = jnp.einsum("bkgts,bskd->btkgd", p, v.astype(_f32), preferred_element_type=_f32,
                     precision=jax.lax.Precision.HIGHEST)
    out = out.reshape(B, T, Hq, v.shape[-1]).astype(q.dtype)
    if not return_lse:
        return out, None
    lse = (m + jnp.log(l))[..., 0]  # [B,Hkv,G,T]; log 0 = -inf for a query that sees nothing
    return out, lse.transpose(0, 3, 1, 2).reshape(B, T, Hq)
