"""Streamed placement (MoE-Prefill §6.3, one-GPU mode): every MoE layer's routed experts are copied from the
host store as whole per-layer arrays; while layer l computes, layers l+1..l+W are already on their way (async
`device_put`), so at most W+1 layers of experts are on the device. The window wraps around: after the last
layer the first W of the next pass are fetched, so consecutive passes (decode steps, batches) stream too."""
from __future__ import annotations

import time

import jax

from moejax.offload import layered_steps
from moejax.offload.host_store import HostStore
from moejax.offload.stats import OffloadStats


class StreamedExpertsRuntime(layered_steps.LayerRuntime):
    name = "streamed"

    def __init__(self, store: HostStore, window: int, backend: str) -> None:
        if window < 1:
            raise ValueError(f"streamed placement: window must be >= 1, got {window}")
        self.store, self.window, self.backend = store, int(window), backend
        self.stats: OffloadStats = OffloadStats()
        self._order = store.layers
        self._ahead: dict[int, dict[str, jax.Array]] = {}  # layer -> its experts, on the device or on their way

    def begin_pass(self, steps: layered_steps.LayeredSteps) -> None:
        for layer in self._order[: self.window]:
            self._prefetch(layer)

    def moe(self, handle: layered_steps.Layer, x: jax.Array, y: jax.Array, idx: jax.Array | None,
            weights: jax.Array | None) -> jax.Array:
        assert idx is not None and weights is not None  # its layers always run the router
        layer = handle.index
        experts = self._ahead.pop(layer, None)
        s = self.stats[layer]
        if experts is None:
            experts = self._fetch(layer)
            s.misses += 1
        else:
            s.hits += 1
        p = self._order.index(layer)
        for j in range(1, self.window + 1):
            self._prefetch(self._order[(p + j) % len(self._order)], current=layer)
        start = time.perf_counter()
        jax.block_until_ready(experts)  # the only wait: the copies of later layers keep running
        s.wait_s += time.perf_counter() - start
        return layered_steps.run_moe(handle, x, y, idx, weights, experts, self.backend)

    # Θ's profile (moejax.measure.saturation) times each layer's compute with its experts already in place:
    def ready_experts(self, layer: int) -> dict[str, jax.Array]:
        """A layer's experts where `moe_ready` wants them (on the device), waited for."""
        return jax.block_until_ready(self.store.fetch(layer))

    def moe_ready(self, handle: layered_steps.Layer, x: jax.Array, y: jax.Array, idx: jax.Array, weights: jax.Array,
                  experts: dict[str, jax.Array]) -> jax.Array:
        return layered_steps.run_moe(handle, x, y, idx, weights, experts, self.backend)

    def _prefetch(self, layer: int, current: int | None = None) -> None:
        if layer != current and layer not in self._ahead:
            self._ahead[layer] = self._fetch(layer)
            self.stats[layer].prefetches += 1

    def _fetch(self, layer: int) -> dict[str, jax.Array]:
        self.stats[layer].bytes_h2d += self.store.layer_bytes(layer)
        return self.store.fetch(layer)

    def describe(self) -> str:
        return f"streamed: window {self.window} MoE layers ahead ({self.window + 1} on the device at most)"
