"""Cached experts over several devices (fMoE §5: the expert cache "supports multi-GPU inference with expert
parallelism ... The expert assignment follows a round-robin manner"): layout experts=ep (attn=dp) with placement
'cached'. Expert e of every MoE layer belongs to device e % D. Each device has its own cache of `cache_slots` slots
(the slot count is per device, as the memory budget is), kept by its own CachedExpertsRuntime (eviction, prefetch
queue with prefetch_depth copies in flight) and filled from that device's share of the experts in pinned
host memory: a miss is copied to the device that owns the expert. The predictor runs once, on the whole layer, and
each predicted expert's prefetch joins its owner's queue.

A MoE layer's step (one program over the mesh) all-gathers the tokens to every device; each device runs the
choices that fall on the experts it holds for this pass (its cached experts, stacked) and a reduce-scatter sums
the partial outputs back onto the tokens' devices (the layout's exchange=gather route, whatever its `exchange`).
In exact mode the logits equal the one-device resident model's."""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from moejax.buckets import bucket
from moejax.offload import layered_steps
from moejax.offload.cached import CachedExpertsRuntime
from moejax.offload.expert_cache import ExpertCache
from moejax.offload.host_store import HOST_LIMIT_ENV, HostStore, pinned_host_limit_bytes
from moejax.sharding.experts import AXIS

_f32 = jnp.float32


class RoundRobinStore:
    """Routed experts in pinned host memory, expert e of each layer in the memory of device e % D of the mesh: one
    per_expert HostStore per device, holding its experts in local order j = e // D, each as a [1, ...] array (the
    device's block of a [D, ...] array split over the mesh)."""

    per_expert = True

    def __init__(self, mesh: Mesh, limit_bytes: int | None = -1) -> None:
        if jax.process_count() > 1:  # each share is put in its device's host memory from this process
            raise ValueError("cached placement over several devices (experts=ep) runs in one process")
        self.mesh = mesh
        self.shares = [HostStore(device, per_expert=True, limit_bytes=None) for device in mesh.devices.flat]
        self.limit_bytes = pinned_host_limit_bytes() if limit_bytes == -1 else limit_bytes
        self._experts: dict[int, int] = {}  # layer -> its expert count

    def add(self, path: tuple, array: Any) -> None:
        """One routed expert array [E, ...] split round robin over the devices' shares."""
        total = self.total_bytes() + array.nbytes
        if self.limit_bytes is not None and total > self.limit_bytes:
            raise ValueError(f"RoundRobinStore: routed experts need more than {total / 2**30:.1f} GiB of pinned host "
                             f"memory, over XLA's pool of {self.limit_bytes / 2**30:.1f} GiB; set {HOST_LIMIT_ENV} "
                             "higher before starting (and have that much host RAM)")
        devices = len(self.shares)
        for d, share in enumerate(self.shares):
            share.add(path, array[d::devices][:, None])
        self._experts[path[1]] = array.shape[0]

    @property
    def layers(self) -> list[int]:
        return sorted(self._experts)

    def num_experts(self, layer: int) -> int:
        return self._experts[layer]

    def layer_bytes(self, layer: int) -> int:
        return sum(share.layer_bytes(layer) for share in self.shares)

    def expert_bytes(self, layer: int) -> int:
        return self.layer_bytes(layer) // self.num_experts(layer)

    def total_bytes(self) -> int:
        return sum(self.layer_bytes(layer) for layer in self._experts)


class _Caches:
    """The devices' caches seen as one, for the placement's counters and description."""

    def __init__(self, caches: Sequence[ExpertCache]) -> None:
        self.caches = list(caches)
        self.num_slots, self.policy = caches[0].num_slots, caches[0].policy

    def stats(self) -> dict:
        totals: dict[str, int] = {}
        for cache in self.caches:
            for key, value in cache.stats().items():
                totals[key] = totals.get(key, 0) + value
        return totals

    def reset_stats(self) -> None:
        for cache in self.caches:
            cache.reset_stats()


def partial_routed(graphdef: nnx.GraphDef, state: nnx.State, y: jax.Array, idx: jax.Array, weights: jax.Array,
                   local_of: jax.Array, experts: list[dict[str, jax.Array]], *, mesh: Mesh, backend: str
                   ) -> jax.Array:
    """Routed output [N, D] (rows split over the mesh) of the choices idx / weights: device d holds position j of
    `experts` as block d of each [D, ...] array and its row of local_of [D, E] maps an expert to that position (-1:
    not on d this pass); every device runs all tokens' choices on its experts and the partial sums are added."""
    mlp = nnx.merge(graphdef, state).mlp
    names = sorted(experts[0])
    flat = [position[name] for position in experts for name in names]
    x2 = y.reshape(-1, y.shape[-1])
    n = x2.shape[0]
    pad = -n % mesh.shape[AXIS]  # shard_map splits rows evenly: pad with tokens of weight 0
    if pad:
        x2, idx, weights = (jnp.pad(a, ((0, pad), (0, 0))) for a in (x2, idx, weights))

    def body(x: jax.Array, i: jax.Array, w: jax.Array, table: jax.Array, *ws: jax.Array) -> jax.Array:
        stacked = {name: jnp.concatenate(ws[k::len(names)]) for k, name in enumerate(names)}  # [m, ...] each
        x_all, i_all, w_all = (jax.lax.all_gather(a, AXIS, tiled=True) for a in (x, i, w))
        local = table[0][i_all]
        mine = local >= 0
        part = mlp.routed(x_all, jnp.where(mine, local, 0), jnp.where(mine, w_all, 0.0), stacked, backend)
        return jax.lax.psum_scatter(part.astype(_f32), AXIS, scatter_dimension=0, tiled=True).astype(x.dtype)

    run = jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS),) * (4 + len(flat)), out_specs=P(AXIS), check_vma=False)
    out = run(x2, idx, weights, local_of, *flat)
    return out[:n] if pad else out


class CachedExpertsOverEPRuntime(CachedExpertsRuntime):
    """moejax.offload.cached.CachedExpertsRuntime with its cache split round robin over the devices of a
    RoundRobinStore's mesh; the same arguments (cache_slots: per device)."""

    name = "ep+cached"

    def __init__(self, store: RoundRobinStore, cache_slots: int, eviction: str, backend: str, **options: Any) -> None:
        if options.get("prefill", "cache") != "cache":
            raise ValueError("cached placement over several devices (experts=ep): prefill='stream' is not "
                             "supported; use prefill='cache'")
        self.shards: list[CachedExpertsRuntime] = []
        super().__init__(store, cache_slots, eviction, backend, **options)  # type: ignore[arg-type]
        self.mesh = store.mesh
        # each device's bookkeeping: its cache, slots and prefetch queue, counted in this placement's stats
        self.shards = [CachedExpertsRuntime(share, cache_slots, eviction, backend, prefetch_depth=self.prefetch_depth)
                       for share in store.shares]
        for shard in self.shards:
            shard.stats = self.stats  # the shards count into it too
        self.cache = _Caches([shard.cache for shard in self.shards])  # type: ignore[assignment]
        self._step: Callable[..., jax.Array] = functools.partial(partial_routed, mesh=self.mesh)
        self._spread = NamedSharding(self.mesh, P(AXIS))
        self._blanks: dict[tuple, jax.Array] = {}

    def reset_stats(self) -> None:
        super().reset_stats()  # new counters, every device's cache reset
        for shard in self.shards:
            shard.stats = self.stats

    @property
    def devices(self) -> int:
        return len(self.shards)

    def resident(self) -> dict[int, list[tuple[int, int, dict[str, jax.Array]]]]:
        """Device index -> the (layer, expert, arrays) its cache holds, experts numbered as the model does."""
        d_count = self.devices
        return {d: [(layer, j * d_count + d, arrays) for (layer, j), slot in shard.cache.resident().items()
                    if (arrays := shard._slots[slot]) is not None]
                for d, shard in enumerate(self.shards)}

    # -- the hooks of Cached --------------------------------------------------------------------------------------
    def _routed_out(self, handle: layered_steps.Layer, y: jax.Array, run_idx: jax.Array, run_weights: jax.Array
                    ) -> jax.Array:
        """Each device requests the needed experts it owns, in passes of pass_experts; a pass's misses start on
        every device before any is waited for."""
        layer, d_count = handle.index, self.devices
        needed = np.unique(np.asarray(run_idx))
        owned = [needed[needed % d_count == d] // d_count for d in range(d_count)]  # local ids on each device
        passes = max(-(-len(local) // self.pass_experts) for local in owned)
        out = None
        for p in range(passes):
            chunks = [local[p * self.pass_experts: (p + 1) * self.pass_experts] for local in owned]
            pending = [arrays for shard, chunk in zip(self.shards, chunks, strict=True) if len(chunk)
                       for arrays in shard._start_request(layer, chunk)]
            self._wait(layer, pending)
            held = [[shard._held((layer, int(j))) for j in chunk]
                    for shard, chunk in zip(self.shards, chunks, strict=True)]
            local_of = np.full((d_count, self.store.num_experts(layer)), -1, np.int32)
            for d, chunk in enumerate(chunks):
                local_of[d, chunk * d_count + d] = np.arange(len(chunk), dtype=np.int32)
            experts = self._spread_positions(held)
            part = handle(self._step, y, run_idx, run_weights, jax.device_put(local_of, self._spread), experts,
                          backend=self.backend)
            out = part if out is None else out + part
        assert out is not None  # every token has choices
        return out

    def _spread_positions(self, held: list[list[dict[str, jax.Array]]]) -> list[dict[str, jax.Array]]:
        """Per device, its experts of this pass ([1, ...] arrays on it) -> m positions (a power of two, fewer shapes
        to compile), each a [D, ...] array split over the mesh; a device with fewer repeats its last, one with
        none holds zeros (no choice reaches them)."""
        sample = next(experts[0] for experts in held if experts)
        m = bucket(max(len(experts) for experts in held))
        positions: list[dict[str, jax.Array]] = []
        for j in range(m):
            arrays: dict[str, jax.Array] = {}
            for name, first in sample.items():
                blocks = [experts[min(j, len(experts) - 1)][name] if experts else self._blank(d, first)
                          for d, experts in enumerate(held)]
                arrays[name] = jax.make_array_from_single_device_arrays(
                    (len(held), *first.shape[1:]), self._spread, blocks)
            positions.append(arrays)
        return positions

    def _blank(self, d: int, like: jax.Array) -> jax.Array:
        key = (d, like.shape, like.dtype)
        if key not in self._blanks:
            self._blanks[key] = jnp.zeros(like.shape, like.dtype, device=self.mesh.devices.flat[d])
        return self._blanks[key]

    def _issue(self, queue: list[tuple[float, int, int]], scores: dict[Sequence[int], float] | None = None
               ) -> None:
        """Prefetches to the queues of the experts' owners, in local numbering."""
        d_count = self.devices
        if scores is None:
            scores = {(layer, expert): priority for priority, layer, expert in queue}
        for d, shard in enumerate(self.shards):
            mine = [(priority, layer, expert // d_count) for priority, layer, expert in queue if expert % d_count == d]
            if mine:
                shard._issue(mine, {(key[0], key[1] // d_count): share for key, share in scores.items()
                                    if key[1] % d_count == d})

    def _start_queued(self) -> None:
        for shard in self.shards:
            shard._start_queued()

    def describe(self) -> str:
        return (super().describe().replace("cached: ", "ep+cached: ", 1).replace(
            "expert slots", f"expert slots on each of {self.devices} devices (expert e on device e % {self.devices})",
            1))
