"""AsyncEP with offloading (MoE-Prefill §6.3): the two-channel pipeline. Every MoE layer's experts live in pinned
host memory split by expert index over the devices (each device's shard in its host's memory). While layer l
computes, (1) its program also all-gathers layer l+1's full expert set from the shards already on the devices
(device to device), and (2) the shards of layers l+2..l+1+W are on their way from the host (async `device_put`).
Each device then holds layer l's and l+1's experts whole and W layers of shards; routing stays local.

The gather of layer l+1 is inside layer l's jit and reads only its input shards, so XLA may run it alongside
layer l's compute (separate jits on one device would run one after the other)."""
from __future__ import annotations

import functools
import time
from collections.abc import Callable, Container

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from moejax.config import ModelConfig
from moejax.layout import Layout
from moejax.models.moe import local_expert_ffn
from moejax.offload import layered_steps
from moejax.offload.host_store import HostStore
from moejax.offload.stats import OffloadStats
from moejax.sharding.experts import sharded_routed

_LOCAL = Layout(attn="dp", experts="replicated")  # each device its own tokens against whole experts


def moe_and_gather(graphdef: nnx.GraphDef, state: nnx.State, x: jax.Array, y: jax.Array, idx: jax.Array,
                   weights: jax.Array, experts: dict[str, jax.Array], next_shards: dict[str, jax.Array] | None, *,
                   run: Callable[..., jax.Array], whole: NamedSharding
                   ) -> tuple[jax.Array, dict[str, jax.Array] | None]:
    """Layer l's routed experts (whole on every device) + shared expert + residual, and layer l+1's experts
    gathered whole from their shards (None: nothing to gather)."""
    out = layered_steps.finish(graphdef, state, x, y, run(y.reshape(-1, y.shape[-1]), idx, weights, experts))
    gathered = None if next_shards is None else jax.lax.with_sharding_constraint(next_shards, whole)
    return out, gathered


class GatheredStreamed(layered_steps.LayerRuntime):
    """Placement for `layout="attn=dp,experts=async_ep", placement="streamed", window=W`."""
    name = "async_ep+streamed"

    def __init__(self, store: HostStore, window: int, mesh: Mesh, cfg: ModelConfig, backend: str) -> None:
        if window < 1:
            raise ValueError(f"async_ep streamed placement: window must be >= 1, got {window}")
        self.store, self.window = store, int(window)
        whole = NamedSharding(mesh, P())
        run = functools.partial(sharded_routed, _LOCAL, mesh, local_expert_ffn(cfg, backend))
        self._step = functools.partial(moe_and_gather, run=run, whole=whole)
        self._gather = jax.jit(lambda shards: jax.lax.with_sharding_constraint(shards, whole))
        self.stats: OffloadStats = OffloadStats()
        self._order = store.layers
        self._shards: dict[int, dict] = {}  # layer -> its shards on the devices (or on their way)
        self._whole: dict[int, dict] = {}  # layer -> its experts whole on every device

    def begin_pass(self, steps: layered_steps.LayeredSteps) -> None:
        first = self._order[0]
        if first not in self._whole:  # nothing computes before the first MoE layer: its gather waits
            self._whole[first] = self._gather(self._take(first))
            self.stats[first].misses += 1
        for layer in self._order[1:self.window + 2]:
            self._prefetch(layer)

    def moe(self, handle: layered_steps.Layer, x: jax.Array, y: jax.Array, idx: jax.Array | None,
            weights: jax.Array | None) -> jax.Array:
        assert idx is not None and weights is not None  # its layers always run the router
        layer = handle.index
        p = self._order.index(layer)
        experts = self._whole.pop(layer, None)
        if experts is None:  # (a pass that began elsewhere, e.g. after an error)
            experts = self._gather(self._take(layer))
            self.stats[layer].misses += 1
        else:
            self.stats[layer].hits += 1
        nxt = self._order[(p + 1) % len(self._order)]
        shards = self._take(nxt) if nxt != layer else None
        for j in range(2, self.window + 2):  # channel 2: host -> device shards of later layers
            self._prefetch(self._order[(p + j) % len(self._order)], skip=(layer, nxt))
        start = time.perf_counter()
        jax.block_until_ready(experts)
        self.stats[layer].wait_s += time.perf_counter() - start
        out, gathered = handle(self._step, x, y, idx, weights, experts, shards)
        if gathered is not None:
            self._whole[nxt] = gathered
        return out

    # Θ's profile (moejax.measure.saturation) times each layer's compute with its experts already in place:
    def ready_experts(self, layer: int) -> dict[str, jax.Array]:
        """A layer's experts whole on every device, waited for."""
        return jax.block_until_ready(self._gather(self.store.fetch(layer)))

    def moe_ready(self, handle: layered_steps.Layer, x: jax.Array, y: jax.Array, idx: jax.Array, weights: jax.Array,
                  experts: dict[str, jax.Array]) -> jax.Array:
        return handle(self._step, x, y, idx, weights, experts, None)[0]

    def _take(self, layer: int) -> dict:
        shards = self._shards.pop(layer, None)
        return shards if shards is not None else self._fetch(layer)

    def _prefetch(self, layer: int, skip: Container[int] = ()) -> None:
        if layer not in skip and layer not in self._shards and layer not in self._whole:
            self._shards[layer] = self._fetch(layer)
            self.stats[layer].prefetches += 1

    def _fetch(self, layer: int) -> dict:
        self.stats[layer].bytes_h2d += self.store.layer_bytes(layer)
        return self.store.fetch(layer)

    def describe(self) -> str:
        return (f"async_ep+streamed: experts split by index in pinned host memory; each MoE layer's program gathers "
                f"the next layer whole from its device shards while the shards of the {self.window} layer(s) after "
                "it come from the host")
