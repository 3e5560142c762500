"""Cached experts (Speculating Experts, fMoE): a fixed number of expert slots on the device, filled from pinned host
memory by demand and by a predictor's prefetches (moejax.offload.cached)."""
from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from moejax.offload.cached import PREFETCH_DEPTH, Cached as CachedRuntime
from moejax.offload.host_store import HostStore
from moejax.offload.setup import check_predictor, predictor_of
from moejax.placements.base import LayerByLayer, Store

from moejax.config import ModelConfig
from moejax.kernels.backends import Kernels
from moejax.offload.memory_budget import MemoryBudget
from moejax.offload.predict.protocol import Predictor
from moejax.offload.settings import PlacementSettings
from moejax.plan.hardware import Profile
from moejax.sharding.setup import LayoutSetup


class Cached(LayerByLayer):
    name = "cached"
    runtime: ClassVar[type[CachedRuntime]] = CachedRuntime  # what layer_runtime builds (CachedEP: one per device)

    def __init__(self, budget: MemoryBudget, layout_setup: LayoutSetup | None = None, *, settings: PlacementSettings,
                 predictor: Predictor | None) -> None:
        """settings: the PlacementSettings (eviction, speculative, router_free, count_mispredictions); predictor:
        the object built from them at load (predictor_of), or None."""
        super().__init__(budget, layout_setup)
        self.settings, self.predictor = settings, predictor

    @classmethod
    def applies(cls, budget: MemoryBudget, settings: PlacementSettings, layout_setup: LayoutSetup | None) -> bool:
        return budget.placement == cls.name and layout_setup is None

    @classmethod
    def build(cls, budget: MemoryBudget, settings: PlacementSettings, layout_setup: LayoutSetup | None) -> Cached:
        return cls(budget, layout_setup, settings=settings, predictor=predictor_of(settings)).staged(settings)

    def at_load(self, config: ModelConfig, find_profile: Callable[[], Profile]) -> None:
        """The predictor's files against the model, before any request (a mismatch would fail every pass)."""
        try:
            check_predictor(self.predictor, config)
        except ValueError as e:
            raise ValueError(f"moejax.load: {e}") from None

    def new_store(self) -> HostStore:
        return HostStore(per_expert=True, staging_bytes=self.staging_bytes)

    def layer_runtime(self, store: Store, kernels: Kernels, config: ModelConfig) -> CachedRuntime:
        s = self.settings
        assert self.memory_budget.cache_slots is not None  # a cached budget has its slots
        return self.runtime(store, self.memory_budget.cache_slots, s.eviction or "lru", kernels.experts,
                            predictor=self.predictor, speculative=s.speculative, router_free=s.router_free,
                            pass_experts=self.memory_budget.pass_experts,
                            count_mispredictions=s.count_mispredictions,
                            prefetch_depth=s.prefetch_depth or PREFETCH_DEPTH, prefill=s.prefill_experts or "cache")
