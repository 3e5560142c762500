"""Block pools of KV: per layer, the attention cache layout with batch = block and length = BLOCK tokens. The
prefix cache of packed scoring keeps blocks here (its host-side table: moejax.sched.prefix_cache), and the
continuous-batching scheduler keeps every sequence's whole cache here (paged; its allocator:
moejax.sched.block_pool), read through a block table per sequence."""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from moejax.sampling import StepArray

BLOCK = 16
Layer = dict[str, jax.Array]  # one layer's keys (or pool) by name


@functools.partial(jax.tree_util.register_dataclass, data_fields=["pool", "table", "slots", "layer"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class PagedCache:
    """One layer's cache as the attention blocks take it in a paged step: `pool` {name: [N, BLOCK, ...]}, the rows'
    block tables [B, NB] (position p of row b is in block table[b, p // BLOCK]), and `slots` [B, T], where each
    of this call's tokens is written (flat index block * BLOCK + offset; N * BLOCK or more: not written).
    With `layer` (a stacked model's scan), `pool` is the run member's stacked pool {name: [count, N, BLOCK, ...]}
    and this is its slice `layer`: written in place there, never copied out and back."""
    pool: dict
    table: jax.Array
    slots: jax.Array
    layer: jax.Array | None = None

    def readable(self) -> tuple[dict, jax.Array]:
        """(a pool {name: [M, BLOCK, ...]}, block tables into it) through which attention reads this layer's keys. A
        stacked pool is read whole, its [count, N] blocks seen as count * N and the tables moved to slice `layer`:
        a free reshape, where slicing the layer out would copy it for every layer of every step."""
        if self.layer is None:
            return self.pool, self.table
        n = jax.tree.leaves(self.pool)[0].shape[1]
        return {name: a.reshape(-1, *a.shape[2:]) for name, a in self.pool.items()}, self.table + self.layer * n

    def write(self, new: dict) -> PagedCache:
        """This call's keys {name: [B, T, ...]} stored at their slots."""
        if self.layer is None:
            return dataclasses.replace(self, pool={name: write_slots(a, self.slots, new[name])
                                                   for name, a in self.pool.items()})
        return dataclasses.replace(self, pool={name: write_layer_slots(a, self.layer, self.slots, new[name])
                                               for name, a in self.pool.items()})


def write_slots(pool: jax.Array, slots: jax.Array, new: jax.Array) -> jax.Array:
    """pool [N, BLOCK, ...] with new [B, T, ...] written at flat slots [B, T] (out of range: dropped)."""
    flat = pool.reshape(-1, *pool.shape[2:])
    flat = flat.at[slots.reshape(-1)].set(new.reshape(-1, *pool.shape[2:]).astype(pool.dtype), mode="drop")
    return flat.reshape(pool.shape)


def write_layer_slots(pool: jax.Array, layer: jax.Array, slots: jax.Array, new: jax.Array) -> jax.Array:
    """A stacked pool [count, N, BLOCK, ...] with new [B, T, ...] written at flat slots [B, T] of slice `layer`
    (out of range: dropped, never into another layer's slice)."""
    per_layer = pool.shape[1] * pool.shape[2]
    flat = pool.reshape(-1, *pool.shape[3:])
    at = jnp.where(slots < per_layer, layer * per_layer + slots, flat.shape[0])
    flat = flat.at[at.reshape(-1)].set(new.reshape(-1, *pool.shape[3:]).astype(pool.dtype), mode="drop")
    return flat.reshape(pool.shape)


def slots_of(table: StepArray, positions: StepArray, valid: jax.Array, num_blocks: int) -> jax.Array:
    """Flat pool slots [B, T] of `positions` [B, T] through block tables [B, NB]; where not `valid`, an out-of-range
    slot (nothing is written)."""
    block = jnp.take_along_axis(table, jnp.clip(positions // BLOCK, 0, table.shape[1] - 1), axis=1)
    return jnp.where(valid, block * BLOCK + positions % BLOCK, num_blocks * BLOCK)


def gather(pool: Sequence[Layer], block_ids: StepArray) -> list[Layer]:
    """pool (list per layer of {name: [N, BLOCK, ...]}), block_ids int [B, NP] -> per-layer [B, NP*BLOCK, ...]."""
    return [gather_layer(layer, block_ids) for layer in pool]


def gather_layer(layer: Layer, block_ids: StepArray) -> Layer:
    """One layer's pool {name: [N, BLOCK, ...]}, block_ids int [B, NP] -> {name: [B, NP*BLOCK, ...]}."""
    B, NP = block_ids.shape
    flat = block_ids.reshape(-1)
    return {name: a[flat].reshape(B, NP * BLOCK, *a.shape[2:]) for name, a in layer.items()}


def store(pool: Sequence[Layer], keys: Sequence[Layer], block_ids: StepArray, src: StepArray) -> list[Layer]:
    """Copy tokens of `keys` (per-layer {name: [B, S, ...]}) into pool blocks: block_ids [B, NS] (an id >= the
    pool size is skipped), src [B, NS, BLOCK] = the key index of each token of each block."""
    return [store_layer(layer_pool, layer_keys, block_ids, src)
            for layer_pool, layer_keys in zip(pool, keys, strict=True)]


def store_layer(pool: Layer, keys: Layer, block_ids: StepArray, src: StepArray) -> Layer:
    """`store` for one layer's pool and keys."""
    B, NS, _ = src.shape
    flat_ids = block_ids.reshape(-1)
    new: Layer = {}
    for name, a in pool.items():
        k = keys[name]
        idx = src.reshape((B, NS * BLOCK) + (1,) * (k.ndim - 2))
        blocks = jnp.take_along_axis(k, idx, axis=1).reshape(B * NS, BLOCK, *a.shape[2:])
        new[name] = a.at[flat_ids].set(blocks.astype(a.dtype), mode="drop")
    return new


def concat_prior(prior: jax.Array, new: jax.Array) -> jax.Array:
    """Keys [B, P, ...] of earlier tokens followed by a call's own keys [B, T, ...]."""
    return jnp.concatenate([prior.astype(new.dtype), new], axis=1)


def concat_layer(prior: Layer, new: Layer) -> Layer:
    """One layer's keys of a packed call: its prior keys followed by the call's own."""
    return {name: concat_prior(prior[name], new[name]) for name in new}


def concat_keys(prior: Sequence[Layer] | None, new: list[Layer]) -> list[Layer]:
    """Per-layer keys of a packed call: prior keys (or None) followed by the call's own keys."""
    if prior is None:
        return new
    return [concat_layer(p, n) for p, n in zip(prior, new, strict=True)]
