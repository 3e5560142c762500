"""The attention op: one function, several backends computing the same thing.

attention(q [B,T,Hq,D], k [B,S,Hkv,D], v [B,S,Hkv,Dv]) -> [B,T,Hq,Dv] in q.dtype (and lse [B,T,Hq] float32).
Query head h reads kv head h // (Hq // Hkv). Query t of row b sits at key position q_offset[b] + t
(default S - T: the queries are the last T keys). Key j is visible iff j < kv_lengths[b] (default S) and,
when causal, j <= q_pos, and with sliding_window=W also j > q_pos - W. sinks [Hq]: one extra logit per head
that takes softmax mass but adds no value. A query that sees no key gets 0 and lse = -inf.

lse = log sum_j exp(s_j) over the visible keys. It never includes sinks, so asking for lse together with
sinks is an error: callers that merge partial results (cascade.py) apply the sinks once, in the merge.
"""
from __future__ import annotations

import functools
import math
from typing import Literal, overload

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from moejax.kernels import invariant
from moejax.kernels.attention import blocked, cudnn, pallas, reference, xla
from moejax.kernels.platform import on_gpu, pallas_unavailable, resolve

BACKENDS = ("reference", "xla", "pallas", "pallas_interpret", "cudnn")


@overload
def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = ..., sliding_window: int | None = ...,
              sinks: jax.Array | None = ..., q_offset: ArrayLike | None = ..., kv_lengths: ArrayLike | None = ...,
              scale: float | None = ..., return_lse: Literal[False] = ..., backend: str = ...) -> jax.Array: ...
@overload
def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = ..., sliding_window: int | None = ...,
              sinks: jax.Array | None = ..., q_offset: ArrayLike | None = ..., kv_lengths: ArrayLike | None = ...,
              scale: float | None = ..., return_lse: Literal[True], backend: str = ...
              ) -> tuple[jax.Array, jax.Array]: ...
@overload
def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = ..., sliding_window: int | None = ...,
              sinks: jax.Array | None = ..., q_offset: ArrayLike | None = ..., kv_lengths: ArrayLike | None = ...,
              scale: float | None = ..., return_lse: bool = ..., backend: str = ...
              ) -> jax.Array | tuple[jax.Array, jax.Array]: ...
def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True, sliding_window: int | None = None,
              sinks: jax.Array | None = None, q_offset: ArrayLike | None = None, kv_lengths: ArrayLike | None = None,
              scale: float | None = None, return_lse: bool = False, backend: str = "auto"
              ) -> jax.Array | tuple[jax.Array, jax.Array]:
    """q [B,T,Hq,D], k [B,S,Hkv,D], v [B,S,Hkv,Dv] -> out [B,T,Hq,Dv] in q.dtype, with return_lse (out, lse [B,T,Hq]
    float32, without sinks)."""
    _check(q, k, v, causal, sliding_window, sinks, return_lse)
    if backend == "cudnn":  # asked for by name; `auto` picks it only where it applies
        why = cudnn.unsupported_reason(q, k, v, causal, sliding_window, sinks, q_offset, kv_lengths, return_lse)
        if why is not None:
            raise ValueError(f"backend 'cudnn' does not handle this call: {why}")
    auto = backend == "auto" and pick_backend(q, k, v, causal, sliding_window, sinks, q_offset, kv_lengths,
                                              return_lse)
    backend = resolve("attention", backend, BACKENDS, auto=auto or None)
    B = q.shape[0]
    if invariant.active():  # fixed query tiles and key blocks, whatever the batch (batch_invariant)
        S = k.shape[1]
        offsets = jnp.full((B,), S - q.shape[1], jnp.int32) if q_offset is None else _per_row(q_offset, B, "q_offset")
        lengths = jnp.full((B,), S, jnp.int32) if kv_lengths is None else _per_row(kv_lengths, B, "kv_lengths")
        out, lse = invariant.attention(
            q, k, v, offsets, lengths, sinks, causal=bool(causal),
            window=None if sliding_window is None else int(sliding_window),
            scale=1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale), return_lse=bool(return_lse))
        if return_lse:
            assert lse is not None  # asked for
            return out, lse
        return out
    out, lse = _run(q, k, v, None if q_offset is None else _per_row(q_offset, B, "q_offset"),
                    None if kv_lengths is None else _per_row(kv_lengths, B, "kv_lengths"), sinks,
                    causal=bool(causal), window=None if sliding_window is None else int(sliding_window),
                    scale=1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale),
                    return_lse=bool(return_lse), backend=backend)
    return (out, lse) if return_lse else out


@functools.partial(jax.jit, static_argnames=("causal", "window", "scale", "return_lse", "backend"))
def _run(q: jax.Array, k: jax.Array, v: jax.Array, q_offset: jax.Array | None, kv_lengths: jax.Array | None,
         sinks: jax.Array | None, *, causal: bool, window: int | None, scale: float, return_lse: bool, backend: str
         ) -> tuple[jax.Array, jax.Array | None]:
    B, T = q.shape[:2]
    S = k.shape[1]
    lengths = None if kv_lengths is None else jnp.clip(kv_lengths, 0, S)
    if backend == "cudnn":
        return cudnn.attention(q, k, v, causal=causal, window=window, kv_lengths=lengths, scale=scale), None
    if backend == "xla" and causal and q_offset is None and kv_lengths is None and S <= BLOCKED_MAX_KEYS:
        # Every bound is static: blocks of queries read only the keys up to their own end (the triangle).
        return blocked.attention(q, k, v, blocked.causal_blocks(T, S, window),
                                 lambda qs, qe, idx: _causal_visible(S - T + qs, qe - qs, idx, window)[None],
                                 scale, sinks, return_lse)
    offsets = jnp.full((B,), S - T, jnp.int32) if q_offset is None else q_offset
    lengths = jnp.full((B,), S, jnp.int32) if lengths is None else lengths
    kw = dict(causal=causal, window=window, scale=scale, return_lse=return_lse)
    if backend == "reference":
        return reference.attention(q, k, v, offsets, lengths, sinks, **kw)
    if backend == "xla":
        return xla.attention(q, k, v, offsets, lengths, sinks, **kw)
    return pallas.attention(q, k, v, offsets, lengths, sinks, interpret=backend == "pallas_interpret", **kw)


BLOCKED_MAX_KEYS = 8192  # beyond, the chunked online softmax keeps [T, CHUNK] logits instead of [BLOCK, S]


def _causal_visible(first: int, n: int, idx: ArrayLike, window: int | None) -> jax.Array:
    """Static mask [n, K]: queries at key positions first..first+n-1 against keys idx."""
    dist = (first + jnp.arange(n, dtype=jnp.int32))[:, None] - jnp.asarray(idx)[None, :]
    return (dist >= 0) & (dist < window) if window is not None else dist >= 0


def pick_backend(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool, sliding_window: int | None,
                 sinks: jax.Array | None, q_offset: ArrayLike | None, kv_lengths: ArrayLike | None,
                 return_lse: bool) -> str:
    """'xla' off GPU; on GPU cuDNN where it computes the case exactly, else the Pallas kernel (XLA where this JAX
    cannot run it)."""
    if not on_gpu():
        return "xla"
    if cudnn.supports(q, k, v, causal, sliding_window, sinks, q_offset, kv_lengths, return_lse):
        return "cudnn"
    return "pallas" if pallas_unavailable() is None else "xla"


def _check(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool, sliding_window: int | None,
           sinks: jax.Array | None, return_lse: bool) -> None:
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if not q.ndim == k.ndim == v.ndim == 4:
        raise ValueError(f"attention wants q [B,T,Hq,D], k [B,S,Hkv,D], v [B,S,Hkv,Dv]; got {shapes}")
    (B, _, Hq, D), (Bk, _, Hkv, Dk) = q.shape, k.shape
    if B != Bk or v.shape[:3] != k.shape[:3] or D != Dk:
        raise ValueError(f"attention shapes disagree (batch, keys, kv heads or q/k head dim): {shapes}")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"query heads Hq={Hq} are not a multiple of kv heads Hkv={Hkv}: {shapes}")
    if sliding_window is not None:
        if not causal:
            raise ValueError("sliding_window needs causal=True (the window ends at the query's position)")
        if int(sliding_window) < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if sinks is not None:
        if tuple(sinks.shape) != (Hq,):
            raise ValueError(f"sinks must have shape ({Hq},) (one per query head), got {tuple(sinks.shape)}")
        if return_lse:
            raise ValueError("return_lse with sinks: lse excludes sinks; merge partial results and apply the "
                             "sinks once (see cascade.py)")


def _per_row(x: ArrayLike, B: int, name: str) -> jax.Array:
    x = jnp.asarray(x, jnp.int32)
    if x.ndim > 1 or (x.ndim == 1 and x.shape[0] != B):
        raise ValueError(f"{name} must be a scalar or have shape ({B},), got {tuple(x.shape)}")
    return jnp.broadcast_to(x, (B,))
