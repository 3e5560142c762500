"""Every weight on the device (or spread over a layout's devices): the whole-model jits run every step."""
from __future__ import annotations

from typing import TYPE_CHECKING

from moejax.placements.base import Placement

if TYPE_CHECKING:
    from moejax.offload.memory_budget import MemoryBudget
    from moejax.offload.settings import PlacementSettings
    from moejax.sharding.setup import LayoutSetup


class Resident(Placement):
    name = "resident"
    stacks_layers = True

    @classmethod
    def applies(cls, budget: MemoryBudget, settings: PlacementSettings, layout_setup: LayoutSetup | None) -> bool:
        return budget.placement == cls.name and (layout_setup is None or not layout_setup.disaggregated)


class ResidentAsyncEP(Resident):
    """Resident under layout experts=async_ep (MoE-Prefill §6.2): the experts stay split over the devices and each MoE
    layer all-gathers the other devices' shards during the forward, which only a batch whose compute covers the gather
    hides: Θ by Eq. 1 in that device-to-device channel (not measured: Eq. 3's profiling times a layer loop, and these
    are whole-model jits)."""

    theta_mode = "async_ep"

    def distinct_layers(self) -> tuple[int, ...]:
        """The first MoE layer keeps its experts whole on every device (moejax.sharding.setup.LayoutSetup.place)."""
        first = None if self.layout_setup is None else self.layout_setup.first_moe
        return () if first is None else (first,)

    @classmethod
    def applies(cls, budget: MemoryBudget, settings: PlacementSettings, layout_setup: LayoutSetup | None) -> bool:
        return super().applies(budget, settings, layout_setup) and layout_setup is not None \
            and layout_setup.layout.experts == "async_ep"
