"""One layer's decode attention with its KV cache on the host (MoE-Lightning §4.1, Alg. 1 for one micro-batch):
PreAttn on the accelerator (QKV projections, norms, rope; MLA: the absorbed query), OffloadQKV (D1: the query and the
new KV copied to the host), CPUAttn (the new KV stored in the host cache, attention over it, jitted on the host
device with the XLA backend: Pallas does not run on a CPU), the output copied back (D2) and PostAttn's output
projection on the accelerator. Each stage is dispatched asynchronously; the schedule that overlaps them across
micro-batches and layers comes later."""
from __future__ import annotations

import functools

import jax
import numpy as np
from flax import nnx

from moejax.lightning.host_kv import check_step, host_device, store_step
from moejax.models.attention import AttentionCore, GQAttention, MLAttention, Positions

HOST_BACKENDS = ("xla", "reference")  # the attention kernels that run on a CPU (Pallas does not)


class HostAttention:
    """A layer's attention split between the accelerator, which holds its weights, and the host, which holds its KV
    cache (moejax.lightning.host_kv: {name: [B, L, ...]}, slot = position)."""

    def __init__(self, attn: GQAttention | MLAttention, host: jax.Device | None = None, backend: str = "xla"
                 ) -> None:
        """attn: the layer's attention block, its weights on one device (the accelerator); host: where its KV cache
        lives and its attention runs (default: the first CPU device); backend: the attention kernel there."""
        if backend not in HOST_BACKENDS:
            raise ValueError(f"HostAttention: backend {backend!r} does not run on the host; use one of {HOST_BACKENDS}")
        self.backend = backend
        self._graphdef, self._state = nnx.split(attn)
        self.device = _one_device(self._state)
        self.host = host or host_device()
        self.core: AttentionCore = jax.device_put(attn.core, self.host)  # GPT-OSS's sinks go with it

    def __call__(self, x: jax.Array, at: Positions, cache: dict[str, jax.Array], positions: jax.Array | np.ndarray
                 ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """x [B, T, D]: the attention's (normalised) input and `at` its Positions, both on the accelerator; cache: this
        layer's host cache (donated); positions [B, T]: at.positions, on the host (numpy, checked against the cache's
        length, or a host array) -> (out [B, T, D] on the accelerator, the host cache with this step's KV)."""
        q, new = _pre_attention(self._graphdef, self._state, x, at)
        check_step(cache, positions, new, where="host attention")
        q, new, positions = jax.device_put((q, new, positions), self.host)
        o, cache = attend_on_host(cache, q, new, positions, self.core, backend=self.backend)
        return _post_attention(self._graphdef, self._state, jax.device_put(o, self.device)), cache


def _one_device(state: nnx.State) -> jax.Device:
    devices = {d for leaf in jax.tree.leaves(state) for d in leaf.devices()}
    if len(devices) != 1:
        raise ValueError(f"HostAttention wants the layer's attention weights on one device (the accelerator); they "
                         f"are on {sorted(map(str, devices)) or 'none'}")
    return devices.pop()


@functools.partial(jax.jit, static_argnums=0)
def _pre_attention(graphdef: nnx.GraphDef, state: nnx.State, x: jax.Array, at: Positions
                   ) -> tuple[jax.Array, dict[str, jax.Array]]:
    return nnx.merge(graphdef, state).pre_attention(x, at)


@functools.partial(jax.jit, donate_argnums=0, static_argnames="backend")
def attend_on_host(cache: dict[str, jax.Array], q: jax.Array, new: dict[str, jax.Array], positions: jax.Array,
                   core: AttentionCore, *, backend: str) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The host stage, jitted where its arguments are (the host): new KV [B, T, ...] stored at slot = positions [B, T]
    (the cache is donated), then the core's attention over the cache -> (output, cache)."""
    cache = store_step(cache, positions, new)
    return core.attend(q, cache, positions[:, 0], backend=backend), cache


@functools.partial(jax.jit, static_argnums=0)
def _post_attention(graphdef: nnx.GraphDef, state: nnx.State, o: jax.Array) -> jax.Array:
    return nnx.merge(graphdef, state).post_attention(o)
