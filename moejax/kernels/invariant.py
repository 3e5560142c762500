"""Batch-invariant computation (`batch_invariant=True`): each row's result does not depend on the other rows of the
step, their number or the padding. Every reduction whose order could follow the batch runs in fixed-shape pieces:
matmuls over fixed [ROWS, K] row tiles, norms and routing per tile, the routed experts per tile of one expert's rows
(rows sorted by expert, each expert's rows padded to whole tiles) with a token's top-k outputs added in rank order,
and attention per fixed tile of queries over fixed KEY_BLOCK-key blocks at absolute positions (an online softmax:
a block no query of the tile sees leaves every bit unchanged, so padding, prefix reuse and chunk boundaries do not
move a row). The loops hide their trip count from XLA (an optimization barrier), so it compiles each piece once,
for its own shape, whatever the batch.

The mode is switched on while a step is traced (`scope`, `traced`: the whole-model steps with
Kernels(invariant=True)); the model's matmuls, norms, router, expert FFN and attention ask `active()`."""
from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from moejax.config import ModelConfig
from moejax.kernels.activation import glu_of
from moejax.kernels.expert_ffn.tiled import tile_layout
from moejax.kernels.precision import for_operands
from moejax.kernels.routing import dispatch, gather_rows
from moejax.row_tiles import ROWS, active, by_rows, dot, log_softmax, loop, scope, traced

__all__ = ["ROWS", "KEY_BLOCK", "active", "attention", "by_rows", "dot", "expert_ffn", "log_softmax",
           "paged_attention", "scope", "traced", "tree_attention", "unsupported"]
KEY_BLOCK = 16  # keys per attention block, from key position 0
_f32 = jnp.float32


def unsupported(cfg: ModelConfig, layout: object) -> str | None:
    """Why the mode cannot hold for this model and layout, or None (the placement says for itself:
    Placement.runs_batch_invariant). It covers one device running the whole model in its jits with grouped-query
    attention; elsewhere a collective, a host transfer or a kernel it has no fixed-shape form of would decide the
    order of a reduction."""
    if layout is not None:
        return f"covers one device per replica (placement resident, no layout); got layout {layout}"
    if cfg.attention == "mla":
        return "covers grouped-query attention; this model's MLA attention has no fixed-tile form yet"
    return None


# -- routed experts -----------------------------------------------------------------------------------------------
def expert_ffn(x: jax.Array, idx: jax.Array, weights: jax.Array, wgu: jax.Array, wd: jax.Array,
               bgu: jax.Array | None, bd: jax.Array | None, act: str, limit: float, alpha: float) -> jax.Array:
    """expert_ffn's arguments -> float32 [N, D]: rows sorted by expert, each expert's padded to whole ROWS tiles,
    each tile one fixed-shape product with its expert's weights; a token's k outputs added in rank order."""
    (N, k), E, D = idx.shape, wgu.shape[0], x.shape[1]
    routing = dispatch(idx, E)
    position, tile_expert = tile_layout(routing.group_sizes, N * k, ROWS)
    tiles = tile_expert.shape[0]
    buf = jnp.zeros((tiles * ROWS, D), x.dtype).at[position].set(gather_rows(x, routing, k))
    used = jnp.sum(-(-routing.group_sizes // ROWS))  # tiles past the last expert's hold no row
    prec = for_operands(x.dtype)

    def tile(i: jax.Array) -> jax.Array:
        e = tile_expert[i]
        rows = lax.dynamic_slice_in_dim(buf, i * ROWS, ROWS)
        h = jnp.dot(rows, wgu[e], preferred_element_type=_f32, precision=prec)
        if bgu is not None:
            h = h + bgu[e].astype(_f32)
        y = jnp.dot(glu_of(h, act, limit, alpha).astype(x.dtype), wd[e], preferred_element_type=_f32, precision=prec)
        return y if bd is None else y + bd[e].astype(_f32)
    y = loop(used, tile, jax.ShapeDtypeStruct((tiles, ROWS, D), _f32)).reshape(tiles * ROWS, D)
    per_rank = y[position][routing.inverse].reshape(N, k, D)
    w = weights.astype(_f32)
    out = per_rank[:, 0] * w[:, :1]
    for j in range(1, k):  # rank order, one add at a time: no reduction XLA could reorder
        out = out + per_rank[:, j] * w[:, j:j + 1]
    return out


# -- attention ----------------------------------------------------------------------------------------------------
def _empty_softmax(Hkv: int, G: int, Dv: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """An online softmax over no key yet, per query tile: (running max, sum, weighted values) [Hkv, G, ROWS(, Dv)]."""
    return (jnp.full((Hkv, G, ROWS), -jnp.inf, _f32), jnp.zeros((Hkv, G, ROWS), _f32),
            jnp.zeros((Hkv, G, ROWS, Dv), _f32))


def _normalized(m: jax.Array, l: jax.Array, acc: jax.Array, sinks: jax.Array | None) -> jax.Array:
    """An online softmax's output [Hkv, G, ROWS, Dv]: the sinks (a weight per head with no value) added to the
    denominator, then the weighted values divided by it; a row that saw nothing is 0."""
    if sinks is not None:
        sink = sinks.astype(_f32).reshape(m.shape[:2])[..., None]
        top = jnp.maximum(m, sink)
        drop = jnp.exp(m - top)
        l, acc = l * drop + jnp.exp(sink - top), acc * drop[..., None]
    return jnp.where((l > 0)[..., None], acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_offset: jax.Array, kv_lengths: jax.Array,
              sinks: jax.Array | None, *, causal: bool, window: int | None, scale: float, return_lse: bool
              ) -> tuple[jax.Array, jax.Array | None]:
    """The attention op's arguments (q_offset, kv_lengths int32 [B]) -> (out [B,T,Hq,Dv] in q.dtype, lse or None):
    per row and fixed tile of ROWS queries, an online softmax over KEY_BLOCK-key blocks from key 0, visiting only
    the blocks the tile can see."""
    B, T, Hq, D = q.shape
    S, Hkv, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = Hq // Hkv
    prec = for_operands(q.dtype)
    nT = -(-T // ROWS)
    qp = jnp.pad(q, ((0, 0), (0, nT * ROWS - T), (0, 0), (0, 0))).reshape(B, nT, ROWS, Hkv, G, D)
    Sp = -(-S // KEY_BLOCK) * KEY_BLOCK
    kp = jnp.pad(k, ((0, 0), (0, Sp - S), (0, 0), (0, 0)))
    vp = jnp.pad(v, ((0, 0), (0, Sp - S), (0, 0), (0, 0)))
    lengths = jnp.minimum(kv_lengths, S)

    def piece(i: jax.Array) -> jax.Array:
        b, t = i // nT, i % nT
        qt = qp[b, t]  # [ROWS, Hkv, G, D]
        q_pos = q_offset[b] + t * ROWS + jnp.arange(ROWS, dtype=jnp.int32)
        length = lengths[b]
        end = jnp.minimum(length, q_pos[-1] + 1) if causal else length
        first = 0 if window is None else jnp.maximum(q_pos[0] - window + 1, 0) // KEY_BLOCK

        def block(j: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
            m, l, acc = carry
            kb = lax.dynamic_slice_in_dim(kp[b], j * KEY_BLOCK, KEY_BLOCK)
            key_pos = j * KEY_BLOCK + jnp.arange(KEY_BLOCK, dtype=jnp.int32)
            vis = jnp.broadcast_to(key_pos[None, :] < length, (ROWS, KEY_BLOCK))
            if causal:
                vis &= key_pos[None, :] <= q_pos[:, None]
            if window is not None:
                vis &= key_pos[None, :] > q_pos[:, None] - window
            vb = jnp.where((key_pos < length)[:, None, None], lax.dynamic_slice_in_dim(vp[b], j * KEY_BLOCK,
                                                                                      KEY_BLOCK), 0)
            s = jnp.einsum("qngd,knd->ngqk", qt, kb, preferred_element_type=_f32, precision=prec) * scale
            s = jnp.where(vis[None, None], s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
            p = jnp.exp(s - safe[..., None])
            alpha = jnp.exp(m - safe)
            pv = jnp.einsum("ngqk,knv->ngqv", p.astype(v.dtype), vb, preferred_element_type=_f32, precision=prec)
            return m_new, l * alpha + jnp.sum(p, axis=-1), acc * alpha[..., None] + pv
        init = _empty_softmax(Hkv, G, Dv)
        last = lax.optimization_barrier(-(-end // KEY_BLOCK))
        m, l, acc = lax.fori_loop(jnp.asarray(first, jnp.int32), last, block, init)
        lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
        out = _normalized(m, l, acc, sinks)
        # [Hkv, G, ROWS, Dv] -> [ROWS, Hq, Dv], lse [ROWS, Hq] riding as one more column
        packed = jnp.concatenate([out, lse[..., None]], axis=-1)
        return packed.transpose(2, 0, 1, 3).reshape(ROWS, Hq, Dv + 1)
    packed = loop(B * nT, piece, jax.ShapeDtypeStruct((B * nT, ROWS, Hq, Dv + 1), _f32))
    packed = packed.reshape(B, nT * ROWS, Hq, Dv + 1)[:, :T]
    out, lse = packed[..., :Dv].astype(q.dtype), packed[..., Dv]
    return out, (lse if return_lse else None)


def paged_attention(q: jax.Array, k_parts: Sequence[jax.Array], v_pool: jax.Array, block_table: jax.Array,
                    q_offset: jax.Array, sinks: jax.Array | None, *, window: int | None, scale: float) -> jax.Array:
    """paged_attention's arguments: each row's blocks gathered in order (keys at their positions), then
    `attention` over the keys up to the row's last query."""
    B, NB = block_table.shape

    def gather(pool: jax.Array) -> jax.Array:  # [N, P, ...] -> each row's blocks in order, [B, NB*P, ...]
        return pool[block_table.reshape(-1)].reshape(B, NB * pool.shape[1], *pool.shape[2:])
    k = jnp.concatenate([gather(p) for p in k_parts], axis=-1)
    v = gather(v_pool)
    lengths = q_offset + q.shape[1]
    return attention(q, k, v, q_offset, lengths, sinks, causal=True, window=window, scale=scale,
                     return_lse=False)[0]


def tree_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, scale: float, k_pos: jax.Array,
                   q_pre: jax.Array, k_pre: jax.Array, k_post: jax.Array, window: int | None,
                   sinks: jax.Array | None) -> jax.Array:
    """tree_attend's arguments (rows packing token trees, keys = prior keys then this call's) -> [B,T,Hq,Dv]. A
    request's keys sit at offsets that follow its neighbours in the pack, so blocks of keys cannot be aligned to
    it: each tile of ROWS queries takes the keys one loop step each, in key order (its visible keys are its
    ancestors, in position order wherever they are packed), and a key it cannot see changes no bit. Each score is
    a product and a sum over the head dim, the same arithmetic for every query and key. (Keys unrolled within a
    step were measured to differ by a rounding with the step a key fell in.)"""
    B, T, Hq, D = q.shape
    S, Hkv, Dv = k.shape[1], k.shape[2], v.shape[3]
    G, P = Hq // Hkv, S - T
    nT = -(-T // ROWS)
    pad_q = ((0, 0), (0, nT * ROWS - T))
    qp = jnp.pad(q, pad_q + ((0, 0), (0, 0))).reshape(B, nT, ROWS, Hkv, G, D).astype(_f32)
    qpos = jnp.pad(q_pos, pad_q, constant_values=-1).reshape(B, nT, ROWS)  # padding queries see no key
    qpre = jnp.pad(q_pre, pad_q, constant_values=-1).reshape(B, nT, ROWS)
    kp, vp, kpos, kpre, kpost = k.astype(_f32), v, k_pos, k_pre, k_post

    def piece(i: jax.Array) -> jax.Array:
        b, t = i // nT, i % nT
        qt, pos, pre = qp[b, t], qpos[b, t], qpre[b, t]  # [ROWS, Hkv, G, D], [ROWS], [ROWS]

        def key(j: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array, jax.Array]:
            m, l, acc = carry
            dist = pos - kpos[b, j]
            vis = (dist >= 0) & (kpre[b, j] <= pre) & (pre < kpost[b, j])
            if window is not None:
                vis &= dist < window
            s = jnp.sum(qt * kp[b, j][None, :, None, :], axis=-1).transpose(1, 2, 0) * scale  # [Hkv, G, ROWS]
            s = jnp.where(vis[None, None], s, -jnp.inf)
            m_new = jnp.maximum(m, s)
            safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
            p, alpha = jnp.exp(s - safe), jnp.exp(m - safe)
            value = jnp.where(jnp.any(vis), vp[b, j], 0).astype(_f32)  # [Hkv, Dv]: never a stray NaN
            return m_new, l * alpha + p, acc * alpha[..., None] + p[..., None] * value[:, None, None, :]
        init = _empty_softmax(Hkv, G, Dv)
        # a query's ancestors precede it: the tile sees keys before P + its last query's index only
        last = lax.optimization_barrier(jnp.minimum(P + (t + 1) * ROWS, S))
        m, l, acc = lax.fori_loop(0, last, key, init)
        out = _normalized(m, l, acc, sinks)
        return out.transpose(2, 0, 1, 3).reshape(ROWS, Hq, Dv)
    out = loop(B * nT, piece, jax.ShapeDtypeStruct((B * nT, ROWS, Hq, Dv), _f32))
    return out.reshape(B, nT * ROWS, Hq, Dv)[:, :T].astype(q.dtype)
