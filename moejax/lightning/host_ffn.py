"""The MoE FFN on the host (MoE-Lightning §4.2, F_g = 0): each MoE layer's routed experts past the resident share
r_w live in host memory on the host device (JAX's CPU backend) and the host runs them. The router stays on the
device; per micro-batch its normed input and choices go to the host (D1), the host's experts run there, and their
output comes back (D2) to be added to the resident share's, the shared expert's and the residual on the device.
No weight crosses the link: what F_g = 0 trades for the host's slower FFN.

The resident experts run as one part read through moejax.lightning.pages.paged_routed (the choices outside it at
weight 0); the host's part the same way with its own first expert id, so the router's ids need no renumbering."""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.config import ModelConfig
from moejax.lightning.host_kv import host_device
from moejax.lightning.pages import Experts, ResidentShare, next_moe_layer, paged_routed, resident_experts
from moejax.models.moe import local_expert_ffn
from moejax.offload import layered_steps
from moejax.offload.stats import OffloadStats

HOST_EXPERT_BACKEND = "xla"  # the expert FFN's CPU path (Pallas does not run on a CPU)


class HostExpertStore(ResidentShare):
    """What `moejax.load` fills for F_g = 0: per MoE layer, the first round(r_w E) experts on the device and the
    others ({name: array}) in host memory on the host device."""

    pages = 0  # nothing is paged: the pipeline's W_PINTOG tasks have nothing to move

    def __init__(self, share: float, device: jax.Device | None = None, host: jax.Device | None = None) -> None:
        super().__init__(share, device)
        self.host = host or host_device()
        self.on_host: dict[int, Experts] = {}

    def add(self, path: tuple, array: Any) -> None:
        layer, name, E, keep = self.add_resident(path, array)
        if keep < E:
            self.on_host.setdefault(layer, {})[name] = jax.device_put(array[keep:], self.host)

    def host_bytes(self) -> int:
        return sum(a.nbytes for layer in self.on_host.values() for a in layer.values())


class HostFFN(layered_steps.LayerRuntime):
    """The pipeline's weight runtime under F_g = 0: `run_moe` runs the resident share on the device and the rest on
    the host, each dispatched asynchronously, so one micro-batch's host FFN overlaps the device's next tasks. It
    keeps PagedExperts' calls (fetch_page, experts, release) so the executor walks the same task list; none moves
    a weight."""

    name = "lightning"

    def __init__(self, store: HostExpertStore, config: ModelConfig, backend: str) -> None:
        self.store, self.backend = store, backend
        self.stats: OffloadStats = OffloadStats()
        self.peak_paged_bytes = 0  # no pages on the device, ever
        self.bytes_d2h = 0  # the FFN's inputs and choices to the host
        self.bytes_h2d = 0  # its output back
        self._host_part = jax.jit(functools.partial(_host_part, local_expert_ffn(config, HOST_EXPERT_BACKEND)),
                                  static_argnames=("start",))

    @property
    def layers(self) -> list[int]:
        return self.store.layers

    def next_layer(self, after: int) -> int | None:
        return next_moe_layer(self.layers, after)

    def fetch_page(self, layer: int | None, page: int) -> Experts | None:
        return None  # the host's experts stay where they are

    def release(self, layer: int) -> None:
        pass

    def run_moe(self, handle: layered_steps.Layer, x: jax.Array, y: jax.Array, idx: jax.Array, weights: jax.Array
                ) -> jax.Array:
        """The experts half of the MoE layer: the host's share of the choices on the host, the resident share's on
        the device, their sum in float32 (as paged_routed adds its parts), then the shared expert and residual."""
        layer = handle.index
        E = self.store.num_experts[layer]
        keep = resident_experts(E, self.store.share)
        s = self.stats[layer]
        s.hits += 1  # every expert is where it runs
        host, resident = self.store.on_host.get(layer), self.store.resident.get(layer)
        parts: list[jax.Array] = []
        if host is not None:  # dispatched first: the host starts while the device runs the resident share
            sent = jax.device_put((y.reshape(-1, y.shape[-1]), idx, weights), self.store.host)
            self.bytes_d2h += sum(a.nbytes for a in sent)
            out = jax.device_put(self._host_part(*sent, host, start=keep), self.store.device)
            self.bytes_h2d += out.nbytes
            parts.append(out)
        if resident:  # added first, as paged_routed adds the resident part before the pages
            parts.insert(0, handle(paged_routed, y, idx, weights, [resident], starts=(0,), backend=self.backend)
                         .astype(jnp.float32))
        return handle(_finish, x, y, tuple(parts))

    # -- LayeredSteps' loop (unpipelined steps) --------------------------------------------------------------------
    def begin_pass(self, steps: layered_steps.LayeredSteps) -> None:
        pass

    def moe(self, handle: layered_steps.Layer, x: jax.Array, y: jax.Array, idx: jax.Array | None,
            weights: jax.Array | None) -> jax.Array:
        assert idx is not None and weights is not None  # its layers always run the router
        return self.run_moe(handle, x, y, idx, weights)

    def describe(self) -> str:
        E = max(self.store.num_experts.values(), default=0)
        keep = resident_experts(E, self.store.share)
        return (f"lightning: {keep} of {E} experts per layer resident (r_w = {self.store.share:.2f}) and run on the "
                f"device, the other {E - keep} in host memory, run by the host ({self.store.host}, F_g = 0)")


def _host_part(ffn: Callable[..., jax.Array], y2: jax.Array, idx: jax.Array, weights: jax.Array, experts: Experts,
               *, start: int) -> jax.Array:
    """On the host: the routed output [N, D] in float32 of the choices among experts start.. (the others at weight
    0)."""
    n = next(iter(experts.values())).shape[0]
    local = idx - start
    inside = (local >= 0) & (local < n)
    return ffn(y2, jnp.clip(local, 0, n - 1), jnp.where(inside, weights, 0), experts).astype(jnp.float32)


def _finish(graphdef: nnx.GraphDef, state: nnx.State, x: jax.Array, y: jax.Array, parts: tuple[jax.Array, ...]
            ) -> jax.Array:
    out = functools.reduce(jnp.add, parts).astype(y.dtype)
    return layered_steps.finish(graphdef, state, x, y, out)
