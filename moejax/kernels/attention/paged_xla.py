"""Paged attention in plain JAX that reads only the blocks each row's queries can see: an online softmax over
steps of `columns` table columns (blocks_per_step), from the first column any row's window reaches to the last
column any row's queries reach. Within a step, a row whose own blocks end earlier (or whose window starts later)
reads its last (first) visible block again instead of the table's padding, so the bytes read per row follow its
length, not the table's width; the positions past its end are masked by causality.

Arguments as `paged.paged_attention`'s (normalised: q_offset int32 [B], scale a float, window None or an int).
"""
from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from moejax.kernels.attention.xla import finish, online_step
from moejax.kernels.precision import for_operands

KEYS_PER_STEP = 128  # keys of a row per loop step (8 blocks of 16): short rows take one step
_f32 = jnp.float32


def blocks_per_step(block_size: int) -> int:
    """Table columns one loop step reads: KEYS_PER_STEP keys' worth of blocks (at least one)."""
    return max(1, KEYS_PER_STEP // block_size)


def visible_columns(q_offset: jax.Array, T: int, P: int, NB: int, window: int | None) -> tuple[jax.Array, jax.Array]:
    """Each row's visible table columns [first, last] for T queries from q_offset [B] over blocks of P tokens: its
    last query's block; its first query's window start."""
    last = jnp.clip((q_offset + T - 1) // P, 0, NB - 1)
    first = jnp.zeros_like(last) if window is None else jnp.clip((q_offset - window + 1) // P, 0, None)
    return jnp.minimum(first, last), last


def attention(q: jax.Array, k_parts: Sequence[jax.Array], v_pool: jax.Array, block_table: jax.Array,
              q_offset: jax.Array, sinks: jax.Array | None, *, window: int | None, scale: float,
              columns: int | None = None) -> jax.Array:
    """columns: table columns per loop step (default blocks_per_step of the pool's block size)."""
    B, T, Hq, D = q.shape
    P, Hkv, Dv = v_pool.shape[1], v_pool.shape[2], v_pool.shape[3]
    NB = block_table.shape[1]
    G = Hq // Hkv
    C = min(NB, columns or blocks_per_step(P))
    prec = for_operands(q.dtype)
    widths = [p.shape[-1] for p in k_parts]
    q_split = jnp.split(q.reshape(B, T, Hkv, G, D), [sum(widths[:i + 1]) for i in range(len(widths) - 1)], axis=-1)
    q_pos = q_offset[:, None] + jnp.arange(T, dtype=jnp.int32)  # [B, T]

    first, last = visible_columns(q_offset, T, P, NB, window)

    def step(c: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array, jax.Array]:
        m, l, acc = carry
        cols = c * C + jnp.arange(C, dtype=jnp.int32)  # [C]
        blocks = jnp.take_along_axis(block_table, jnp.clip(cols[None, :], first[:, None], last[:, None]), axis=1)
        key_pos = (cols[:, None] * P + jnp.arange(P, dtype=jnp.int32)[None, :]).reshape(C * P)
        vis = key_pos[None, None, :] <= q_pos[:, :, None]  # [B, T, C*P]
        if window is not None:
            vis &= key_pos[None, None, :] > q_pos[:, :, None] - window
        s = sum(jnp.einsum("btkgd,bskd->btkgs", qi, part[blocks].reshape(B, C * P, Hkv, -1),
                           preferred_element_type=_f32, precision=prec)
                for qi, part in zip(q_split, k_parts, strict=True))
        s = jnp.where(vis[:, :, None, None, :], s * scale, -jnp.inf)
        vc = v_pool[blocks].reshape(B, C * P, Hkv, Dv)
        return online_step(m, l, acc, s, lambda p: jnp.einsum("btkgs,bskd->btkgd", p.astype(v_pool.dtype), vc,
                                                                preferred_element_type=_f32, precision=prec))

    init = (jnp.full((B, T, Hkv, G), -jnp.inf, _f32), jnp.zeros((B, T, Hkv, G), _f32),
            jnp.zeros((B, T, Hkv, G, Dv), _f32))
    if C == NB:  # one step covers the table: no loop
        m, l, acc = step(jnp.int32(0), init)
    else:
        m, l, acc = lax.fori_loop(jnp.min(first) // C, jnp.max(last) // C + 1, step, init)
    out, _ = finish(m, l, acc, None if sinks is None else sinks.reshape(1, 1, Hkv, G))
    return out.reshape(B, T, Hq, Dv).astype(q.dtype)
