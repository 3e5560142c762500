"""Placements: where routed experts live and how a forward reaches them (moejax.placements.base.Placement). Adding one
is one file in this folder holding its class, and one line in moejax.placements.registry; `placement_for` tries the
registry's classes in order and runs the first that applies."""
from __future__ import annotations

from moejax.offload.memory_budget import MemoryBudget
from moejax.offload.settings import PlacementSettings
from moejax.placements.base import LayerByLayer, Placement
from moejax.placements.cached import Cached
from moejax.placements.cached_ep import CachedEP
from moejax.placements.dep import DEP
from moejax.placements.lightning import Lightning
from moejax.placements.pipeline_parallel import Pipeline
from moejax.placements.registry import load_registry
from moejax.placements.resident import Resident, ResidentAsyncEP
from moejax.placements.streamed import Streamed, StreamedInJit
from moejax.sharding.setup import LayoutSetup

__all__ = ["PLACEMENTS", "Cached", "CachedEP", "DEP", "LayerByLayer", "Lightning", "Pipeline", "Placement",
           "Resident", "ResidentAsyncEP", "Streamed", "StreamedInJit", "placement_for"]

PLACEMENTS: tuple[type[Placement], ...] = load_registry()


def placement_for(budget: MemoryBudget, settings: PlacementSettings, layout_setup: LayoutSetup | None
                  ) -> Placement:
    """The placement of a memory budget (moejax.placements.budget: resident, streamed, cached or lightning), the
    placement settings (moejax.offload.settings) and the checked layout (None on one device); ValueError when none
    applies, or when a setting given does not apply to it."""
    for cls in PLACEMENTS:
        if cls.applies(budget, settings, layout_setup):
            if settings.pinned_staging_mb is not None and not settings.auto and not cls.takes_staging:
                raise ValueError("moejax.load: pinned_staging_mb applies to placement 'streamed' (stream 'python') or "
                                 f"'cached', not {budget.placement!r}")
            return cls.build(budget, settings, layout_setup)
    assert layout_setup is not None  # on one device Resident, Streamed or Cached applies
    in_jit = " (stream=jit)" if settings.streams_in_jit else ""
    raise ValueError(f"moejax.load: layout {layout_setup.layout} and placement {budget.placement!r}{in_jit} do "
                     "not combine; with a layout, experts are offloaded only as experts=async_ep with "
                     "placement='streamed' (stream='python'), or as attn=dp,experts=ep with placement='cached'")
