"""Cascade attention: N siblings that share one prefix, each with its own T suffix tokens.

The prefix part is ONE attention call for all N*T queries, so the prefix K/V is read once, not N times:
the siblings become extra query heads of the kv head they read, heads ordered (kv head, sibling, group)
so that head // (N*G) is still the kv head. With a sliding window that call is causal with q_offset = P,
so query t sits at its true position P + t and the window is exact; since every prefix key precedes every
query the causal test is always true and the window only bounds which prefix blocks are read (no extra
work over the windowless call). The suffix part is causal per sibling. Both return lse; the merge is an
exact log-sum-exp combination, and sinks enter the denominator once, there.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from moejax.kernels.attention.op import attention

_f32 = jnp.float32


@functools.partial(jax.jit, static_argnames=("sliding_window", "scale", "backend"))
def cascade_attention(q: jax.Array, k_prefix: jax.Array, v_prefix: jax.Array, k_suffix: jax.Array, v_suffix: jax.Array,
                      *, suffix_lengths: ArrayLike | None = None, sinks: jax.Array | None = None,
                      sliding_window: int | None = None, scale: float | None = None, backend: str = "auto"
                      ) -> jax.Array:
    """q [N,T,Hq,D]; k_prefix [P,Hkv,D], v_prefix [P,Hkv,Dv] (positions 0..P-1); k_suffix [N,T,Hkv,D],
    v_suffix [N,T,Hkv,Dv] (suffix token t at position P + t); suffix_lengths [N] valid suffix tokens (None = T).
    -> [N,T,Hq,Dv] in q.dtype, equal to causal attention of each sibling over prefix + its valid suffix.
    Queries at t >= suffix_lengths[n] are padding: they get finite values (attention over the prefix and
    the valid suffix) that callers should ignore."""
    N, T, Hq, D = q.shape
    P, Hkv = k_prefix.shape[0], k_prefix.shape[1]
    if k_prefix.ndim != 3 or v_prefix.shape[:2] != k_prefix.shape[:2] or k_suffix.shape[:3] != (N, T, Hkv):
        raise ValueError(f"cascade shapes disagree: q {q.shape}, k_prefix {k_prefix.shape}, v_prefix "
                         f"{v_prefix.shape}, k_suffix {k_suffix.shape}, v_suffix {v_suffix.shape}")
    if Hq % Hkv != 0:
        raise ValueError(f"query heads Hq={Hq} are not a multiple of kv heads Hkv={Hkv}")
    G = Hq // Hkv
    kw: dict[str, Any] = dict(sliding_window=sliding_window, scale=scale, return_lse=True, backend=backend)

    out_s, lse_s = attention(q, k_suffix, v_suffix, causal=True, q_offset=jnp.zeros((N,), jnp.int32),
                             kv_lengths=suffix_lengths, **kw)
    parts = [(out_s.astype(_f32), lse_s)]
    if P > 0:
        # [N,T,Hkv,G,D] -> [1, T, Hkv*N*G, D]: one row of T query steps, heads (kv head, sibling, group)
        qp = q.reshape(N, T, Hkv, G, D).transpose(1, 2, 0, 3, 4).reshape(1, T, Hkv * N * G, D)
        out_p, lse_p = attention(qp, k_prefix[None], v_prefix[None], causal=sliding_window is not None,
                                 q_offset=jnp.full((1,), P, jnp.int32), **kw)
        out_p = out_p.reshape(T, Hkv, N, G, -1).transpose(2, 0, 1, 3, 4).reshape(N, T, Hq, -1)
        lse_p = lse_p.reshape(T, Hkv, N, G).transpose(2, 0, 1, 3).reshape(N, T, Hq)
        parts.append((out_p.astype(_f32), lse_p))
    return merge(parts, sinks).astype(q.dtype)


def merge(parts: Sequence[tuple[jax.Array, jax.Array]], sinks: jax.Array | None = None) -> jax.Array:
    """Exact softmax over the union of disjoint key sets, from each set's (out [...,H,Dv], lse [...,H]);
    sinks [H] add exp(sink) to the denominator. A query that sees nothing anywhere gets 0."""
    lses = [lse for _, lse in parts]
    if sinks is not None:
        lses.append(jnp.broadcast_to(sinks.astype(_f32), lses[0].shape))
    m = lses[0]
    for x in lses[1:]:
        m = jnp.maximum(m, x)
    m = jnp.where(m == -jnp.inf, 0.0, m)
    weights = [jnp.exp(x - m) for x in lses]  # exp(-inf) = 0 for an empty part
    denom = sum(weights)
    # strict=False: the sinks' weight, last, has no output; it only adds to the denominator
    num = sum(w[..., None] * out for w, (out, _) in zip(weights, parts, strict=False))
    return num / jnp.where(denom == 0, 1.0, denom)[..., None]
