"""Grouped GEMM as a Pallas kernel for the Triton GPU lowering (and the Pallas interpreter on CPU).

Work items are (row tile, column block) pairs. Row tiles never straddle groups: each group's rows are cut into
tiles of `bm`, so a tile reads one group's weights; at most cdiv(M, bm) + G tiles exist and the grid has that
many, tiles past the last one exit at once. A tile's rows past its group's end are computed but never stored.
The grid is (row tiles, column blocks), row tiles first, so that the tiles of one group, launched together, read
the same weight columns; or, `cols_minor`, (column blocks, row tiles), so that the column blocks of one row tile
run together and its rows stay in L2. Tile sizes, warps, stages and the order come from the tuning table
(tuning.py), by the mean rows per group.

The same kernel does the fused expert gate/up step: it keeps two accumulators (gate and up columns of one
block) and stores only the activation, so the [M, 2I] intermediate never goes to HBM.

Shapes: the caller pads rows to a multiple of `bm` plus one tile (dynamic slices stay in bounds in the
interpreter, which clamps starts) and K, N to multiples of 16 (real models already are).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jax.experimental import pallas as pl
try:
    from jax.experimental.pallas import triton as plt
except ImportError:  # a JAX without the Triton backend: platform.pallas_unavailable() refuses these kernels
    plt = None  # type: ignore[assignment]  # a module or None: checked before use

from moejax.kernels.activation import glu
from moejax.kernels.grouped_matmul.groups import zero_rows_of_no_group
from moejax.kernels.grouped_matmul.tuning import PallasConfig, pallas_config
from moejax.kernels.padding import pad_axis, pad_to_16, round_up
from moejax.kernels.precision import for_operands

_f32 = jnp.float32


def tile_schedule(group_sizes: jax.Array, bm: int, tiles: int) -> jax.Array:
    """-> int32 [3, tiles]: (group, first row, end row of the group) per tile; empty tiles have end == first."""
    G = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    per_group = (sizes + bm - 1) // bm
    tile_end = jnp.cumsum(per_group)
    row_end = jnp.cumsum(sizes)
    t = jnp.arange(tiles, dtype=jnp.int32)
    g = jnp.searchsorted(tile_end, t, side="right").astype(jnp.int32)
    gc = jnp.minimum(g, G - 1)
    first = row_end[gc] - sizes[gc] + (t - (tile_end[gc] - per_group[gc])) * bm
    valid = g < G
    return jnp.stack([gc, jnp.where(valid, first, 0), jnp.where(valid, row_end[gc], 0)])


def _kernel(meta_ref, x_ref, w_ref, *refs, bm, bn, bk, k, half, act, limit, alpha, precision, cols_minor):
    b_ref, o_ref = refs if len(refs) == 2 else (None, refs[0])
    t, j = (pl.program_id(1), pl.program_id(0)) if cols_minor else (pl.program_id(0), pl.program_id(1))
    g, row0, end = meta_ref[0, t], meta_ref[1, t], meta_ref[2, t]

    @pl.when(end > row0)
    def _():
        cols = [pl.ds(j * bn, bn)] + ([pl.ds(half + j * bn, bn)] if act else [])

        def step(kb, accs):
            xk = plt.load(x_ref.at[pl.ds(row0, bm), pl.ds(kb * bk, bk)])
            return tuple(acc + jnp.dot(xk, plt.load(w_ref.at[g, pl.ds(kb * bk, bk), c]),
                                       preferred_element_type=_f32, precision=precision)
                         for acc, c in zip(accs, cols))

        accs = jax.lax.fori_loop(0, k // bk, step, tuple(jnp.zeros((bm, bn), _f32) for _ in cols))
        if b_ref is not None:
            accs = tuple(acc + plt.load(b_ref.at[g, c]).astype(_f32)[None, :] for acc, c in zip(accs, cols))
        out = glu(accs[0], accs[1], act, limit, alpha) if act else accs[0]
        rows = row0 + jnp.arange(bm)
        plt.store(o_ref.at[pl.ds(row0, bm), pl.ds(j * bn, bn)], out.astype(o_ref.dtype),
                  mask=(rows < end)[:, None])


def config_for(rows: int, w: jax.Array, fused: bool) -> PallasConfig:
    """The tile configuration for `rows` grouped rows against w [G, K, N] (N: [gate | up] when fused)."""
    G, K, N = w.shape
    return pallas_config(rows, G, round_up(K, 16), round_up(N // 2 if fused else N, 16), fused,
                         itemsize=w.dtype.itemsize)


def grouped_call(x: jax.Array, w: jax.Array, bias: jax.Array | None, group_sizes: jax.Array, *, cfg: PallasConfig,
                 out_dtype: DTypeLike, act: str | None = None, limit: float = 7.0, alpha: float = 1.702,
                 interpret: bool = False) -> jax.Array:
    """x [Mp, K] (Mp = a multiple of cfg.bm, one spare tile included), w [G, K, N], bias [G, N] or None.
    act=None: -> [Mp, N] = x @ w[group] (+ bias). act set: w holds [gate | up] halves of width N/2 each and the
    result is [Mp, N/2] = glu(gate, up). Rows past sum(group_sizes) are left unwritten."""
    Mp, K = x.shape
    G, _, N = w.shape
    width = N // 2 if act else N
    bm, bn, bk = cfg.bm, cfg.bn, cfg.bk
    if width % bn or K % bk:
        raise ValueError(f"pallas grouped GEMM: width {width} and K {K} must be multiples of bn {bn} and bk {bk}")
    tiles = Mp // bm - 1 + G
    meta = tile_schedule(group_sizes, bm, tiles)
    precision = for_operands(x.dtype)  # IEEE, not TF32, for float32 models
    kernel = functools.partial(_kernel, bm=bm, bn=bn, bk=bk, k=K, half=width, act=act, limit=limit, alpha=alpha,
                               precision=precision, cols_minor=cfg.cols_minor)
    grid = (width // bn, tiles) if cfg.cols_minor else (tiles, width // bn)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((Mp, width), out_dtype),
        grid=grid,
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=cfg.warps, num_stages=cfg.stages),
        name="grouped_glu" if act else "grouped_matmul",
    )(meta, x, w, *([] if bias is None else [bias]))


def padded_rows(rows: int, bm: int) -> int:
    """Whole tiles plus one spare, so every tile's slice is in bounds."""
    return round_up(rows, bm) + bm


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, interpret: bool = False,
                   cfg: PallasConfig | None = None) -> jax.Array:
    """x [M, K], w [G, K, N] -> [M, N] in x.dtype (float32 accumulation); rows past sum(group_sizes) are 0."""
    M, N = x.shape[0], w.shape[2]
    cfg = cfg or config_for(M, w, fused=False)
    xp = pad_to_16(pad_axis(x, 0, padded_rows(M, cfg.bm)), 1)
    wp = pad_to_16(pad_to_16(w, 1), 2)
    out = grouped_call(xp, wp, None, group_sizes, cfg=cfg, out_dtype=x.dtype, interpret=interpret)[:M, :N]
    return zero_rows_of_no_group(out, group_sizes).astype(x.dtype)
