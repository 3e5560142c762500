"""Attention on the device over a KV cache partly on the host (MoE-Lightning §4.2 with A_g = 1, r_c < 1: FlexGen's
S4 schedule, "FlexGen: High-Throughput Generative Inference of Large Language Models with a Single GPU",
arXiv 2303.06865): the layers past the r_c share keep their KV on the host; each pass copies such a layer's cache to
the device whole (its swap-in, started with the layer's W_PINTOG task, one layer ahead of its attention), attends
there, and sends only the new keys and values back to the host copy, which stays the cache of record.

The executor (moejax.lightning.cgopipe_steps) keeps CGOPipe's task list: a swapped layer's PREATTN attends on the
device, OFFLOADQKV carries its new KV to the host, CPUATTN only stores it there, and LOADH has nothing to bring back.
The copy moves the layer's whole pool (or per-row cache), not only the blocks the micro-batches read: simpler, and
what a pool sized to the batch holds anyway."""
from __future__ import annotations

import jax
from flax import nnx

from moejax.lightning.layer_parts import Cache
from moejax.models.attention import Positions, store_kv
from moejax.models.kv_pool import PagedCache


def swapped_attention(graphdef: nnx.GraphDef, state: nnx.State, x: jax.Array, at: Positions, cache: Cache, *,
                      backend: str) -> tuple[jax.Array, Cache, dict[str, jax.Array]]:
    """PREATTN of a swapped layer on the device, over the swapped-in copy: store this call's KV in the copy (a later
    micro-batch of the layer reads the same copy), attend -> (output, the copy, this call's KV for the host)."""
    layer = nnx.merge(graphdef, state)
    q, new = layer.attn.pre_attention(layer.attn_norm(x), at)
    cache = store_kv(cache, at.positions, new)
    return layer.attn.core.attend(q, cache, at.positions[:, 0], backend), cache, new


def swap_in(kv: dict[str, jax.Array], device: jax.Device) -> dict[str, jax.Array]:
    """A layer's host cache (pool or per-row) copied to the device, asynchronously."""
    return jax.device_put(kv, device)


def pool_of(cache: Cache) -> dict[str, jax.Array]:
    return cache.pool if isinstance(cache, PagedCache) else cache
