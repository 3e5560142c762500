"""cuDNN flash attention through jax.nn.dot_product_attention, for the cases it handles exactly.

cuDNN's causal mask is aligned top-left (query t sees keys <= t), so a causal call must have T == S and the
default q_offset (S - T = 0). No sinks, no lse, D == Dv, half precision, common head dims only.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from moejax.kernels.platform import on_gpu

HEAD_DIMS = (64, 128)  # conservative: what every cuDNN 9 flash kernel on Ampere/Hopper runs


def unsupported_reason(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool, sliding_window: int | None,
                       sinks: jax.Array | None, q_offset: ArrayLike | None, kv_lengths: ArrayLike | None,
                       return_lse: bool) -> str | None:
    """None when `attention` below computes this case exactly, else why not."""
    if not on_gpu():
        return "not on a GPU"
    if q.dtype not in (jnp.float16, jnp.bfloat16) or not q.dtype == k.dtype == v.dtype:
        return f"dtypes {q.dtype}/{k.dtype}/{v.dtype} (needs one of float16, bfloat16)"
    if not q.shape[-1] == k.shape[-1] == v.shape[-1] or q.shape[-1] not in HEAD_DIMS:
        return f"head dims q {q.shape[-1]}, v {v.shape[-1]} (needs D == Dv in {HEAD_DIMS})"
    if sinks is not None:
        return "sinks"
    if return_lse:
        return "return_lse"
    if causal and (q_offset is not None or q.shape[1] != k.shape[1]):
        return "causal with queries not at positions 0..T-1 (cuDNN's causal mask is top-left aligned)"
    return None


def supports(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool, sliding_window: int | None,
             sinks: jax.Array | None, q_offset: ArrayLike | None, kv_lengths: ArrayLike | None, return_lse: bool
             ) -> bool:
    return unsupported_reason(q, k, v, causal, sliding_window, sinks, q_offset, kv_lengths, return_lse) is None


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool, window: int | None,
              kv_lengths: jax.Array | None, scale: float) -> jax.Array:
    """kv_lengths int32 [B] or None. Query t sits at position t (see module doc)."""
    out = jax.nn.dot_product_attention(
        q, k, v, scale=scale, is_causal=causal, key_value_seq_lengths=kv_lengths,
        local_window_size=None if window is None else (window - 1, 0), implementation="cudnn")
    if kv_lengths is None:
        return out
    # A query that sees no key (kv_length 0, or its window starts past kv_length) must give 0.
    t = jnp.arange(q.shape[1], dtype=jnp.int32)[None, :]
    hi = jnp.minimum(kv_lengths[:, None], t + 1) if causal else kv_lengths[:, None]
    lo = jnp.maximum(t - window + 1, 0) if window is not None else 0
    return jnp.where((lo < hi)[:, :, None, None], out, jnp.zeros((), out.dtype))
