"""Grouped GEMM as a Pallas kernel for the Triton GPU lowering (and the Pallas interpreter on CPU).

Work items are (row tile, column block) pairs. Row tiles never straddle groups: each group's rows are cut into
tiles of `bm`, so a tile reads one group's weights; the rows past sum(group_sizes) are one more group whose tiles
store zeros. At most cdiv(M, bm) + G tiles exist and the grid has that many, tiles past the last one exit at once.
The grid is (row tiles, column blocks), row tiles first, so that the tiles of one group, launched together, read
the same weight columns; or, `cols_minor`, (column blocks, row tiles), so that the column blocks of one row tile
run together and its rows stay in L2. Tile sizes, warps, stages and the order come from the tuning table
(tuning.py), by the mean rows per group.

The same kernel does the fused expert gate/up step: it keeps two accumulators (gate and up columns of one
block) and stores only the activation, so the [M, 2I] intermediate never goes to HBM.

Shapes are taken as they are: a tile's loads are masked to its group's rows (and, where K or N is not a multiple
of the tile, to the operand's columns), its stores to its group's rows, so the op pads, slices and zeroes
nothing around the kernel. (The interpreter pads each ref by the slice size before a dynamic slice, so its
masked loads past the end read the fill value, as a GPU's do.)
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.typing import DTypeLike

try:
    from jax.experimental.pallas import triton as plt
except ImportError:  # a JAX without the Triton backend: platform.pallas_unavailable() refuses these kernels
    plt = None  # type: ignore[assignment]  # a module or None: checked before use

from moejax.kernels.activation import glu
from moejax.kernels.grouped_matmul.tuning import PallasConfig, pallas_config
from moejax.kernels.padding import round_up
from moejax.kernels.precision import for_operands

_f32 = jnp.float32


def max_tiles(rows: int, groups: int, bm: int) -> int:
    """Row tiles of `rows` rows cut by `groups` groups and the rows of no group: each of the G + 1 parts adds at
    most one partial tile to the cdiv(rows, bm) of the whole."""
    return -(-rows // bm) + groups


def tile_schedule(group_sizes: jax.Array, rows: int, bm: int, tiles: int) -> jax.Array:
    """-> int32 [3, tiles]: (group, first row, end row of the group) per tile; empty tiles have end == first.
    The rows past sum(group_sizes) (clipped to `rows`) are group G: their tiles store zeros."""
    G = group_sizes.shape[0]
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), rows)
    row_end = jnp.concatenate([ends, jnp.full((1,), rows, jnp.int32)])  # group G: the rows of no group
    sizes = row_end - jnp.concatenate([jnp.zeros((1,), jnp.int32), row_end[:-1]])
    per_group = (sizes + bm - 1) // bm
    tile_end = jnp.cumsum(per_group)
    t = jnp.arange(tiles, dtype=jnp.int32)
    # One comparison of every tile with every group end: a single fusion, where the default binary search is a
    # loop of small kernels on a GPU.
    g = jnp.searchsorted(tile_end, t, side="right", method="compare_all").astype(jnp.int32)
    gc = jnp.minimum(g, G)
    first = row_end[gc] - sizes[gc] + (t - (tile_end[gc] - per_group[gc])) * bm
    valid = g <= G
    return jnp.stack([gc, jnp.where(valid, first, 0), jnp.where(valid, row_end[gc], 0)])


def _kernel(*all_refs, bm, bn, bk, groups, half, act, limit, alpha, precision, cols_minor, gather, bias):
    refs = list(all_refs)  # meta, [rows], x, w, [bias], out
    meta_ref = refs.pop(0)
    rows_ref = refs.pop(0) if gather else None
    x_ref, w_ref = refs.pop(0), refs.pop(0)
    b_ref = refs.pop(0) if bias else None
    (o_ref,) = refs
    t, j = (pl.program_id(1), pl.program_id(0)) if cols_minor else (pl.program_id(0), pl.program_id(1))
    g, row0, end = meta_ref[0, t], meta_ref[1, t], meta_ref[2, t]
    K = x_ref.shape[1]
    rows = row0 + jnp.arange(bm)
    in_rows = rows < end  # this tile's group's rows: loads past them read 0, stores past them are dropped
    col = j * bn + jnp.arange(bn)
    ragged_k, ragged_n = K % bk != 0, half % bn != 0  # static: only odd (test-sized) shapes mask columns
    in_cols = col < half
    out = o_ref.at[pl.ds(row0, bm), pl.ds(j * bn, bn)]
    store_mask = in_rows[:, None] & in_cols[None, :] if ragged_n else in_rows[:, None]

    @pl.when((end > row0) & (g == groups))
    def _rows_of_no_group():
        plt.store(out, jnp.zeros((bm, bn), o_ref.dtype), mask=store_mask)

    @pl.when((end > row0) & (g < groups))
    def _product():
        starts = [j * bn] + ([half + j * bn] if act else [])
        # gather: this tile's rows are rows `tokens` of x (a row-index load per tile, then gathered row loads)
        tokens = None if rows_ref is None else plt.load(rows_ref.at[pl.ds(row0, bm)], mask=in_rows, other=0)

        def step(kb, accs):
            depth = kb * bk + jnp.arange(bk)
            x_mask = in_rows[:, None] & (depth < K)[None, :] if ragged_k else in_rows[:, None]
            if tokens is not None:
                xk = plt.load(x_ref.at[tokens[:, None], depth[None, :]], mask=x_mask, other=0.0)
            else:
                xk = plt.load(x_ref.at[pl.ds(row0, bm), pl.ds(kb * bk, bk)], mask=x_mask, other=0.0)
            w_mask = None
            if ragged_k or ragged_n:
                w_mask = (depth < K)[:, None] & in_cols[None, :]
            return tuple(acc + jnp.dot(xk, plt.load(w_ref.at[g, pl.ds(kb * bk, bk), pl.ds(c, bn)], mask=w_mask,
                                                    other=None if w_mask is None else 0.0),
                                       preferred_element_type=_f32, precision=precision)
                         for acc, c in zip(accs, starts, strict=True))

        accs = jax.lax.fori_loop(0, pl.cdiv(K, bk), step, tuple(jnp.zeros((bm, bn), _f32) for _ in starts))
        if b_ref is not None:
            b_mask = in_cols if ragged_n else None
            accs = tuple(acc + plt.load(b_ref.at[g, pl.ds(c, bn)], mask=b_mask,
                                        other=None if b_mask is None else 0.0).astype(_f32)[None, :]
                         for acc, c in zip(accs, starts, strict=True))
        y = glu(accs[0], accs[1], act, limit, alpha) if act else accs[0]
        plt.store(out, y.astype(o_ref.dtype), mask=store_mask)


def config_for(rows: int, w: jax.Array, fused: bool) -> PallasConfig:
    """The tile configuration for `rows` grouped rows against w [G, K, N] (N: [gate | up] when fused)."""
    G, K, N = w.shape
    return pallas_config(rows, G, round_up(K, 16), round_up(N // 2 if fused else N, 16), fused,
                         itemsize=w.dtype.itemsize)


def grouped_call(x: jax.Array, w: jax.Array, bias: jax.Array | None, group_sizes: jax.Array, *, cfg: PallasConfig,
                 out_dtype: DTypeLike, act: str | None = None, limit: float = 7.0, alpha: float = 1.702,
                 interpret: bool = False, rows: jax.Array | None = None) -> jax.Array:
    """x [M, K] rows grouped in order, w [G, K, N], bias [G, N] or None. act=None: -> [M, N] = x @ w[group]
    (+ bias). act set: w holds [gate | up] halves of width N/2 each and the result is [M, N/2] = glu(gate, up).
    Rows past sum(group_sizes) are 0. Any M, K, N: the tiles' loads and stores are masked.

    rows [M] int32 (optional): grouped row i is row rows[i] of x, which then holds rows in any order (an expert
    FFN's tokens): the kernel gathers them in its loads, so they need no copy in grouped order first."""
    M = x.shape[0] if rows is None else rows.shape[0]
    G, _, N = w.shape
    width = N // 2 if act else N
    if M == 0:
        return jnp.zeros((0, width), out_dtype)
    bm, bn, bk = cfg.bm, cfg.bn, cfg.bk
    tiles = max_tiles(M, G, bm)
    meta = tile_schedule(group_sizes, M, bm, tiles)
    precision = for_operands(x.dtype)  # IEEE, not TF32, for float32 models
    kernel = functools.partial(_kernel, bm=bm, bn=bn, bk=bk, groups=G, half=width, act=act, limit=limit,
                               alpha=alpha, precision=precision, cols_minor=cfg.cols_minor, gather=rows is not None,
                               bias=bias is not None)
    blocks = -(-width // bn)
    grid = (blocks, tiles) if cfg.cols_minor else (tiles, blocks)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((M, width), out_dtype),
        grid=grid,
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=cfg.warps, num_stages=cfg.stages),
        name="grouped_glu" if act else "grouped_matmul",
    )(meta, *([] if rows is None else [rows.astype(jnp.int32)]), x, w, *([] if bias is None else [bias]))


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, interpret: bool = False,
                   cfg: PallasConfig | None = None) -> jax.Array:
    """x [M, K], w [G, K, N] -> [M, N] in x.dtype (float32 accumulation); rows past sum(group_sizes) are 0.
    One kernel call: no pass over x or the output around it."""
    cfg = cfg or config_for(x.shape[0], w, fused=False)
    return grouped_call(x, w, None, group_sizes, cfg=cfg, out_dtype=x.dtype, interpret=interpret)
