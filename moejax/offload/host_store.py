"""Routed expert weights of every MoE layer in host memory (JAX memory kind `pinned_host`), whole per-layer
arrays, so a layer's experts move to the device with one async `device_put` per array.

Arrays in `pinned_host` are only moved, never indexed or computed on inside jit (unsupported or slow there).
On GPUs XLA caps pinned host allocations at XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB (64 GB by default); the cap is
read when the GPU client starts, so it must be set in the environment before JAX first touches the GPU.
On CPU the same memory kinds exist and the same code runs (there is no cap).

For a model larger than the pinned memory a host allows (MoE-Lightning, arXiv 2411.11217, §4.1): with
`staging_bytes` the experts stay in ordinary (pageable) host memory, numpy arrays, and each fetch goes CPU ->
pinned -> device through a bounded pinned staging buffer: before a copy is staged, the oldest staged copies are
waited for and their pinned buffers freed until the new one fits, so pinned memory never holds more than
`staging_bytes` of experts (`peak_staged_bytes` records the most it held).
"""
from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from moejax.models.moe import is_routed_expert

HOST_LIMIT_ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
DEFAULT_GPU_HOST_LIMIT_GB = 64
# a whole layer's array, or (per_expert) one array per expert; numpy (pageable host memory) with staging_bytes
Stored = jax.Array | np.ndarray | list[jax.Array] | list[np.ndarray]


def pinned_host_limit_bytes(platform: str | None = None) -> int | None:
    """The pinned host pool XLA allows on this platform (None: no cap, as on CPU)."""
    if (platform or jax.default_backend()) != "gpu":
        return None
    return int(float(os.environ.get(HOST_LIMIT_ENV, DEFAULT_GPU_HOST_LIMIT_GB)) * 2**30)


class HostStore:
    """layer -> {name: array in pinned_host}, or with `per_expert` layer -> {name: [one array per expert]} (for
    an expert cache, which moves single experts). Build with `from_arrays`; `fetch` / `fetch_expert` start the
    copies to the device."""

    def __init__(self, device: jax.Device | None = None, *, per_expert: bool = False, limit_bytes: int | None = -1,
                 sharding: NamedSharding | None = None, staging_bytes: int | None = None) -> None:
        """An empty store; `add` fills it. limit_bytes: refuse beyond this many bytes (default: the platform's
        pinned host pool; None: no cap). sharding: whole layers split over several devices' host memory
        (AsyncEP with offloading) instead of one device's. staging_bytes: keep the experts in pageable host memory
        and stage each copy through at most this many bytes of pinned memory (limit_bytes then bounds it)."""
        self.device = device or jax.devices()[0]
        self.sharding = sharding
        self.per_expert = per_expert
        self.limit_bytes = pinned_host_limit_bytes() if limit_bytes == -1 else limit_bytes
        if staging_bytes is not None and (staging_bytes < 1 or sharding is not None):
            raise ValueError(f"HostStore: staging_bytes must be >= 1 on one device, got {staging_bytes}")
        if staging_bytes is not None and self.limit_bytes is not None and staging_bytes > self.limit_bytes:
            raise ValueError(f"HostStore: a pinned staging buffer of {staging_bytes / 2**30:.1f} GiB is over XLA's "
                             f"pinned pool of {self.limit_bytes / 2**30:.1f} GiB ({HOST_LIMIT_ENV})")
        self.staging_bytes = staging_bytes
        # staged copies, oldest first: (bytes, their pinned arrays, the device arrays copied from them)
        self._staged: deque[tuple[int, list[jax.Array], list[jax.Array]]] = deque()
        self.staged_bytes = self.peak_staged_bytes = 0
        self._layers: dict[int, dict[str, Stored]] = {}
        self._total = 0

    @classmethod
    def from_arrays(cls, items: Iterable[tuple[tuple, Any]], device: jax.Device | None = None,
                    limit_bytes: int | None = -1, per_expert: bool = False) -> HostStore:
        """(flat path, array) pairs of routed expert arrays -> store (see `add`)."""
        store = cls(device, per_expert=per_expert, limit_bytes=limit_bytes)
        for path, array in items:
            store.add(path, array)
        return store

    def add(self, path: tuple, array: Any) -> Stored:
        """One routed expert array (numpy as read from a checkpoint, or jax) straight to pinned host memory
        (split along the expert axis for a per_expert store); raises ValueError, with the numbers, when the
        total exceeds the limit. Returns what it stored (an array, or a list of them)."""
        if not is_routed_expert(path):
            raise ValueError(f"HostStore: {path} is not a routed expert array")
        self._total += array.nbytes
        if self.staging_bytes is not None:
            return self._add_pageable(path, array)
        if self.limit_bytes is not None and self._total > self.limit_bytes:
            raise ValueError(f"HostStore: routed experts need more than {self._total / 2**30:.1f} GiB of pinned "
                             f"host memory, over XLA's pool of {self.limit_bytes / 2**30:.1f} GiB; set "
                             f"{HOST_LIMIT_ENV} higher before starting (and have that much host RAM)")
        host = self._sharding("pinned_host")
        placed: Stored
        if self.per_expert:
            placed = [jax.device_put(array[e], host) for e in range(array.shape[0])]
        else:
            placed = jax.device_put(array, host)
        self._layers.setdefault(path[1], {})[path[3]] = placed
        return placed

    def _add_pageable(self, path: tuple, array: Any) -> Stored:
        """staging_bytes: the array in pageable host memory; each unit fetched at once must fit the buffer."""
        host = np.asarray(array)
        placed: Stored = [np.ascontiguousarray(host[e]) for e in range(host.shape[0])] if self.per_expert else host
        self._layers.setdefault(path[1], {})[path[3]] = placed
        assert self.staging_bytes is not None
        unit = self.expert_bytes(path[1]) if self.per_expert else self.layer_bytes(path[1])
        if unit > self.staging_bytes:
            raise ValueError(f"HostStore: one {'expert' if self.per_expert else 'layer'} of layer {path[1]} needs "
                             f"{unit / 2**20:.1f} MiB of pinned staging, over the {self.staging_bytes / 2**20:.1f} "
                             "MiB buffer")
        return placed

    def _staged_copy(self, arrays: dict[str, Any]) -> dict[str, jax.Array]:
        """Pageable arrays -> device copies through pinned staging; the oldest staged copies are waited for and
        freed first until these fit the buffer."""
        assert self.staging_bytes is not None
        need = sum(int(a.nbytes) for a in arrays.values())
        while self._staged and self.staged_bytes + need > self.staging_bytes:
            nbytes, held, copies = self._staged.popleft()
            jax.block_until_ready(copies)  # the device copies read the pinned buffers: done before they go
            for a in held:
                a.delete()
            self.staged_bytes -= nbytes
        pinned_kind, device = self._sharding("pinned_host"), self._sharding("device")
        pinned = {name: jax.device_put(a, pinned_kind) for name, a in arrays.items()}
        out = {name: jax.device_put(a, device) for name, a in pinned.items()}
        self._staged.append((need, list(pinned.values()), list(out.values())))
        self.staged_bytes += need
        self.peak_staged_bytes = max(self.peak_staged_bytes, self.staged_bytes)
        return out

    @property
    def layers(self) -> list[int]:
        return sorted(self._layers)

    def arrays(self, layer: int) -> dict[str, Stored]:
        return dict(self._layers[layer])

    def num_experts(self, layer: int) -> int:
        first = next(iter(self._layers[layer].values()))
        return len(first) if isinstance(first, list) else first.shape[0]  # a list: per_expert

    def layer_bytes(self, layer: int) -> int:
        return sum(sum(a.nbytes for a in v) if isinstance(v, list) else v.nbytes  # a list: per_expert
                   for v in self._layers[layer].values())

    def expert_bytes(self, layer: int) -> int:
        return self.layer_bytes(layer) // self.num_experts(layer)

    def total_bytes(self) -> int:
        return sum(self.layer_bytes(layer) for layer in self._layers)

    def fetch(self, layer: int) -> dict[str, jax.Array]:
        """Start copying one layer's experts to device memory; returns at once (the copies are async and
        whatever reads the arrays waits for them)."""
        if self.per_expert:
            raise ValueError("HostStore.fetch: this store holds single experts (per_expert); use fetch_expert")
        if self.staging_bytes is not None:
            return self._staged_copy(self._layers[layer])
        device = self._sharding("device")
        return {name: jax.device_put(a, device) for name, a in self._layers[layer].items()}

    def fetch_expert(self, layer: int, expert: int) -> dict[str, jax.Array]:
        """Start copying one expert of one layer to device memory (a per_expert store); returns at once."""
        if not self.per_expert:
            raise ValueError("HostStore.fetch_expert: this store holds whole layers; build it with per_expert=True")
        if self.staging_bytes is not None:
            return self._staged_copy({name: a[expert] for name, a in self._layers[layer].items()})
        device = self._sharding("device")
        return {name: jax.device_put(a[expert], device) for name, a in self._layers[layer].items()}

    def _sharding(self, kind: str) -> jax.sharding.Sharding:
        if self.sharding is not None:
            return self.sharding.with_memory_kind(kind)
        return jax.sharding.SingleDeviceSharding(self.device, memory_kind=kind)
