"""The memory budget, asked of the placements: the `placement` option's value names the placement class that sizes it
(Placement.budget), and placement auto tries the classes auto may choose (Placement.auto_rank), then lets step times
(Placement.predicted_step) and each placement's own reason (Placement.auto_instead) change the choice."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
from jax.typing import DTypeLike

from moejax.config import ModelConfig
from moejax.offload.host_store import is_routed_expert
from moejax.offload.memory_budget import BudgetAsk, MemoryBudget, MemoryBudgetError, ModelBytes, device_budget_bytes
from moejax.offload.settings import AUTO, PlacementSettings
from moejax.placements.base import Placement
from moejax.placements.registry import load_registry
from moejax.plan.auto import PLACEMENT_WHAT_IF, what_would_change
from moejax.plan.engine_plan import EnginePlan
from moejax.plan.hardware import Profile
from moejax.plan.placement import PlacementOption, choose_placement


def budget_sizers() -> list[type[Placement]]:
    """The registry's classes that are values of the `placement` option, in its order."""
    return [cls for cls in load_registry() if cls.sizes_budgets()]


def sizer(name: str) -> type[Placement]:
    """The class that sizes placement `name`'s budgets; MemoryBudgetError naming the choices when none does."""
    found = {cls.name: cls for cls in reversed(budget_sizers())}
    if name not in found:
        raise MemoryBudgetError(f"placement must be one of {', '.join([AUTO, *sorted(found)])}; got {name!r}")
    return found[name]


def budget_memory(*, total_bytes: int, expert_bytes: int, experts_per_layer: int, moe_layers: int, top_k: int,
                  budget_bytes: int | None, placement: str = AUTO, window: int | None = None,
                  cache_slots: int | None = None, lightning: object = None, prefill_stream: bool = False
                  ) -> MemoryBudget:
    """The budget of `placement` (auto: the first of the classes auto may choose that fits, by auto_rank).
    lightning: the LightningPlan of placement 'lightning' (moejax.lightning.policy); prefill_stream: a cached
    placement's prefill passes stream whole layers."""
    model = ModelBytes(total_bytes, expert_bytes, experts_per_layer, moe_layers, top_k, budget_bytes)
    ask = BudgetAsk(window, cache_slots, lightning, prefill_stream)
    if placement == AUTO:
        for cls in sorted((c for c in budget_sizers() if c.auto_rank is not None), key=lambda c: c.auto_rank or 0):
            budget = cls.budget(model, ask, auto=True)
            if budget is not None:
                return budget
        raise MemoryBudgetError("placement auto: no placement it may choose sizes a budget here")
    cls = sizer(placement)
    if moe_layers == 0 and cls.offloads:
        raise MemoryBudgetError(f"placement {placement!r}: the model has no MoE layers to offload")
    budget = cls.budget(model, ask, auto=False)
    assert budget is not None  # asked by name, a placement sizes its budget or refuses
    return budget


def budget_for(cfg: ModelConfig, shapes: dict, settings: PlacementSettings, *, with_layout: bool = False,
               lightning: object = None) -> MemoryBudget:
    """Abstract parameter shapes + placement settings -> MemoryBudget (ValueError naming the setting or the numbers).
    with_layout: a layout spreads the weights over devices (placement auto: planned per device once it is
    resolved). lightning: placement lightning's LightningPlan (moejax.lightning.policy.resolve_plan)."""
    spread = with_layout and settings.auto
    nbytes = lambda a: int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize  # noqa: E731
    total = sum(nbytes(a) for a in shapes.values())
    experts = sum(nbytes(a) for path, a in shapes.items() if is_routed_expert(path))
    moe_layers = sum(cfg.is_moe(i) for i in range(cfg.num_layers))
    E = cfg.num_experts or 1
    try:
        budget = budget_memory(total_bytes=total, expert_bytes=experts // max(moe_layers * E, 1), experts_per_layer=E,
                               moe_layers=moe_layers, top_k=cfg.num_experts_per_tok or 1,
                               budget_bytes=None if spread else device_budget_bytes(settings.device_memory_gb),
                               placement=settings.placement, window=settings.window, cache_slots=settings.cache_slots,
                               lightning=lightning, prefill_stream=settings.prefill_experts == "stream")
    except MemoryBudgetError as e:
        raise ValueError(f"moejax.load: {e}") from None
    if spread:
        budget = dataclasses.replace(budget, reason="a layout spreads the weights over devices")  # planned per device
        # by moejax.sharding.setup once the layout is resolved
    elif with_layout:
        per_device = sizer(budget.placement).per_device
        budget = dataclasses.replace(budget, reason=budget.reason + "; budgeted as one device: " + per_device)
    return budget


def budget_at_load(cfg: ModelConfig, shapes: dict, plan: EnginePlan, dtype: DTypeLike,
                   profile: Callable[..., Profile]) -> tuple[MemoryBudget, list[str]]:
    """moejax.load's memory budget for the plan's placement settings -> (budget, the decisions made on the way).
    profile(measure=...): the hardware profile auto's choices consult (moejax.loading._profile)."""
    settings = plan.placement
    if not settings.auto:
        own = sizer(settings.placement).budget_at_load(cfg, shapes, settings, plan, dtype,
                                                       lambda: profile(measure=True))
        if own is not None:
            return own[0], [own[1]]
        return budget_for(cfg, shapes, settings, with_layout=plan.layout is not None), []
    decisions = []
    budget = budget_for(cfg, shapes, settings, with_layout=plan.layout is not None)
    if plan.layout is None:
        if budget.offloads:
            budget, text = choose_offload(cfg, shapes, settings, budget, plan, profile)
            decisions.append(text)
        for cls in budget_sizers():
            instead = cls.auto_instead(cfg, shapes, settings, budget, plan, dtype, lambda: profile())
            if instead is not None:
                budget, text = instead
                decisions.append(text)
    return budget, decisions


def choose_offload(cfg: ModelConfig, shapes: dict, settings: PlacementSettings, memory_budget: MemoryBudget,
                   plan: EnginePlan, profile: Callable[..., Profile]) -> tuple[MemoryBudget, str]:
    """placement auto, the experts not fitting: of the offloading placements auto may choose, whichever the profile
    predicts fastest when several fit (bytes decide when only one does, or when no profile is known) -> (memory
    budget, decision)."""
    feasible = [memory_budget]
    others = [c for c in budget_sizers()
              if c.auto_rank is not None and c.offloads and c.name != memory_budget.placement]
    for other in others:
        try:
            feasible.append(budget_for(cfg, shapes, dataclasses.replace(settings, placement=other.name)))
        except ValueError as e:
            return memory_budget, (f"placement auto: {memory_budget.placement} (bytes decide: {other.name} does not "
                                   f"fit: {e})")
    try:
        found = profile()
    except ValueError as e:
        return memory_budget, f"placement auto: {memory_budget.placement} by bytes alone ({e})"
    tokens = plan.workload.tokens

    def predict(p: Profile, b: MemoryBudget) -> PlacementOption:
        return sizer(b.placement).predicted_step(cfg, p, b, tokens)
    chosen, text = choose_placement(found, feasible, tokens, predict)
    changes = what_would_change(lambda p: choose_placement(p, feasible, tokens, predict)[0].placement,
                                found, chosen.placement, PLACEMENT_WHAT_IF)
    text += "\n  what would change it: " + "; ".join(changes)
    return dataclasses.replace(chosen, reason=chosen.reason + "; " + text.splitlines()[0]), text
