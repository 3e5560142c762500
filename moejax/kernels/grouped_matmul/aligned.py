"""The group-aligned row layout: each group's rows start at a multiple of the row tile `bm`, so every tile of
`bm` rows belongs to one group. Tile copies (TMA) address whole tiles, so the Mosaic GPU kernel needs this
layout; the padding rows are zeros, their outputs are never read back.

For rows grouped in order (sizes s_g) the layout has at most M // bm + G tiles (each group adds at most one
partial tile), so its static size is that many tiles whatever the routing.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class AlignedLayout(NamedTuple):
    position: jax.Array  # [M] row i of the grouped order -> its row in the aligned layout
    source: jax.Array  # [tiles * bm] aligned row -> grouped row, or M (a padding row)
    tile_group: jax.Array  # [tiles] group of each tile; -1 for tiles past the last group's (never computed)
    tiles: int  # static: M // bm + G


def max_tiles(rows: int, groups: int, bm: int) -> int:
    return rows // bm + groups


def aligned_layout(group_sizes: jax.Array, rows: int, bm: int) -> AlignedLayout:
    """group_sizes [G] (sum <= rows) -> the aligned layout of `rows` grouped rows. Rows past sum(group_sizes)
    belong to no group and map to a padding row."""
    G = group_sizes.shape[0]
    tiles = max_tiles(rows, G, bm)
    sizes = group_sizes.astype(jnp.int32)
    group_tiles = (sizes + bm - 1) // bm
    tile_end = jnp.cumsum(group_tiles)
    aligned_start = (tile_end - group_tiles) * bm
    start = jnp.cumsum(sizes) - sizes
    i = jnp.arange(rows, dtype=jnp.int32)
    # compare_all: one fusion on a GPU (rows x groups comparisons), where the default binary search is a loop
    group = jnp.searchsorted(jnp.cumsum(sizes), i, side="right", method="compare_all")
    in_group = group < G
    gc = jnp.minimum(group, G - 1)
    position = jnp.where(in_group, aligned_start[gc] + i - start[gc], tiles * bm)
    source = jnp.full((tiles * bm + 1,), rows, jnp.int32).at[position].set(i, mode="drop")[: tiles * bm]
    t = jnp.arange(tiles, dtype=jnp.int32)
    tile_group = jnp.searchsorted(tile_end, t, side="right", method="compare_all").astype(jnp.int32)
    return AlignedLayout(position, source, jnp.where(tile_group < G, tile_group, -1), tiles)


def to_aligned(x: jax.Array, layout: AlignedLayout) -> jax.Array:
    """x [M, K] grouped rows -> [tiles * bm, K] aligned, padding rows zero."""
    return jnp.take(x, layout.source, axis=0, mode="fill", fill_value=0)  # source M: out of range -> zeros


def from_aligned(y: jax.Array, layout: AlignedLayout) -> jax.Array:
    """y [tiles * bm, N] aligned -> [M, N] in grouped order. Rows of no group read some row of y: callers that
    allow them zero them (groups.zero_rows_of_no_group)."""
    return y[jnp.minimum(layout.position, y.shape[0] - 1)]
