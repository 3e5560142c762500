"""Plain-JAX attention that never holds more than CHUNK keys of logits per query: online softmax over KV
chunks in a loop whose bounds skip chunks no query in the batch can see (past every kv_length, after every
causal query, before every window). S <= CHUNK is the materialised reference; decode-sized calls (at most
FEW_QUERIES queries per row) sum over the cache in place.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from moejax.kernels.attention import reference
from moejax.kernels.precision import for_operands

CHUNK = 512  # keys per step: [T, CHUNK] logits per head live at once
FEW_QUERIES = 4  # up to this many queries per row, attention sums over the cache in place (few_queries)
_f32 = jnp.float32


@functools.partial(jax.jit, static_argnames=("causal", "window", "scale", "return_lse"))
def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_offset: jax.Array, kv_lengths: jax.Array,
              sinks: jax.Array | None, *, causal: bool, window: int | None, scale: float, return_lse: bool
              ) -> tuple[jax.Array, jax.Array | None]:
    S = k.shape[1]
    if q.shape[1] <= FEW_QUERIES:
        return few_queries(q, k, v, q_offset, kv_lengths, sinks, causal=causal, window=window, scale=scale,
                           return_lse=return_lse)
    if S <= CHUNK:
        return reference.attention(q, k, v, q_offset, kv_lengths, sinks, causal=causal, window=window,
                                   scale=scale, return_lse=return_lse)
    B, T, Hq, D = q.shape
    Hkv, Dv = k.shape[2], v.shape[-1]
    G = Hq // Hkv
    qg = q.reshape(B, T, Hkv, G, D)
    prec = for_operands(q.dtype)
    q_pos = q_offset[:, None] + jnp.arange(T, dtype=jnp.int32)

    # Chunks [c_lo, c_hi) hold every key any query of the batch can see.
    hi = jnp.minimum(kv_lengths, q_offset + T) if causal else kv_lengths
    c_hi = jnp.clip((jnp.max(hi) + CHUNK - 1) // CHUNK, 0, _cdiv(S, CHUNK))
    c_lo = jnp.zeros((), jnp.int32)
    if window is not None:
        c_lo = jnp.clip(jnp.min(q_offset) - window + 1, 0, None) // CHUNK
    c_lo = jnp.minimum(c_lo, c_hi)

    def step(c: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array, jax.Array]:
        m, l, acc = carry
        # The last chunk overlaps its predecessor instead of padding K/V; keys seen already are masked.
        start = jnp.minimum(c * CHUNK, S - CHUNK)
        kc = lax.dynamic_slice_in_dim(k, start, CHUNK, axis=1)
        vc = lax.dynamic_slice_in_dim(v, start, CHUNK, axis=1)
        idx = start + jnp.arange(CHUNK, dtype=jnp.int32)
        vis = reference.visible(q_pos, idx, kv_lengths, causal, window) & (idx >= c * CHUNK)
        s = jnp.einsum("btkgd,bskd->bkgts", qg, kc, preferred_element_type=_f32, precision=prec) * scale
        s = jnp.where(vis[:, None, None], s, -jnp.inf)
        return online_step(m, l, acc, s, lambda p: jnp.einsum("bkgts,bskd->bkgtd", p.astype(v.dtype), vc,
                                                                preferred_element_type=_f32, precision=prec))

    init = (jnp.full((B, Hkv, G, T), -jnp.inf, _f32), jnp.zeros((B, Hkv, G, T), _f32),
            jnp.zeros((B, Hkv, G, T, Dv), _f32))
    m, l, acc = lax.fori_loop(c_lo, c_hi, step, init)
    out, lse = finish(m, l, acc, None if sinks is None else sinks.reshape(1, Hkv, G, 1))
    out = out.transpose(0, 3, 1, 2, 4).reshape(B, T, Hq, Dv).astype(q.dtype)
    if not return_lse:
        return out, None
    return out, lse.transpose(0, 3, 1, 2).reshape(B, T, Hq)


def few_queries(q: jax.Array, k: jax.Array, v: jax.Array, q_offset: jax.Array, kv_lengths: jax.Array,
                sinks: jax.Array | None, *, causal: bool, window: int | None, scale: float, return_lse: bool
                ) -> tuple[jax.Array, jax.Array | None]:
    """Decode-sized calls: products and sums over the cache as stored ([B, S, Hkv, D]). A dot would want keys
    after heads and transpose the whole cache each call (each layer of each decode step)."""
    B, T, Hq, D = q.shape
    Hkv, Dv = k.shape[2], v.shape[-1]
    G = Hq // Hkv
    qg = q.reshape(B, T, 1, Hkv, G, D).astype(_f32)
    s = jnp.sum(qg * k[:, None, :, :, None, :].astype(_f32), axis=-1) * scale  # [B, T, S, Hkv, G]
    q_pos = q_offset[:, None] + jnp.arange(T, dtype=jnp.int32)
    vis = reference.visible(q_pos, jnp.arange(k.shape[1], dtype=jnp.int32), kv_lengths, causal, window)
    s = jnp.where(vis[..., None, None], s, -jnp.inf)
    m = jnp.max(s, axis=2)  # [B, T, Hkv, G]
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m_safe[:, :, None])
    l = jnp.sum(p, axis=2)
    acc = jnp.sum(p[..., None] * v[:, None, :, :, None, :].astype(_f32), axis=2)  # [B, T, Hkv, G, Dv]
    sink = None if sinks is None else sinks.reshape(1, 1, Hkv, G)
    out, lse = finish(m, l, acc, sink)
    out = out.reshape(B, T, Hq, Dv).astype(q.dtype)
    return (out, lse.reshape(B, T, Hq)) if return_lse else (out, None)


def online_step(m: jax.Array, l: jax.Array, acc: jax.Array, s: jax.Array, values: Callable[[jax.Array], jax.Array]
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One step of the online softmax: running max m, sum l and unnormalised acc [..., Dv], updated with masked
    logits s [..., keys] (-inf: not visible); values(p) -> p @ the step's values [..., Dv]."""
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # nothing seen yet: keep l = acc = 0, no NaN
    corr = jnp.exp(m - m_safe)
    p = jnp.exp(s - m_safe[..., None])
    return m_new, l * corr + jnp.sum(p, axis=-1), acc * corr[..., None] + values(p)


def finish(m: jax.Array, l: jax.Array, acc: jax.Array, sink: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """Online-softmax state (running max m, sum l, unnormalised acc [..., Dv]) -> (out, lse without sinks).
    A sink adds exp(sink) to the denominator only."""
    lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
    if sink is not None:
        m_fin = jnp.maximum(m, sink.astype(_f32))
        scale = jnp.exp(m - m_fin)  # 0 where m = -inf
        l = l * scale + jnp.exp(sink - m_fin)
        acc = acc * scale[..., None]
    return acc / jnp.where(l == 0, 1.0, l)[..., None], lse


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
