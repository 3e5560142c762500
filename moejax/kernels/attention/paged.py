"""Attention over a paged KV cache: keys and values live in a pool of fixed-size blocks shared by every sequence,
and each sequence's block table lists its blocks in order (position p is at offset p % P of block
table[b, p // P], P = the pool's block size).

paged_attention(q [B,T,Hq,D], k_parts, v_pool [N,P,Hkv,Dv], block_table int [B,NB], q_offset int [B])
  -> [B,T,Hq,Dv] in q.dtype.
k_parts: a tuple of key pools [N,P,Hkv,D_i] whose last axes, side by side, make D: MLA's absorbed keys
(latent || roped shared key) are read from the two arrays its cache holds, never concatenated into a copy of
the pool. Query t of row b sits at position q_offset[b] + t and sees the keys at positions <= its own (and
> position - sliding_window); sinks [Hq] as in `attention`. Table entries past a row's last block must still
name a block of the pool (any): their keys lie after every query and are never visible.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from moejax.kernels import invariant
from moejax.kernels.attention import attention, paged_cpu, paged_pallas, paged_xla
from moejax.kernels.platform import resolve

BACKENDS = ("reference", "xla", "cpu", "pallas", "pallas_interpret")


def paged_attention(q: jax.Array, k_parts: Sequence[jax.Array], v_pool: jax.Array, block_table: jax.Array,
                    q_offset: ArrayLike, *, sliding_window: int | None = None, sinks: jax.Array | None = None,
                    scale: float | None = None, backend: str = "auto") -> jax.Array:
    k_parts = tuple(k_parts)
    _check(q, k_parts, v_pool, block_table, q_offset)
    backend = resolve("paged attention", backend, BACKENDS)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    window = None if sliding_window is None else int(sliding_window)
    q_offset = jnp.broadcast_to(jnp.asarray(q_offset, jnp.int32), (q.shape[0],))
    if invariant.active():  # fixed query tiles and key blocks, whatever the batch (batch_invariant)
        return invariant.paged_attention(q, k_parts, v_pool, block_table.astype(jnp.int32), q_offset, sinks,
                                         window=window, scale=scale)
    if backend == "xla":
        return paged_xla.attention(q, k_parts, v_pool, block_table.astype(jnp.int32), q_offset, sinks, window=window,
                                   scale=scale)
    if backend == "cpu":
        return paged_cpu.attention(q, k_parts, v_pool, block_table.astype(jnp.int32), q_offset, sinks, window=window,
                                   scale=scale)
    if backend == "reference":
        k = jnp.concatenate([gather_blocks(p, block_table) for p in k_parts], axis=-1)
        v = gather_blocks(v_pool, block_table)
        return attention(q, k, v, sliding_window=window, sinks=sinks, q_offset=q_offset, scale=scale,
                         backend=backend)
    return paged_pallas.attention(q, k_parts, v_pool, block_table.astype(jnp.int32), q_offset, sinks, window=window,
                                  scale=scale, interpret=backend == "pallas_interpret")


def gather_blocks(pool: jax.Array, block_table: jax.Array) -> jax.Array:
    """pool [N, P, ...], block_table [B, NB] -> each row's blocks in order, [B, NB*P, ...]."""
    B, NB = block_table.shape
    return pool[block_table.reshape(-1)].reshape(B, NB * pool.shape[1], *pool.shape[2:])


def _check(q: jax.Array, k_parts: Sequence[jax.Array], v_pool: jax.Array, block_table: jax.Array, q_offset: ArrayLike
           ) -> None:
    shapes = (f"q {tuple(q.shape)}, k parts {[tuple(p.shape) for p in k_parts]}, v {tuple(v_pool.shape)}, "
              f"block table {tuple(block_table.shape)}")
    if q.ndim != 4 or not k_parts or any(p.ndim != 4 for p in k_parts) or v_pool.ndim != 4 or block_table.ndim != 2:
        raise ValueError("paged attention wants q [B,T,Hq,D], key pools [N,P,Hkv,D_i], v [N,P,Hkv,Dv] and a block "
                         f"table [B,NB]; got {shapes}")
    if any(p.shape[:3] != v_pool.shape[:3] for p in k_parts):
        raise ValueError(f"paged attention: key and value pools disagree on blocks, block size or kv heads: {shapes}")
    if sum(p.shape[-1] for p in k_parts) != q.shape[-1]:
        raise ValueError(f"paged attention: the key parts' widths do not add up to q's head dim: {shapes}")
    Hq, Hkv = q.shape[2], v_pool.shape[2]
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"paged attention: query heads {Hq} are not a multiple of kv heads {Hkv}: {shapes}")
    if block_table.shape[0] != q.shape[0]:
        raise ValueError(f"paged attention: block table rows != q rows: {shapes}")
    if jnp.ndim(q_offset) > 1:
        raise ValueError(f"q_offset must be a scalar or [B]; got shape {jnp.shape(q_offset)}")
