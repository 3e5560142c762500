"""Paged attention for few queries per row (decode) on XLA:CPU: an online softmax over steps of `columns` table
columns, each step gathering its blocks into [B, Hkv, keys, D] and taking both products as batched dots that XLA:CPU
hands to its YNNPACK fusions (the logits with the keys as the left operand, M = keys; the values with the
probabilities on the left).

Why this form (JAX 0.10.2, XLA:CPU on 2 Sapphire Rapids cores, B=16, hd=128, Hkv=8, G=4; medians of 7):
- A temporary of 32 MiB or more is a fresh mmap per call (glibc's threshold): writing it page-faults, ~2 GB/s
  against ~15 GB/s below it. Gathering the whole cache at once (the reference backend) or any [B, S, ...] product
  pays that, so a step gathers ~STEP_BYTES of KV (at context 2048, steps of 2.4 to 9.4 MiB ran within 10% of each
  other for GQA and MLA, float32 and bfloat16; 1 MiB and 16-32 MiB steps ran slower).
- Over a contiguous [16, 1024, 8, 128] float32 cache, the logits as a dot with the keys on the left took 6.5 ms;
  elementwise multiply + sum over D 34 ms, a dot with (B, Hkv) batch dims over [B, S, Hkv, D] (as the xla
  backend's einsums) 45 ms, a dot with the query on the left 32 ms.
- XLA:CPU gathers 16-bit floats through float32 (convert in, round out), a tenth of the speed of the same gather
  as uint16: they are gathered as uint16. The bitcast sits behind an optimization barrier on the loop step, or
  XLA hoists it out of the loop as a copy of the whole pool.
- A bf16 dot whose left operand has a transposed layout is upcast to float32 (the values gathered at float32):
  the probabilities pass a barrier flattened, so their layout is the plain one.
- The softmax runs over the logits transposed (keys minor): with the 4 queries of a kv head minor, its exp took
  several times longer.

Arguments as `paged.paged_attention`'s (normalised: q_offset int32 [B], scale a float, window None or an int).
"""
from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from moejax.kernels.attention.paged_xla import visible_columns
from moejax.kernels.attention.xla import finish
from moejax.kernels.precision import for_operands

STEP_BYTES = 4 << 20  # KV bytes gathered per loop step (all rows): well under 32 MiB, big enough for the dots
_f32 = jnp.float32


def columns_per_step(rows: int, block_size: int, key_bytes: int, table_columns: int) -> int:
    """Table columns one step reads: STEP_BYTES of KV over `rows` rows (key_bytes: the bytes of one key, all its
    pools), at least one and at most the table."""
    return max(1, min(table_columns, STEP_BYTES // max(1, rows * block_size * key_bytes)))


def attention(q: jax.Array, k_parts: Sequence[jax.Array], v_pool: jax.Array, block_table: jax.Array,
              q_offset: jax.Array, sinks: jax.Array | None, *, window: int | None, scale: float,
              columns: int | None = None) -> jax.Array:
    """columns: table columns per loop step (default columns_per_step)."""
    B, T, Hq, D = q.shape
    P, Hkv, Dv = v_pool.shape[1], v_pool.shape[2], v_pool.shape[3]
    NB = block_table.shape[1]
    G, X = Hq // Hkv, T * Hq // Hkv  # X: a kv head's queries, (t, g) in order
    v_is_key = v_pool is k_parts[0]  # MLA: the latent is the value and the first key part; gather it once
    pools = tuple(k_parts) if v_is_key else (*k_parts, v_pool)
    key_bytes = sum(p.shape[2] * p.shape[3] * p.dtype.itemsize for p in pools)
    C = min(NB, columns or columns_per_step(B, P, key_bytes, NB))
    prec = for_operands(q.dtype)
    widths = [p.shape[-1] for p in k_parts]
    q_x = q.reshape(B, T, Hkv, G, D).transpose(0, 2, 1, 3, 4).reshape(B, Hkv, X, D)
    q_parts = jnp.split(q_x, [sum(widths[:i + 1]) for i in range(len(widths) - 1)], axis=-1)
    q_pos = q_offset[:, None] + jnp.arange(T, dtype=jnp.int32)  # [B, T]

    # A step's columns outside a row's visible ones read the nearest visible block again (masked), never the
    # table's padding.
    first, last = visible_columns(q_offset, T, P, NB, window)

    def step(c: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array, jax.Array]:
        m, l, acc = carry
        cols = c * C + jnp.arange(C, dtype=jnp.int32)
        blocks = jnp.take_along_axis(block_table, jnp.clip(cols[None, :], first[:, None], last[:, None]), axis=1)
        keys = [gather_heads(p, blocks, c) for p in k_parts]  # [B, Hkv, C*P, D_i]
        # Logits with the keys on the left (M = keys); the softmax then runs on them transposed, keys minor
        s, *rest = [jnp.einsum("bhsd,bhxd->bhsx", k, qi, preferred_element_type=_f32, precision=prec)
                    for k, qi in zip(keys, q_parts, strict=True)]
        s = sum(rest, s).transpose(0, 1, 3, 2) * scale  # [B, Hkv, X, C*P]
        key_pos = (cols[:, None] * P + jnp.arange(P, dtype=jnp.int32)[None, :]).reshape(C * P)
        vis = key_pos[None, None, :] <= q_pos[:, :, None]  # [B, T, C*P]
        if window is not None:
            vis &= key_pos[None, None, :] > q_pos[:, :, None] - window
        vis = jnp.broadcast_to(vis[:, None, :, None, :], (B, 1, T, G, C * P)).reshape(B, 1, X, C * P)
        s = jnp.where(vis, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # nothing seen yet: keep l = acc = 0, no NaN
        corr = jnp.exp(m - m_safe)
        p = jnp.exp(s - m_safe[..., None])
        p_v = lax.optimization_barrier(p.astype(v_pool.dtype).reshape(B, Hkv, X * C * P)).reshape(B, Hkv, X, C * P)
        values = keys[0] if v_is_key else gather_heads(v_pool, blocks, c)
        pv = jnp.einsum("bhxs,bhsd->bhxd", p_v, values, preferred_element_type=_f32, precision=prec)
        return m_new, l * corr + jnp.sum(p, axis=-1), acc * corr[..., None] + pv

    init = (jnp.full((B, Hkv, X), -jnp.inf, _f32), jnp.zeros((B, Hkv, X), _f32), jnp.zeros((B, Hkv, X, Dv), _f32))
    if C == NB:  # one step covers the table: no loop
        m, l, acc = step(jnp.int32(0), init)
    else:
        m, l, acc = lax.fori_loop(jnp.min(first) // C, jnp.max(last) // C + 1, step, init)
    m, l, acc = (a.reshape(B, Hkv, T, G, *a.shape[3:]).swapaxes(1, 2) for a in (m, l, acc))  # [B, T, Hkv, G, ...]
    out, _ = finish(m, l, acc, None if sinks is None else sinks.reshape(1, 1, Hkv, G))
    return out.reshape(B, T, Hq, Dv).astype(q.dtype)


def gather_heads(pool: jax.Array, blocks: jax.Array, step: jax.Array) -> jax.Array:
    """pool [N, P, Hkv, D], blocks [B, C] -> each row's blocks in order per kv head, [B, Hkv, C*P, D]. 16-bit
    floats move as uint16 (see the module's notes); `step`, the loop's counter, keeps their bitcast in the loop."""
    B, C = blocks.shape
    _, P, Hkv, D = pool.shape
    index = (blocks[:, None, :], slice(None), jnp.arange(Hkv)[None, :, None], slice(None))
    if pool.dtype.itemsize != 2 or not jnp.issubdtype(pool.dtype, jnp.floating):
        return pool[index].reshape(B, Hkv, C * P, D)
    pool = lax.optimization_barrier((pool, step))[0]
    bits = lax.bitcast_convert_type(pool, jnp.uint16)[index]
    return lax.bitcast_convert_type(bits, pool.dtype).reshape(B, Hkv, C * P, D)
