"""Routed expert weights of every MoE layer in host memory (JAX memory kind `pinned_host`), whole per-layer
arrays, so a layer's experts move to the device with one async `device_put` per array.

Arrays in `pinned_host` are only moved, never indexed or computed on inside jit (unsupported or slow there).
On GPUs XLA caps pinned host allocations at XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB (64 GB by default); the cap is
read when the GPU client starts, so it must be set in the environment before JAX first touches the GPU.
On CPU the same memory kinds exist and the same code runs (there is no cap).
"""
from __future__ import annotations

import os
from typing import Iterable

import jax

HOST_LIMIT_ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
DEFAULT_GPU_HOST_LIMIT_GB = 64
EXPERT_LEAVES = ("we_gate_up", "we_down", "be_gate_up", "be_down")


def is_routed_expert(path: tuple) -> bool:
    """Flat nnx parameter path -> whether it is a routed expert array (('layers', i, 'mlp', 'we_down'))."""
    return len(path) == 4 and path[0] == "layers" and path[2] == "mlp" and path[3] in EXPERT_LEAVES


def pinned_host_limit_bytes(platform: str | None = None) -> int | None:
    """The pinned host pool XLA allows on this platform (None: no cap, as on CPU)."""
    if (platform or jax.default_backend()) != "gpu":
        return None
    return int(float(os.environ.get(HOST_LIMIT_ENV, DEFAULT_GPU_HOST_LIMIT_GB)) * 2**30)


def _sharding(kind: str, device=None):
    return jax.sharding.SingleDeviceSharding(device or jax.devices()[0], memory_kind=kind)


class HostStore:
    """layer -> {name: array in pinned_host}. Build with `from_arrays`; `fetch(layer)` starts the copies."""

    def __init__(self, layers: dict[int, dict[str, jax.Array]], device=None):
        self.device = device or jax.devices()[0]
        self._layers = layers

    @classmethod
    def from_arrays(cls, items: Iterable[tuple[tuple, object]], device=None, limit_bytes: int | None = -1
                    ) -> "HostStore":
        """(flat path, array) pairs of routed expert arrays (numpy as read from a checkpoint, or jax) ->
        store. Each array goes straight to pinned host memory; raises ValueError, with the numbers, when
        the total exceeds `limit_bytes` (default: the platform's pinned host pool; None: no cap)."""
        host = _sharding("pinned_host", device)
        layers: dict[int, dict[str, jax.Array]] = {}
        limit, total = (pinned_host_limit_bytes() if limit_bytes == -1 else limit_bytes), 0
        for path, array in items:
            if not is_routed_expert(path):
                raise ValueError(f"HostStore: {path} is not a routed expert array")
            total += array.nbytes
            if limit is not None and total > limit:
                raise ValueError(f"HostStore: routed experts need more than {total / 2**30:.1f} GiB of pinned host "
                                 f"memory, over XLA's pool of {limit / 2**30:.1f} GiB; set {HOST_LIMIT_ENV} higher "
                                 f"before starting (and have that much host RAM)")
            layers.setdefault(path[1], {})[path[3]] = jax.device_put(array, host)
        return cls(layers, device)

    @property
    def layers(self) -> list[int]:
        return sorted(self._layers)

    def arrays(self, layer: int) -> dict[str, jax.Array]:
        return dict(self._layers[layer])

    def layer_bytes(self, layer: int) -> int:
        return sum(a.nbytes for a in self._layers[layer].values())

    def total_bytes(self) -> int:
        return sum(self.layer_bytes(layer) for layer in self._layers)

    def fetch(self, layer: int) -> dict[str, jax.Array]:
        """Start copying one layer's experts to device memory; returns at once (the copies are async and
        whatever reads the arrays waits for them)."""
        device = _sharding("device", self.device)
        return {name: jax.device_put(a, device) for name, a in self._layers[layer].items()}
