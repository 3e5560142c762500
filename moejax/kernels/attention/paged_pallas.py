"""Flash attention over a paged KV cache as a Pallas kernel for the Triton GPU lowering (interpretable on CPU).

Same plan as the dense kernel (pallas.py): grid (B, Hkv, row blocks), the G = Hq/Hkv query heads of a kv head
packed as rows (row r is (t, g) = (r // G, r % G) at position q_offset + r // G), online softmax in float32,
sinks in the final normalisation. The keys are not a per-row array but the whole pool, flattened to
[N*P, Hkv, D] (a free reshape): a tile of block_k key positions j is gathered from pool rows
table[j // P] * P + j % P, so a tile may span several pool blocks and P needs no relation to the tile size.
Each program loops over the tiles its rows can see, from the window start of its first row to the causal end of
its last (table entries past that tile are never dereferenced).

Keys come in parts (MLA: latent || roped key, read from the two pools the cache holds): s sums q_piece . k_piece
over power-of-two pieces >= 16 of every part.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

# plt None: pallas_unavailable() refuses these kernels
from moejax.kernels.attention.pallas import _pieces, block_sizes, normalise, plt, softmax_tile
from moejax.kernels.padding import pad_axis, round_up
from moejax.kernels.precision import for_operands

_f32 = jnp.float32


def _kernel(qoff_ref, table_ref, *refs, G, R, P, S, block_r, block_k, window, scale, k_pieces, dv_pieces,
            has_sinks, precision):
    if has_sinks:
        sink_ref, *refs = refs
    q_ref, *refs = refs
    k_refs, (v_ref, o_ref) = refs[:len(k_pieces)], refs[len(k_pieces):]
    i = pl.program_id(2)
    qoff = qoff_ref[()]
    first = i * block_r
    q_pos = qoff + lax.div(first + jnp.arange(block_r, dtype=jnp.int32), G)

    # Key tiles some row of this tile can see: up to its last row's position (and the table's end).
    last = jnp.minimum(first + block_r, R) - 1
    hi = jnp.minimum(qoff + lax.div(last, G) + 1, S)
    kb_hi = lax.div(hi + block_k - 1, block_k)
    kb_lo = jnp.zeros_like(kb_hi)
    if window is not None:
        kb_lo = jnp.minimum(lax.div(jnp.maximum(qoff + lax.div(first, G) - window + 1, 0), block_k), kb_hi)

    qs = [[q_ref[:, pl.ds(qa, n)] for qa, _, n in pieces] for pieces in k_pieces]
    sizes = {n for pieces in k_pieces for _, _, n in pieces} | {n for _, n in dv_pieces}
    cols = {n: jnp.arange(n, dtype=jnp.int32)[None, :] for n in sizes}

    def body(kb, carry):
        m, l, acc = carry
        keys = kb * block_k + jnp.arange(block_k, dtype=jnp.int32)
        slot = table_ref[lax.div(keys, P)] * P + lax.rem(keys, P)  # pool row of each key (table padded to tiles)
        live = keys < hi
        # (key, column) pairs as two index arrays: the interpreter cannot mix an index array with a slice
        rows = slot[:, None]
        s = sum(jnp.dot(qp, plt.load(k_ref.at[rows, a + cols[n]]).T, preferred_element_type=_f32,
                        precision=precision)
                for k_ref, q_part, pieces in zip(k_refs, qs, k_pieces, strict=True)
                for qp, (_, a, n) in zip(q_part, pieces, strict=True)) * scale
        vis = live[None, :] & (keys[None, :] <= q_pos[:, None])
        if window is not None:
            vis &= keys[None, :] > q_pos[:, None] - window
        m_new, corr, p = softmax_tile(m, jnp.where(vis, s, -jnp.inf))
        acc = tuple(
            a_prev * corr[:, None] + jnp.dot(
                p.astype(v_ref.dtype),
                # past `hi` a slot may hold stale (even non-finite) values: 0 * NaN would poison the row
                plt.load(v_ref.at[rows, a + cols[n]], mask=jnp.broadcast_to(live[:, None], (block_k, n)),
                         other=0.0),
                preferred_element_type=_f32, precision=precision)
            for a_prev, (a, n) in zip(acc, dv_pieces, strict=True))
        return m_new, l * corr + jnp.sum(p, axis=1), acc

    init = (jnp.full((block_r,), -jnp.inf, _f32), jnp.zeros((block_r,), _f32),
            tuple(jnp.zeros((block_r, n), _f32) for _, n in dv_pieces))
    m, l, acc = lax.fori_loop(kb_lo, kb_hi, body, init)

    for a_out, (a, n) in zip(normalise(m, l, acc, sink_ref[...] if has_sinks else None), dv_pieces, strict=True):
        plt.store(o_ref.at[:, pl.ds(a, n)], a_out.astype(o_ref.dtype))


@functools.partial(jax.jit, static_argnames=("window", "scale", "interpret"))
def attention(q: jax.Array, k_parts: Sequence[jax.Array], v_pool: jax.Array, block_table: jax.Array,
              q_offset: jax.Array, sinks: jax.Array | None, *, window: int | None, scale: float, interpret: bool = False
              ) -> jax.Array:
    """q [B,T,Hq,D], k_parts (pools [N,P,Hkv,D_i], sum D_i = D), v_pool [N,P,Hkv,Dv], block_table int32 [B,NB],
    q_offset int32 [B], sinks [Hq] or None -> [B,T,Hq,Dv] in q.dtype (see paged.py)."""
    B, T, Hq, D = q.shape
    N, P, Hkv, Dv = v_pool.shape
    NB = block_table.shape[1]
    G = Hq // Hkv
    R, S = T * G, NB * P
    widths = [p.shape[-1] for p in k_parts]
    block_r, block_k, num_warps, num_stages = block_sizes(max(sum(round_up(w, 16) for w in widths), Dv), R, S)
    Rp, Dvp = round_up(R, block_r), round_up(Dv, 16)

    # Each key part (and v) padded to a multiple of 16: a copy of the pool, so only for widths that are not (tiny test
    # models); real ones (128, 64, 512 + 64) pass through untouched. q's slices are padded to match (q is small).
    def flat(pool: jax.Array, w: int) -> jax.Array:  # [N*P, Hkv, w]
        return pad_axis(pool.reshape(N * P, Hkv, pool.shape[-1]), 2, w)

    kp = [flat(p, round_up(w, 16)) for p, w in zip(k_parts, widths, strict=True)]
    vp = flat(v_pool, Dvp)
    starts = [sum(widths[:i]) for i in range(len(widths))]
    if all(w % 16 == 0 for w in widths):
        qd = q
    else:
        qd = jnp.concatenate([pad_axis(q[..., a:a + w], 3, round_up(w, 16))
                              for a, w in zip(starts, widths, strict=True)], -1)
    # per part: (offset in padded q, offset in the part, size) of its power-of-two pieces
    k_pieces, q_at = [], 0
    for w in widths:
        k_pieces.append(tuple((q_at + a, a, n) for a, n in _pieces(round_up(w, 16))))
        q_at += round_up(w, 16)

    # q rows (t, g) per kv head: [B, Hkv, T*G, Dq]
    qr = pad_axis(qd.reshape(B, T, Hkv, G, q_at).transpose(0, 2, 1, 3, 4).reshape(B, Hkv, R, q_at), 2, Rp)
    # The table padded to whole key tiles (block 0; those keys are past `hi`, masked): a tile never reads past it.
    table = pad_axis(block_table.astype(jnp.int32), 1, -(-round_up(S, block_k) // P))

    grid = (B, Hkv, Rp // block_r)
    in_specs = [pl.BlockSpec((None,), lambda b, h, i: (b,)),
                pl.BlockSpec((None, table.shape[1]), lambda b, h, i: (b, 0))]
    args = [q_offset.astype(jnp.int32), table]
    if sinks is not None:
        row_g = jnp.arange(Rp) % G
        args.append(sinks.astype(_f32).reshape(Hkv, G)[:, row_g])  # [Hkv, Rp]: the sink of each row's head
        in_specs.append(pl.BlockSpec((None, block_r), lambda b, h, i: (h, i)))
    args += [qr, *kp, vp]
    in_specs += [pl.BlockSpec((None, None, block_r, q_at), lambda b, h, i: (b, h, i, 0))]
    in_specs += [pl.BlockSpec((N * P, None, a.shape[-1]), lambda b, h, i: (0, h, 0)) for a in (*kp, vp)]
    out_specs = pl.BlockSpec((None, None, block_r, Dvp), lambda b, h, i: (b, h, i, 0))

    kernel = functools.partial(
        _kernel, G=G, R=R, P=P, S=S, block_r=block_r, block_k=block_k, window=window, scale=scale,
        k_pieces=tuple(k_pieces), dv_pieces=tuple(_pieces(Dvp)), has_sinks=sinks is not None,
        precision=for_operands(q.dtype))
    out = pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_specs,
        out_shape=jax.ShapeDtypeStruct((B, Hkv, Rp, Dvp), q.dtype),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="moejax_paged_attention")(*args)
    return out[:, :, :R, :Dv].reshape(B, Hkv, T, G, Dv).transpose(0, 2, 1, 3, 4).reshape(B, T, Hq, Dv)
