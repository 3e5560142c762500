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

    @classmethod
    def applies(cls, budget: MemoryBudget, settings: PlacementSettings, layout_setup: LayoutSetup | None) -> bool:
        return budget.placement == cls.name and (layout_setup is None or not layout_setup.disaggregated)
