"""Expert FFN over row tiles that each belong to one expert (MegaBlocks' padding, in plain XLA): every expert's
sorted rows are padded to a multiple of the tile, so one batched matmul over [tiles, tile, D] with each tile's
expert weights gathered computes all of them. Static shapes, dropless and differentiable (gathers and scatters
only), at most E * (tile - 1) padding rows: the training backend, where `xla`'s loop over experts cannot be
differentiated and `dense` pays E/k times the FLOPs."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.kernels.activation import glu_of
from moejax.kernels.precision import f32_einsum
from moejax.kernels.routing import combine, dispatch, gather_rows

_f32 = jnp.float32
TILE_ROWS = 128


def tile_layout(group_sizes: jax.Array, rows: int, tile: int) -> tuple[jax.Array, jax.Array]:
    """Rows sorted by expert (group_sizes [E], summing to `rows`) -> (padded position of each sorted row [rows],
    expert of each tile [tiles]). tiles = ceil(rows / tile) + E bounds any split into per-expert tiles; the
    tiles past the last expert's are zero rows given to expert E-1."""
    E = group_sizes.shape[0]
    tiles = -(-rows // tile) + E
    padded = -(-group_sizes // tile) * tile
    start = jnp.cumsum(group_sizes) - group_sizes
    padded_end = jnp.cumsum(padded)
    expert_of_row = jnp.repeat(jnp.arange(E, dtype=jnp.int32), group_sizes, total_repeat_length=rows)
    position = (padded_end - padded)[expert_of_row] + jnp.arange(rows, dtype=jnp.int32) - start[expert_of_row]
    tile_start = jnp.arange(tiles, dtype=jnp.int32) * tile
    tile_expert = jnp.minimum(jnp.searchsorted(padded_end, tile_start, side="right"), E - 1).astype(jnp.int32)
    return position, tile_expert


def tiled(x: jax.Array, idx: jax.Array, weights: jax.Array, wgu: jax.Array, wd: jax.Array, bgu: jax.Array | None,
          bd: jax.Array | None, act: str, limit: float, alpha: float, tile: int = TILE_ROWS) -> jax.Array:
    (N, k), E, D = idx.shape, wgu.shape[0], x.shape[1]
    routing = dispatch(idx, E)
    tile = min(tile, N * k)
    position, tile_expert = tile_layout(routing.group_sizes, N * k, tile)
    tiles = tile_expert.shape[0]
    buf = jnp.zeros((tiles * tile, D), x.dtype).at[position].set(gather_rows(x, routing, k))
    h = f32_einsum("tmd,tdf->tmf", buf.reshape(tiles, tile, D), wgu[tile_expert])
    if bgu is not None:
        h = h + bgu.astype(_f32)[tile_expert][:, None]
    y = f32_einsum("tmf,tfd->tmd", glu_of(h, act, limit, alpha).astype(x.dtype), wd[tile_expert])
    if bd is not None:
        y = y + bd.astype(_f32)[tile_expert][:, None]
    return combine(y.reshape(tiles * tile, D)[position], routing, weights)
