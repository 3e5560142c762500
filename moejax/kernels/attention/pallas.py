"""Flash attention as a Pallas kernel for the Triton GPU lowering (interpretable on CPU).

Grid (B, Hkv, row blocks). The G = Hq/Hkv query heads that share a kv head are packed as rows: row r is
(t, g) = (r // G, r % G) at key position q_offset + r // G. Decode (T = 1) thus fills a tile with G rows
and every K/V tile is read once per kv head, not once per query head.

Each program loops only over the KV blocks its rows can see: up to min(kv_length, causal position of its
last row + 1), from the window start of its first row. Online softmax in float32; sinks join the final
normalisation only; lse (without sinks) is an optional second output.

Triton wants power-of-two tiles >= 16 on every dot dimension. Rows and keys are padded to whole blocks
(so no dynamic slice runs out of bounds: the interpreter would clamp its start and shift data), head dims
to a multiple of 16, and a head dim is split into power-of-two pieces (576 = 512 + 64, 192 = 128 + 64)
instead of being padded to the next power of two.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

try:
    from jax.experimental.pallas import triton as plt
except ImportError:  # a JAX without the Triton backend: platform.pallas_unavailable() refuses these kernels
    plt = None  # type: ignore[assignment]  # a module or None: checked before use

from moejax.kernels.padding import pad_axis, round_up
from moejax.kernels.precision import for_operands

_f32 = jnp.float32


def _pow2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


def block_sizes(d: int, rows: int, s: int) -> tuple[int, int, int, int]:
    """(block_r, block_k, num_warps, num_stages) for head width d (max of D, Dv), T*G rows and S keys.
    Wide heads get smaller tiles so q, the accumulator and a K/V tile fit registers and shared memory."""
    cap_r = 128 if d <= 64 else 64 if d <= 256 else 32
    cap_k = 64 if d <= 256 else 32
    block_r = min(cap_r, max(16, _pow2(rows)))
    block_k = min(cap_k, max(16, _pow2(s)))
    num_warps = 4 if d <= 64 or block_r <= 16 else 8
    return block_r, block_k, num_warps, 3 if d <= 128 else 2


def _pieces(d: int) -> list[tuple[int, int]]:
    """(start, size) power-of-two pieces >= 16 covering d (a multiple of 16), largest first."""
    out, start = [], 0
    for bit in reversed(range(4, d.bit_length())):
        if d & (1 << bit):
            out.append((start, 1 << bit))
            start += 1 << bit
    return out


def softmax_tile(m: jax.Array, s: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Online softmax over one key tile: running max m [rows], logits s [rows, keys] (-inf: not visible) ->
    (new running max, the factor that rescales the sums so far, exp(s - new max))."""
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # nothing seen yet: l, acc stay 0, no NaN
    return m_new, jnp.exp(m - m_safe), jnp.exp(s - m_safe[:, None])


def normalise(m: jax.Array, l: jax.Array, acc: tuple[jax.Array, ...], sink: jax.Array | None
              ) -> tuple[jax.Array, ...]:
    """The end of the tile loop: acc (pieces [rows, n]) / l, with sink (one extra logit per row, or None) in the
    denominator only; a row that saw no key gets 0."""
    if sink is not None:
        m_fin = jnp.maximum(m, sink)
        rescale = jnp.exp(m - m_fin)
        l = l * rescale + jnp.exp(sink - m_fin)
        acc = tuple(a * rescale[:, None] for a in acc)
    inv = 1.0 / jnp.where(l == 0, 1.0, l)
    return tuple(a * inv[:, None] for a in acc)


def _kernel(qoff_ref, kvlen_ref, *refs, G, R, block_r, block_k, causal, window, scale, d_pieces,
            dv_pieces, has_sinks, precision):
    if has_sinks:
        sink_ref, *refs = refs
    q_ref, k_ref, v_ref, o_ref, *lse_ref = refs
    i = pl.program_id(2)
    qoff, kvlen = qoff_ref[()], kvlen_ref[()]
    first = i * block_r
    q_pos = qoff + lax.div(first + jnp.arange(block_r, dtype=jnp.int32), G)

    # Blocks of keys some row of this tile can see.
    hi = kvlen
    if causal:
        last = jnp.minimum(first + block_r, R) - 1
        hi = jnp.minimum(hi, qoff + lax.div(last, G) + 1)
    kb_hi = lax.div(hi + block_k - 1, block_k)
    kb_lo = jnp.zeros_like(kb_hi)
    if window is not None:
        kb_lo = jnp.minimum(lax.div(jnp.maximum(qoff + lax.div(first, G) - window + 1, 0), block_k), kb_hi)

    qs = [q_ref[:, pl.ds(a, n)] for a, n in d_pieces]

    def body(kb, carry):
        m, l, acc = carry
        keys = kb * block_k + jnp.arange(block_k, dtype=jnp.int32)
        live = (keys < hi)[:, None]  # never read K/V past the visible range (may be garbage)
        s = sum(jnp.dot(qp, plt.load(k_ref.at[pl.ds(kb * block_k, block_k), pl.ds(a, n)], mask=live,
                                     other=0.0).T, preferred_element_type=_f32, precision=precision)
                for qp, (a, n) in zip(qs, d_pieces, strict=True)) * scale
        vis = keys[None, :] < kvlen
        if causal:
            vis &= keys[None, :] <= q_pos[:, None]
        if window is not None:
            vis &= keys[None, :] > q_pos[:, None] - window
        m_new, corr, p = softmax_tile(m, jnp.where(vis, s, -jnp.inf))
        acc = tuple(
            a_prev * corr[:, None] + jnp.dot(
                p.astype(v_ref.dtype),
                plt.load(v_ref.at[pl.ds(kb * block_k, block_k), pl.ds(a, n)], mask=live, other=0.0),
                preferred_element_type=_f32, precision=precision)
            for a_prev, (a, n) in zip(acc, dv_pieces, strict=True))
        return m_new, l * corr + jnp.sum(p, axis=1), acc

    init = (jnp.full((block_r,), -jnp.inf, _f32), jnp.zeros((block_r,), _f32),
            tuple(jnp.zeros((block_r, n), _f32) for _, n in dv_pieces))
    m, l, acc = lax.fori_loop(kb_lo, kb_hi, body, init)

    if lse_ref:
        lse_ref[0][...] = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
    for a_out, (a, n) in zip(normalise(m, l, acc, sink_ref[...] if has_sinks else None), dv_pieces, strict=True):
        plt.store(o_ref.at[:, pl.ds(a, n)], a_out.astype(o_ref.dtype))


@functools.partial(jax.jit, static_argnames=("causal", "window", "scale", "return_lse", "interpret"))
def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_offset: jax.Array, kv_lengths: jax.Array,
              sinks: jax.Array | None, *, causal: bool, window: int | None, scale: float, return_lse: bool,
              interpret: bool = False) -> tuple[jax.Array, jax.Array | None]:
    B, T, Hq, D = q.shape
    S, Hkv, Dv = k.shape[1], k.shape[2], v.shape[-1]
    G = Hq // Hkv
    R = T * G
    block_r, block_k, num_warps, num_stages = block_sizes(max(D, Dv), R, S)
    Rp, Sp, Dp, Dvp = round_up(R, block_r), round_up(S, block_k), round_up(D, 16), round_up(Dv, 16)

    # q rows (t, g) per kv head: [B, Hkv, T*G, D]
    qr = q.reshape(B, T, Hkv, G, D).transpose(0, 2, 1, 3, 4).reshape(B, Hkv, R, D)
    qr = pad_axis(pad_axis(qr, 2, Rp), 3, Dp)
    kp = pad_axis(pad_axis(k, 1, Sp), 3, Dp)
    vp = pad_axis(pad_axis(v, 1, Sp), 3, Dvp)

    grid = (B, Hkv, Rp // block_r)
    scalar = pl.BlockSpec((None,), lambda b, h, i: (b,))
    in_specs = [scalar, scalar]
    args = [q_offset.astype(jnp.int32), kv_lengths.astype(jnp.int32)]
    if sinks is not None:
        row_g = jnp.arange(Rp) % G
        args.append(sinks.astype(_f32).reshape(Hkv, G)[:, row_g])  # [Hkv, Rp]: the sink of each row's head
        in_specs.append(pl.BlockSpec((None, block_r), lambda b, h, i: (h, i)))
    args += [qr, kp, vp]
    in_specs += [pl.BlockSpec((None, None, block_r, Dp), lambda b, h, i: (b, h, i, 0)),
                 pl.BlockSpec((None, Sp, None, Dp), lambda b, h, i: (b, 0, h, 0)),
                 pl.BlockSpec((None, Sp, None, Dvp), lambda b, h, i: (b, 0, h, 0))]
    out_shape = [jax.ShapeDtypeStruct((B, Hkv, Rp, Dvp), q.dtype)]
    out_specs = [pl.BlockSpec((None, None, block_r, Dvp), lambda b, h, i: (b, h, i, 0))]
    if return_lse:
        out_shape.append(jax.ShapeDtypeStruct((B, Hkv, Rp), _f32))
        out_specs.append(pl.BlockSpec((None, None, block_r), lambda b, h, i: (b, h, i)))

    precision = for_operands(q.dtype)
    kernel = functools.partial(
        _kernel, G=G, R=R, block_r=block_r, block_k=block_k, causal=causal, window=window, scale=scale,
        d_pieces=_pieces(Dp), dv_pieces=_pieces(Dvp), has_sinks=sinks is not None, precision=precision)
    res = pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="moejax_flash_attention")(*args)

    out = res[0][:, :, :R, :Dv].reshape(B, Hkv, T, G, Dv).transpose(0, 2, 1, 3, 4).reshape(B, T, Hq, Dv)
    if not return_lse:
        return out, None
    lse = res[1][:, :, :R].reshape(B, Hkv, T, G).transpose(0, 2, 1, 3).reshape(B, T, Hq)
    return out, lse
