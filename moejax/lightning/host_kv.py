"""A KV cache held on the host for a batch of sequences (MoE-Lightning §4, App. A.1: the prefill runs on the
accelerator and its KV is offloaded to the CPU, where decode attention reads it).

The cache is the model's own layout, per layer {name: [B, L, ...]} with slot = position (GQA: k, v; MLA: latent,
k_rope), its arrays committed to the host device, `jax.devices("cpu")[0]`: host memory when the accelerator is a GPU.
Nothing of it is kept on the accelerator (MoE-Lightning's r_c, the share of the KV cache kept on the GPU, is 0 here).
"""
from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from moejax.models.attention import write_cache
from moejax.models.decoder import MoEModel

HostKV = list[dict[str, jax.Array]]  # per layer, {name: [B, L, ...]} on the host device


def host_device() -> jax.Device:
    """The device whose memory is the host's: the first CPU device of this process, or, where the accelerator is a
    CPU too (tests simulating several devices), the last one (the first holds the weights)."""
    cpus = jax.devices("cpu")
    return cpus[-1] if jax.default_backend() == "cpu" else cpus[0]


def allocate(model: MoEModel, batch: int, max_len: int, host: jax.Device | None = None) -> HostKV:
    """A zeroed host cache for `batch` sequences of up to `max_len` tokens, shaped as model.init_cache (the model may
    be abstract: only its shapes are read)."""
    if batch < 1 or max_len < 1:
        raise ValueError(f"host KV cache: batch and max_len must be >= 1, got batch={batch}, max_len={max_len}")
    host = host or host_device()
    shapes = jax.eval_shape(lambda: model.init_cache(batch, max_len))
    return [{name: jnp.zeros(a.shape, a.dtype, device=host) for name, a in layer.items()} for layer in shapes]


def cache_bytes(cache: HostKV) -> int:
    """Bytes the host cache holds (every layer, every slot)."""
    return sum(a.nbytes for layer in cache for a in layer.values())


def write_prefill(cache: HostKV, device_cache: Sequence[Mapping[str, jax.Array]]) -> HostKV:
    """The cache with a prefill's KV (per layer {name: [B, T, ...]}, slot = position, wherever it was computed)
    copied to the host into slots [0, T) of every row. The old cache's arrays are donated. Slots past a row's prompt
    hold its padding's KV until decode steps overwrite them: a query never sees a key past its own position."""
    _check_prefill(cache, device_cache)
    host = _device_of(cache)
    copied = jax.device_put([{name: layer[name] for name in layer} for layer in device_cache], host)
    return _write_front(cache, copied)


def append(cache: dict[str, jax.Array], positions: jax.Array | np.ndarray, new: Mapping[str, jax.Array]
           ) -> dict[str, jax.Array]:
    """One layer's host cache with one step's new KV {name: [B, T, ...]} stored at slot = positions [B, T] (copied to
    the host first). The old arrays are donated."""
    check_step(cache, positions, new, where="append")
    host = _device_of([cache])
    return _store(cache, jax.device_put(positions, host), jax.device_put(dict(new), host))


def check_step(cache: Mapping[str, jax.Array], positions: jax.Array | np.ndarray, new: Mapping[str, jax.Array], *,
               where: str) -> None:
    """ValueError unless `new` has the cache's names with shapes [B, T, ...] matching it and `positions` [B, T]; when
    positions are on the host (numpy), also unless they lie in [0, max_len) (a slot past it would be dropped)."""
    if set(new) != set(cache):
        raise ValueError(f"{where}: new KV names {sorted(new)} are not the cache's {sorted(cache)}")
    B, L = next(iter(cache.values())).shape[:2]
    if len(np.shape(positions)) != 2 or np.shape(positions)[0] != B:
        raise ValueError(f"{where}: positions must be [B={B}, T], got shape {tuple(np.shape(positions))}")
    T = np.shape(positions)[1]
    for name, a in cache.items():
        want = (B, T) + tuple(a.shape[2:])
        if tuple(new[name].shape) != want:
            raise ValueError(f"{where}: new KV {name!r} has shape {tuple(new[name].shape)}, the cache wants {want}")
    if isinstance(positions, np.ndarray) and positions.size and not 0 <= positions.min() <= positions.max() < L:
        raise ValueError(f"{where}: positions {positions.min()}..{positions.max()} outside the cache's [0, {L})")


def _check_prefill(cache: HostKV, device_cache: Sequence[Mapping[str, jax.Array]]) -> None:
    if len(device_cache) != len(cache):
        raise ValueError(f"write_prefill: the prefill has {len(device_cache)} layers, the host cache {len(cache)}")
    for i, (host_layer, layer) in enumerate(zip(cache, device_cache, strict=True)):
        if set(layer) != set(host_layer):
            raise ValueError(f"write_prefill: layer {i} has KV {sorted(layer)}, the host cache {sorted(host_layer)}")
        for name, a in layer.items():
            h = host_layer[name]
            if a.ndim != h.ndim or a.shape[0] != h.shape[0] or a.shape[2:] != h.shape[2:] or a.shape[1] > h.shape[1]:
                raise ValueError(f"write_prefill: layer {i} {name!r} has shape {tuple(a.shape)}; the host cache "
                                 f"holds {tuple(h.shape)} (batch, up to {h.shape[1]} slots, then the same dims)")


def _device_of(cache: HostKV) -> jax.Device:
    devices = {d for layer in cache for a in layer.values() for d in a.devices()}
    if len(devices) != 1:
        raise ValueError(f"a host KV cache lives on one device; these arrays are on {sorted(map(str, devices))}")
    return devices.pop()


def store_step(cache: Mapping[str, jax.Array], positions: jax.Array, new: Mapping[str, jax.Array]
               ) -> dict[str, jax.Array]:
    """The pure write (traceable, any device): new [B, T, ...] at slot = positions [B, T], per name."""
    return {name: write_cache(a, positions, new[name]) for name, a in cache.items()}


_store = functools.partial(jax.jit, donate_argnums=0)(store_step)


@functools.partial(jax.jit, donate_argnums=0)
def _write_front(cache: HostKV, prefill: HostKV) -> HostKV:
    return [{name: jax.lax.dynamic_update_slice_in_dim(c, p[name].astype(c.dtype), 0, axis=1)
             for name, c in layer.items()} for layer, p in zip(cache, prefill, strict=True)]
