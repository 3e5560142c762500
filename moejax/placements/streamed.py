"""Streamed experts (MoE-Prefill §6.3, one device): each MoE layer's routed experts copied from pinned host memory
`window` layers ahead. stream='python': a loop over per-layer jits moves them (moejax.offload.streamed);
stream='jit': the experts are host-memory inputs of the whole-model jits and XLA schedules their copies."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from moejax.models.moe import HostExperts, is_routed_expert
from moejax.offload.host_store import HostStore
from moejax.offload.streamed import Streamed as StreamedRuntime
from moejax.placements.base import LayerByLayer, Placement, Store

from moejax.config import ModelConfig
from moejax.kernels.backends import Kernels
from moejax.models.moe import MoEBlock
from moejax.offload.layered import LayeredSteps
from moejax.offload.memory_budget import MemoryBudget
from moejax.offload.settings import PlacementSettings
from moejax.sharding.setup import LayoutSetup


class Streamed(LayerByLayer):
    name = "streamed"
    theta_mode = "streamed"
    profiles_theta = True

    @classmethod
    def applies(cls, budget: MemoryBudget, settings: PlacementSettings, layout_setup: LayoutSetup | None) -> bool:
        return budget.placement == cls.name and layout_setup is None and not settings.streams_in_jit

    def new_store(self) -> HostStore:
        return HostStore(per_expert=False, staging_bytes=self.staging_bytes)

    def layer_runtime(self, store: Store, kernels: Kernels, config: ModelConfig) -> StreamedRuntime:
        assert self.memory_budget.window is not None  # a streamed budget has its window
        return StreamedRuntime(store, self.memory_budget.window, kernels.experts)


class StreamedInJit(Placement):
    """stream='jit': no layer loop, no counters; the MoE blocks move their host-memory arrays where they use them."""
    name = "streamed"

    @classmethod
    def applies(cls, budget: MemoryBudget, settings: PlacementSettings, layout_setup: LayoutSetup | None) -> bool:
        return budget.placement == "streamed" and layout_setup is None and settings.streams_in_jit

    def experts_runner(self) -> Callable[[MoEBlock, jax.Array, str], jax.Array]:
        return HostExperts()

    def new_store(self) -> HostStore:
        return HostStore(per_expert=False)

    def place(self, path: tuple, array: Any, store: Store) -> Any:
        if is_routed_expert(path):
            return store.add(path, array)  # the host array itself: an input of the jits
        return super().place(path, array, store)

    def stats(self, steps: LayeredSteps | None) -> dict:
        return {"placement": "streamed", "stream": "jit"}  # XLA moves the experts: nothing to count here

    def describe(self, steps: LayeredSteps | None) -> str:
        return ("placement streamed inside the jit: the experts are host-memory inputs and XLA schedules their copies "
                "(no window, no counters: XLA decides how many layers of experts are on the device at once, and the "
                "memory budget's window is a plan, not enforced)")
