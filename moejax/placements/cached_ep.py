"""Cached experts over several devices (fMoE §5, layout experts=ep with placement 'cached'): expert e of every MoE
layer on device e % D, each device with its own cache of cache_slots slots (moejax.sharding.cached_ep)."""
from __future__ import annotations

import dataclasses

from moejax.offload.memory_budget import MemoryBudget
from moejax.offload.settings import PlacementSettings
from moejax.placements.cached import Cached
from moejax.sharding.cached_ep import CachedExpertsOverEPRuntime, RoundRobinStore
from moejax.sharding.setup import LayoutSetup


class CachedEP(Cached):
    name = "ep+cached"
    runtime = CachedExpertsOverEPRuntime

    @classmethod
    def applies(cls, budget: MemoryBudget, settings: PlacementSettings, layout_setup: LayoutSetup | None) -> bool:
        return (budget.placement == "cached" and layout_setup is not None and layout_setup.layout.attn == "dp"
                and layout_setup.layout.experts == "ep")

    @classmethod
    def build(cls, budget: MemoryBudget, settings: PlacementSettings, layout_setup: LayoutSetup | None) -> Cached:
        assert layout_setup is not None  # applies only with a layout
        if settings.prefill_experts == "stream":  # refused at load, not at the first request
            raise ValueError("moejax.load: the cached placement over several devices (experts=ep) does not stream "
                             "prefill experts: prefill_experts='stream' runs on one device")
        # its MoE step gathers the tokens and reduce-scatters the outputs whatever the spec's exchange: say so (the
        # layout's communication in explain() follows it)
        layout = dataclasses.replace(layout_setup.layout, exchange="gather")
        return super().build(budget, settings, dataclasses.replace(layout_setup, layout=layout))

    def new_store(self) -> RoundRobinStore:  # type: ignore[override]
        assert self.layout_setup is not None  # applies only with a layout
        return RoundRobinStore(self.layout_setup.mesh)
