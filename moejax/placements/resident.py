"""Every weight on the device (or spread over a layout's devices): the whole-model jits run every step."""
from __future__ import annotations

from moejax.placements.base import Placement


class Resident(Placement):
    name = "resident"

    @classmethod
    def applies(cls, memory_plan, settings, layout_setup) -> bool:
        return memory_plan.placement == cls.name and (layout_setup is None or not layout_setup.disaggregated)
