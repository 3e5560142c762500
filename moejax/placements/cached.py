"""Cached experts (Speculating Experts, fMoE): a fixed number of expert slots on the device, filled from pinned host
memory by demand and by a predictor's prefetches (moejax.offload.cached)."""
from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from moejax.config import ModelConfig
from moejax.kernels.backends import Kernels
from moejax.offload.cached import PREFETCH_DEPTH, CachedExpertsRuntime
from moejax.offload.host_store import HostStore
from moejax.offload.memory_budget import (
    MIN_PASS_EXPERTS,
    PREFILL_STREAM_LAYERS,
    BudgetAsk,
    MemoryBudget,
    MemoryBudgetError,
    ModelBytes,
    size,
)
from moejax.offload.predict.protocol import Predictor
from moejax.offload.settings import PlacementSettings
from moejax.offload.setup import check_predictor, predictor_of
from moejax.placements.base import LayerByLayer, Store
from moejax.plan.hardware import Profile
from moejax.plan.placement import PlacementOption, step_costs
from moejax.sharding.setup import LayoutSetup


class Cached(LayerByLayer):
    name = "cached"
    takes_staging = True
    offloads = True
    auto_rank = 2  # when not even two layers of experts fit: as many expert slots as do
    per_device = "under experts=ep each device has its own cache of that many slots"
    # what layer_runtime builds (CachedEP: one per device)
    runtime: ClassVar[type[CachedExpertsRuntime]] = CachedExpertsRuntime

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

    # -- the memory budget ----------------------------------------------------------------------------------------
    @classmethod
    def budget(cls, model: ModelBytes, ask: BudgetAsk, auto: bool) -> MemoryBudget:
        E, top_k = model.experts_per_layer, model.top_k
        if model.budget_bytes is None:
            slots = cls._every_expert_at_most(model, ask.cache_slots or 2 * E)
            return cls._sized(model, slots, "no device memory cap; slots as asked or two layers' worth", ask)
        free, fits = model.free(), model.fits()
        pass_experts = cls._pass_experts(E, top_k)
        transient = max(pass_experts, PREFILL_STREAM_LAYERS * E if ask.prefill_stream else 0)
        max_slots = min(free // model.expert_bytes - transient, E * model.moe_layers)
        slots = (cls._every_expert_at_most(model, ask.cache_slots) if ask.cache_slots else None) or max_slots
        if slots < top_k or slots > max_slots:
            per = "for a streamed prefill" if transient > pass_experts else "per pass"
            raise MemoryBudgetError(f"cached placement with {slots} slots needs ({slots} + {transient} {per}) x "
                                    f"{size(model.expert_bytes)} but {fits} leaves {size(free)} (at most {max_slots} "
                                    f"slots; at least top-k = {top_k} needed)")
        return cls._sized(model, slots, f"a layer of experts does not fit twice in {size(free)} free ({fits})"
                          if auto else f"asked for; at most {max_slots} slots fit", ask)

    @staticmethod
    def _pass_experts(experts_per_layer: int, top_k: int) -> int:
        """Experts the cached FFN stacks per pass (before the cap by the slot count)."""
        return min(experts_per_layer, max(top_k, MIN_PASS_EXPERTS))

    @staticmethod
    def _every_expert_at_most(model: ModelBytes, slots: int) -> int:
        """More slots than the model has routed experts hold nothing more: as many as it has."""
        return min(slots, model.experts_per_layer * model.moe_layers)

    @classmethod
    def _sized(cls, model: ModelBytes, slots: int, reason: str, ask: BudgetAsk) -> MemoryBudget:
        if slots < model.top_k:
            raise MemoryBudgetError(f"cached placement needs at least top-k = {model.top_k} slots, got {slots}")
        asked = ask.cache_slots
        if asked and asked > slots == model.experts_per_layer * model.moe_layers:
            reason += f"; {asked} slots asked, but the model has {slots} routed experts: every one has a slot"
        pass_experts = min(int(slots), cls._pass_experts(model.experts_per_layer, model.top_k))
        return MemoryBudget(cls, **model.fields(), cache_slots=int(slots), pass_experts=pass_experts, reason=reason,
                            prefill_stream=ask.prefill_stream)

    @classmethod
    def expert_device_bytes(cls, budget: MemoryBudget) -> int:
        assert budget.cache_slots is not None and budget.pass_experts is not None  # a cached budget has its slots
        return (budget.cache_slots + budget.transient_experts) * budget.expert_bytes

    @classmethod
    def describe_experts(cls, budget: MemoryBudget) -> str:
        what = f"{budget.cache_slots} expert slots + {budget.pass_experts} per FFN pass"
        if budget.prefill_stream:
            what += (f"; prefill streams whole layers: {PREFILL_STREAM_LAYERS} layers' experts beside the slots "
                     "(the layer, the next one on its way, the layer stacked)")
        return what

    @classmethod
    def predicted_step(cls, cfg: ModelConfig, profile: Profile, budget: MemoryBudget, tokens: int
                       ) -> PlacementOption:
        """Compute + the misses loaded on demand: a step touches E·(1 - (1 - k/E)^tokens) experts of a layer
        (uniform routing), of which the cache holds slots / (E·layers) (no predictor assumed)."""
        c = step_costs(cfg, profile, budget, tokens)
        E, k = max(cfg.num_experts, 1), max(cfg.num_experts_per_tok, 1)
        touched = E * (1 - (1 - k / E) ** tokens)
        assert budget.cache_slots is not None  # the cached placement's budget has its slots
        held = min(1.0, budget.cache_slots / (E * c.moe))
        loads = touched * (1 - held) * profile.h2d.time(budget.expert_bytes)
        return PlacementOption(cls.name, c.dense + c.moe * (c.per_layer + loads),
                               f"per MoE layer compute {c.per_layer * 1e3:.2f} ms + {touched * (1 - held):.1f} "
                               f"misses loaded {loads * 1e3:.2f} ms")

    def at_load(self, config: ModelConfig, find_profile: Callable[[], Profile]) -> None:
        """The predictor's files against the model, before any request (a mismatch would fail every pass)."""
        try:
            check_predictor(self.predictor, config)
        except ValueError as e:
            raise ValueError(f"moejax.load: {e}") from None

    def new_store(self) -> HostStore:
        return HostStore(per_expert=True, staging_bytes=self.staging_bytes)

    def layer_runtime(self, store: Store, kernels: Kernels, config: ModelConfig) -> CachedExpertsRuntime:
        s = self.settings
        assert self.memory_budget.cache_slots is not None  # a cached budget has its slots
        return self.runtime(store, self.memory_budget.cache_slots, s.eviction or "lru", kernels.experts,
                            predictor=self.predictor, speculative=s.speculative, router_free=s.router_free,
                            pass_experts=self.memory_budget.pass_experts,
                            count_mispredictions=s.count_mispredictions,
                            prefetch_depth=s.prefetch_depth or PREFETCH_DEPTH, prefill=s.prefill_experts or "cache")
