"""Every weight on the device (or spread over a layout's devices): the whole-model jits run every step."""
from __future__ import annotations

from moejax.offload.memory_budget import BudgetAsk, MemoryBudget, MemoryBudgetError, ModelBytes, size
from moejax.offload.settings import PlacementSettings
from moejax.placements.base import Placement
from moejax.sharding.setup import LayoutSetup


class Resident(Placement):
    name = "resident"
    stacks_layers = True
    runs_batch_invariant = True
    auto_rank = 0  # auto's first choice: every expert on the device when they fit

    @classmethod
    def budget(cls, model: ModelBytes, ask: BudgetAsk, auto: bool) -> MemoryBudget | None:
        if model.budget_bytes is None:
            return MemoryBudget(cls, **model.fields(), reason="no device memory cap")
        free, fits = model.free(), model.fits()
        if model.all_experts > free:
            if auto:
                return None
            raise MemoryBudgetError(f"placement 'resident': all routed experts need {size(model.all_experts)} but "
                                    f"{fits} leaves {size(free)}; use placement 'streamed' or 'cached'")
        return MemoryBudget(cls, **model.fields(), reason=f"the whole model fits: experts {size(model.all_experts)} "
                                                          f"<= {size(free)} free ({fits})")

    @classmethod
    def applies(cls, budget: MemoryBudget, settings: PlacementSettings, layout_setup: LayoutSetup | None) -> bool:
        return budget.placement == cls.name and (layout_setup is None or not layout_setup.disaggregated)


class ResidentAsyncEP(Resident):
    """Resident under layout experts=async_ep (MoE-Prefill §6.2): the experts stay split over the devices and each MoE
    layer all-gathers the other devices' shards during the forward, which only a batch whose compute covers the gather
    hides: Θ by Eq. 1 in that device-to-device channel (not measured: Eq. 3's profiling times a layer loop, and these
    are whole-model jits)."""

    theta_mode = "async_ep"
    # each later MoE layer's all-gathers read only parameters, so XLA may start any of them early; inside a scan
    # they would read a slice of a stack by the loop's index and wait for their iteration
    stacks_layers = False
    runs_batch_invariant = False  # its gathers are collectives, outside the mode's fixed tiles

    @classmethod
    def applies(cls, budget: MemoryBudget, settings: PlacementSettings, layout_setup: LayoutSetup | None) -> bool:
        return super().applies(budget, settings, layout_setup) and layout_setup is not None \
            and layout_setup.layout.experts == "async_ep"
