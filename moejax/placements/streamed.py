"""Streamed experts (MoE-Prefill §6.3, one device): each MoE layer's routed experts copied from pinned host memory
`window` layers ahead. stream='python': a loop over per-layer jits moves them (moejax.offload.streamed);
stream='jit': the experts are host-memory inputs of the whole-model jits and XLA schedules their copies."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from moejax.config import ModelConfig
from moejax.kernels.backends import Kernels
from moejax.models.moe import HostExperts, MoEBlock, is_routed_expert
from moejax.offload.host_store import HostStore
from moejax.offload.layered_steps import LayeredSteps
from moejax.offload.memory_budget import DEFAULT_WINDOW, BudgetAsk, MemoryBudget, MemoryBudgetError, ModelBytes, size
from moejax.offload.settings import PlacementSettings
from moejax.offload.streamed import StreamedExpertsRuntime
from moejax.placements.base import LayerByLayer, Placement, Store
from moejax.plan.hardware import Profile
from moejax.plan.placement import PlacementOption, step_costs
from moejax.sharding.setup import LayoutSetup


class Streamed(LayerByLayer):
    name = "streamed"
    theta_mode = "streamed"
    profiles_theta = True
    takes_staging = True
    offloads = True
    auto_rank = 1  # when the experts do not all fit: a window of layers, if two layers fit
    per_device = ("under experts=async_ep each device holds the current and next layer's experts whole and window "
                  "layers of its 1/devices shards")

    @classmethod
    def budget(cls, model: ModelBytes, ask: BudgetAsk, auto: bool) -> MemoryBudget | None:
        if model.budget_bytes is None:
            return cls._sized(model, ask.window or DEFAULT_WINDOW, "no device memory cap; window as asked or default")
        free, fits, layer_bytes = model.free(), model.fits(), model.layer_bytes
        max_window = min(free // layer_bytes - 1, model.moe_layers - 1)
        if auto and max_window < 1:
            return None
        window = ask.window
        if window is not None and window > max_window:
            raise MemoryBudgetError(f"streamed window {window} needs {window + 1} layers of experts = "
                                    f"{size((window + 1) * layer_bytes)} but {fits} leaves {size(free)} "
                                    f"(window {max(max_window, 0)} at most)")
        if max_window < 1:
            raise MemoryBudgetError(f"streamed placement needs 2 layers of experts ({size(2 * layer_bytes)}) on the "
                                    f"device but {fits} leaves {size(free)}; use placement 'cached' or a larger budget")
        return cls._sized(model, window or min(DEFAULT_WINDOW, max_window), f"experts {size(model.all_experts)} > "
                          f"{size(free)} free ({fits}); window {max_window} at most")

    @classmethod
    def _sized(cls, model: ModelBytes, window: int, reason: str) -> MemoryBudget:
        if window < 1:
            raise MemoryBudgetError(f"streamed window must be >= 1, got {window}")
        return MemoryBudget(cls, **model.fields(), window=int(window), reason=reason)

    @classmethod
    def expert_device_bytes(cls, budget: MemoryBudget) -> int:
        assert budget.window is not None  # a streamed budget has its window
        return (budget.window + 1) * budget.layer_expert_bytes

    @classmethod
    def describe_experts(cls, budget: MemoryBudget) -> str:
        assert budget.window is not None
        return f"window {budget.window}: {budget.window + 1} layers of experts on the device"

    @classmethod
    def predicted_step(cls, cfg: ModelConfig, profile: Profile, budget: MemoryBudget, tokens: int
                       ) -> PlacementOption:
        """The window hides each layer's copy behind the compute: max(compute, copy) per MoE layer."""
        c = step_costs(cfg, profile, budget, tokens)
        return PlacementOption(cls.name, c.dense + c.moe * max(c.per_layer, c.layer_copy),
                               f"per MoE layer max(compute {c.per_layer * 1e3:.2f} ms, copy "
                               f"{c.layer_copy * 1e3:.2f} ms)")

    @classmethod
    def applies(cls, budget: MemoryBudget, settings: PlacementSettings, layout_setup: LayoutSetup | None) -> bool:
        return budget.placement == cls.name and layout_setup is None and not settings.streams_in_jit

    def new_store(self) -> HostStore:
        return HostStore(per_expert=False, staging_bytes=self.staging_bytes)

    def layer_runtime(self, store: Store, kernels: Kernels, config: ModelConfig) -> StreamedExpertsRuntime:
        assert self.memory_budget.window is not None  # a streamed budget has its window
        return StreamedExpertsRuntime(store, self.memory_budget.window, kernels.experts)


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
