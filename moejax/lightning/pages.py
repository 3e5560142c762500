"""Paged expert weights with a resident share (MoE-Lightning §4.1 "Weights Paging", App. A.1): of each MoE layer's
E routed experts, the first round(r_w E) stay on the device for good; the others live in pinned host memory cut
into `pages` pages of consecutive experts, which CGOPipe moves one per micro-batch (W_PINTOG) while the previous
layer computes, so a page never waits behind a whole layer. At most two layers' pages are on the device at once (the
double buffer of A.1: the layer computing and the next) beside the resident share, and no more: the expert FFN reads
each expert from its page through a page table (`paged_routed`), so no layer is assembled into a third copy.

The parts of a layer (resident first, then the pages) cover its experts in order, so the page table is each part's
first expert id and the router's ids need no renumbering."""
from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.models.moe import is_routed_expert
from moejax.offload import layered_steps
from moejax.offload.stats import OffloadStats

Experts = dict[str, jax.Array]


def paged_routed(graphdef: nnx.GraphDef, state: nnx.State, y: jax.Array, idx: jax.Array, weights: jax.Array,
                 parts: list[Experts], *, starts: tuple[int, ...], backend: str) -> jax.Array:
    """Routed experts' output [N, D] read through the page table: part p holds experts starts[p].. of the layer; it
    runs the choices that fall in it (the others at weight 0) and the parts' outputs add up in float32."""
    mlp = nnx.merge(graphdef, state).mlp
    y2 = y.reshape(-1, y.shape[-1])
    out = jnp.zeros(y2.shape, jnp.float32)
    for start, part in zip(starts, parts, strict=True):
        n = next(iter(part.values())).shape[0]
        local = idx - start
        inside = (local >= 0) & (local < n)
        out += mlp.routed(y2, jnp.clip(local, 0, n - 1), jnp.where(inside, weights, 0), part, backend).astype(
            jnp.float32)
    return out.astype(y2.dtype)


def page_ranges(experts: int, resident: int, pages: int) -> list[tuple[int, int]]:
    """[start, end) expert ranges of the non-resident experts [resident, experts) in at most `pages` pages of sizes
    differing by at most one (no empty page)."""
    if not 0 <= resident <= experts or pages < 1:
        raise ValueError(f"page_ranges: need 0 <= resident ({resident}) <= experts ({experts}) and pages >= 1 "
                         f"({pages})")
    cuts = np.array_split(np.arange(resident, experts), min(pages, experts - resident) or 1)
    return [(int(c[0]), int(c[-1]) + 1) for c in cuts if len(c)]


def resident_experts(experts: int, share: float) -> int:
    """How many of a layer's experts a resident share r_w keeps on the device."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"the resident share of the experts (r_w) must be in [0, 1], got {share}")
    return int(round(share * experts))


class ResidentShare:
    """What the lightning stores share: per MoE layer, the first round(r_w E) routed experts on the device; the
    others are each store's own (PagedStore: pages in pinned host memory; host_ffn.HostExpertStore: the host's)."""

    def __init__(self, share: float, device: jax.Device | None = None) -> None:
        resident_experts(1, share)  # checks the share
        self.share = float(share)
        self.device = device or jax.devices()[0]
        self.resident: dict[int, Experts] = {}
        self.num_experts: dict[int, int] = {}

    def add_resident(self, path: tuple, array: Any) -> tuple[int, str, int, int]:
        """Places the resident share of a routed expert array -> (layer, name, experts E, resident count)."""
        if not is_routed_expert(path):
            raise ValueError(f"{type(self).__name__}: {path} is not a routed expert array")
        layer, name, E = path[1], path[3], array.shape[0]
        keep = resident_experts(E, self.share)
        self.num_experts[layer] = E
        if keep:
            self.resident.setdefault(layer, {})[name] = jax.device_put(
                array[:keep], jax.sharding.SingleDeviceSharding(self.device))
        return layer, name, E, keep

    @property
    def layers(self) -> list[int]:
        return sorted(self.num_experts)

    def device_bytes(self) -> int:
        return sum(a.nbytes for layer in self.resident.values() for a in layer.values())


class PagedStore(ResidentShare):
    """What `moejax.load` fills: per MoE layer, the resident experts on the device and the pages in pinned host
    memory ({name: array} each)."""

    def __init__(self, share: float, pages: int, device: jax.Device | None = None) -> None:
        super().__init__(share, device)
        self.pages = int(pages)
        self.paged: dict[int, list[Experts]] = {}

    def add(self, path: tuple, array: Any) -> None:
        layer, name, E, keep = self.add_resident(path, array)
        host = jax.sharding.SingleDeviceSharding(self.device, memory_kind="pinned_host")
        pages = self.paged.setdefault(layer, [{} for _ in page_ranges(E, keep, self.pages)])
        for page, (a, b) in zip(pages, page_ranges(E, keep, self.pages), strict=True):
            page[name] = jax.device_put(array[a:b], host)

    def page_bytes(self, layer: int, page: int) -> int:
        return sum(a.nbytes for a in self.paged[layer][page].values())

    def host_bytes(self) -> int:
        return sum(a.nbytes for pages in self.paged.values() for page in pages for a in page.values())


def next_moe_layer(layers: list[int], after: int) -> int | None:
    """The first of the MoE `layers` after layer index `after`, wrapping to the next pass's first (None: none)."""
    return next((i for i in layers if i > after), layers[0] if layers else None)


class PagedExperts(layered_steps.LayerRuntime):
    """The pipeline's weight runtime: `fetch_page` starts a page's copy (W_PINTOG), `experts` assembles a layer
    (waiting only for its own pages), `release` drops it. `moe` and `begin_pass` serve LayeredSteps' own loop (the
    steps that run unpipelined: scoring, logits), one layer's pages ahead."""

    name = "lightning"

    def __init__(self, store: PagedStore, backend: str) -> None:
        self.store, self.backend = store, backend
        self.stats: OffloadStats = OffloadStats()
        self._pages: dict[int, dict[int, Experts]] = {}  # layer -> page -> arrays on the device or on their way
        self._ready: dict[int, tuple[list[Experts], tuple[int, ...]]] = {}  # layer -> its parts and page table
        self.peak_paged_bytes = 0  # the most bytes of pages held on the device at once (ready and on their way)

    @property
    def layers(self) -> list[int]:
        return self.store.layers

    def next_layer(self, after: int) -> int | None:
        return next_moe_layer(self.layers, after)

    def fetch_page(self, layer: int | None, page: int) -> Experts | None:
        """Start copying page `page` of `layer` to the device unless it is there, on its way or absent; -> the
        page's arrays on their way, or None when nothing started."""
        if layer is None or page >= len(self.store.paged.get(layer, ())) or page in self._pages.get(layer, {}):
            return None
        device = jax.sharding.SingleDeviceSharding(self.store.device)
        arrays = self._pages.setdefault(layer, {})[page] = {n: jax.device_put(a, device)
                                                            for n, a in self.store.paged[layer][page].items()}
        s = self.stats[layer]
        s.prefetches += 1
        s.bytes_h2d += self.store.page_bytes(layer, page)
        return arrays

    def experts(self, layer: int) -> tuple[list[Experts], tuple[int, ...]]:
        """The layer's routed experts on the device as parts (the resident share, then its pages) and their first
        expert ids (the page table); pages not started yet are fetched now (misses)."""
        done = self._ready.get(layer)
        if done is not None:
            return done
        s = self.stats[layer]
        pages = self.store.paged.get(layer, [])
        for p in range(len(pages)):
            if self.fetch_page(layer, p) is not None:
                s.misses += 1
                s.prefetches -= 1  # fetched on demand, not ahead
            else:
                s.hits += 1
        arrived = self._pages.pop(layer, {})  # held by the ready parts until release; its next pass's fetch anew
        start = time.perf_counter()
        paged = [arrived[p] for p in range(len(pages))]
        jax.block_until_ready(paged)  # waits only for this layer's pages; later copies keep running
        s.wait_s += time.perf_counter() - start
        resident = self.store.resident.get(layer)
        E = self.store.num_experts[layer]
        keep = resident_experts(E, self.store.share)
        parts = ([resident] if resident else []) + paged
        starts = ((0,) if resident else ()) + tuple(a for a, _ in page_ranges(E, keep, self.store.pages))[:len(paged)]
        self._ready[layer] = parts, starts
        self.peak_paged_bytes = max(self.peak_paged_bytes, self.paged_bytes())
        return parts, starts

    def paged_bytes(self) -> int:
        """Bytes of pages on the device now: the ready layers' and those on their way."""
        ready = sum(a.nbytes for layer, (parts, _) in self._ready.items() for part in parts
                    if part is not self.store.resident.get(layer) for a in part.values())
        moving = sum(a.nbytes for pages in self._pages.values() for page in pages.values() for a in page.values())
        return ready + moving

    def run_moe(self, handle: layered_steps.Layer, x: jax.Array, y: jax.Array, idx: jax.Array, weights: jax.Array
                ) -> jax.Array:
        """The experts half of the MoE layer, each expert read from its part."""
        parts, starts = self.experts(handle.index)
        out = handle(paged_routed, y, idx, weights, parts, starts=starts, backend=self.backend)
        return handle(layered_steps.finish, x, y, out)

    def release(self, layer: int) -> None:
        """The layer's FFN is dispatched for every micro-batch: drop its pages (those of its next pass, fetched
        since, stay)."""
        self._ready.pop(layer, None)

    # -- LayeredSteps' loop (unpipelined steps) --------------------------------------------------------------------
    def begin_pass(self, steps: layered_steps.LayeredSteps) -> None:
        first = self.next_layer(-1)
        for p in range(self.store.pages):
            self.fetch_page(first, p)

    def moe(self, handle: layered_steps.Layer, x: jax.Array, y: jax.Array, idx: jax.Array | None,
            weights: jax.Array | None) -> jax.Array:
        assert idx is not None and weights is not None  # its layers always run the router
        self.experts(handle.index)
        for p in range(self.store.pages):
            self.fetch_page(self.next_layer(handle.index), p)
        out = self.run_moe(handle, x, y, idx, weights)
        self.release(handle.index)
        return out

    def describe(self) -> str:
        E = max(self.store.num_experts.values(), default=0)
        keep = resident_experts(E, self.store.share)
        pages = len(page_ranges(E, keep, self.store.pages)) if E > keep else 0
        return (f"lightning: {keep} of {E} experts per layer resident (r_w = {self.store.share:.2f}), the other "
                f"{E - keep} paged in {pages} pages per layer from pinned host memory")
