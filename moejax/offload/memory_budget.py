"""Device memory budgeting for one GPU: from a budget (`device_memory_gb`), decide where routed experts live and
how big the streaming window or the expert cache is, or refuse with the numbers. Everything that is not a
routed expert (embeddings, attention, norms, routers, shared experts) is always resident; a fraction of the
budget is kept for activations and KV caches. A model that fits entirely stays resident unless told otherwise."""
from __future__ import annotations

import dataclasses
from typing import Any, overload

import jax

PLACEMENTS = ("auto", "resident", "streamed", "cached", "lightning")
OFFLOADED = ("streamed", "cached", "lightning")  # the experts live in host memory (lightning: a share of them)
RESERVE_FRACTION = 0.1  # of the budget, for activations, KV cache and XLA workspace
DEFAULT_WINDOW = 2  # layers in flight beyond the computing one: more only costs memory once copies are hidden
# a streamed prefill pass holds the layer computing, the next on its way and the layer's stack for the FFN
PREFILL_STREAM_LAYERS = 3
MIN_PASS_EXPERTS = 16  # experts stacked per pass of the cached FFN (at least top-k)


class MemoryBudgetError(ValueError):
    pass


def size(nbytes: float) -> str:
    """Bytes for people: 1.50 GiB, 12.0 MiB, 3.2 KiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{int(nbytes)} B"


@dataclasses.dataclass(frozen=True)
class MemoryBudget:
    placement: str
    budget_bytes: int | None
    resident_bytes: int  # weights that never move
    expert_bytes: int  # one routed expert of one layer
    experts_per_layer: int
    moe_layers: int
    reserve_bytes: int
    window: int | None = None  # streamed
    cache_slots: int | None = None  # cached
    pass_experts: int | None = None  # cached: experts stacked per FFN pass (a transient copy)
    prefill_stream: bool = False  # cached: prefill passes stream whole layers (PREFILL_STREAM_LAYERS at once)
    reason: str = ""
    lightning: Any = None  # lightning: its moejax.lightning.policy.LightningPlan

    @property
    def layer_expert_bytes(self) -> int:
        return self.expert_bytes * self.experts_per_layer

    @property
    def expert_device_bytes(self) -> int:
        if self.placement == "streamed":
            assert self.window is not None  # a streamed budget has its window
            return (self.window + 1) * self.layer_expert_bytes
        if self.placement == "cached":
            assert self.cache_slots is not None and self.pass_experts is not None  # a cached budget has its slots
            return (self.cache_slots + self.transient_experts) * self.expert_bytes
        if self.placement == "lightning":
            return lightning_expert_bytes(self.lightning.r_w, self.expert_bytes, self.experts_per_layer,
                                          self.moe_layers)
        return self.moe_layers * self.layer_expert_bytes

    @property
    def transient_experts(self) -> int:
        """cached: experts held beside the slots for one step: a pass's stack, or a streamed prefill's layers."""
        assert self.pass_experts is not None  # a cached budget's
        stream = PREFILL_STREAM_LAYERS * self.experts_per_layer if self.prefill_stream else 0
        return max(self.pass_experts, stream)

    @property
    def device_bytes(self) -> int:
        return self.resident_bytes + self.expert_device_bytes

    @property
    def offloads(self) -> bool:
        """Whether routed experts live in host memory (streamed or cached)."""
        return self.placement in OFFLOADED

    def describe(self) -> str:
        budget = "no cap" if self.budget_bytes is None else size(self.budget_bytes)
        if self.placement == "streamed":
            assert self.window is not None  # a streamed budget has its window
            what = f"window {self.window}: {self.window + 1} layers of experts on the device"
        elif self.placement == "cached":
            what = f"{self.cache_slots} expert slots + {self.pass_experts} per FFN pass"
            if self.prefill_stream:
                what += (f"; prefill streams whole layers: {PREFILL_STREAM_LAYERS} layers' experts beside the slots "
                         "(the layer, the next one on its way, the layer stacked)")
        elif self.placement == "lightning":
            what = (f"r_w = {self.lightning.r_w:.2f} of the experts resident, the rest paged: two layers' pages, "
                    "read in place through a page table")
        else:
            what = "all routed experts on the device"
        return (f"memory budget: {self.placement} ({what}); budget {budget}, reserve {size(self.reserve_bytes)}; "
                f"resident weights {size(self.resident_bytes)} + experts {size(self.expert_device_bytes)} = "
                f"{size(self.device_bytes)}; one expert {size(self.expert_bytes)}, one layer of experts "
                f"{size(self.layer_expert_bytes)} x {self.moe_layers} MoE layers\n  why: {self.reason}")


def device_budget_bytes(device_memory_gb: float | None) -> int | None:
    """The cap in bytes: the given GB, else what the first device reports (None on CPU: no cap)."""
    if device_memory_gb is not None:
        if device_memory_gb <= 0:
            raise MemoryBudgetError(f"device_memory_gb must be > 0, got {device_memory_gb}")
        return int(device_memory_gb * 2**30)
    stats = jax.devices()[0].memory_stats() if jax.default_backend() == "gpu" else None
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def budget_memory(*, total_bytes: int, expert_bytes: int, experts_per_layer: int, moe_layers: int, top_k: int,
                  budget_bytes: int | None, placement: str = "auto", window: int | None = None,
                  cache_slots: int | None = None, lightning: Any = None, prefill_stream: bool = False
                  ) -> MemoryBudget:
    """lightning: the LightningPlan of placement 'lightning' (moejax.lightning.policy); prefill_stream: a cached
    placement's prefill passes stream whole layers (PREFILL_STREAM_LAYERS of them beside the slots)."""
    if placement not in PLACEMENTS:
        raise MemoryBudgetError(f"placement must be one of {', '.join(PLACEMENTS)}; got {placement!r}")
    all_experts = expert_bytes * experts_per_layer * moe_layers
    resident = total_bytes - all_experts
    reserve = 0 if budget_bytes is None else int(RESERVE_FRACTION * budget_bytes)
    base: dict[str, Any] = dict(budget_bytes=budget_bytes, resident_bytes=resident, expert_bytes=expert_bytes,
                experts_per_layer=experts_per_layer, moe_layers=moe_layers, reserve_bytes=reserve)
    if moe_layers == 0 and placement in OFFLOADED:
        raise MemoryBudgetError(f"placement {placement!r}: the model has no MoE layers to offload")
    if placement == "lightning":
        return _lightning(base, lightning, budget_bytes, reserve, resident)
    if budget_bytes is None:
        if placement in ("auto", "resident"):
            return MemoryBudget("resident", **base, reason="no device memory cap")
        if placement == "streamed":
            return _streamed(base, window or DEFAULT_WINDOW, "no device memory cap; window as asked or default")
        slots = _every_expert_at_most(base, cache_slots or 2 * experts_per_layer)
        return _cached(base, slots, top_k, "no device memory cap; slots as asked or two layers' worth",
                       asked=cache_slots, prefill_stream=prefill_stream)
    free = budget_bytes - reserve - resident
    fits = f"budget {size(budget_bytes)} - reserve {size(reserve)} - resident weights {size(resident)}"
    if free < 0:
        raise MemoryBudgetError(f"cannot fit: the weights that always stay on the device ({size(resident)}) plus the "
                                f"reserve ({size(reserve)}) exceed the budget of {size(budget_bytes)}")
    if placement == "resident" or (placement == "auto" and all_experts <= free):
        if all_experts > free:
            raise MemoryBudgetError(f"placement 'resident': all routed experts need {size(all_experts)} but {fits} "
                                    f"leaves {size(free)}; use placement 'streamed' or 'cached'")
        return MemoryBudget("resident", **base, reason=f"the whole model fits: experts {size(all_experts)} <= "
                                                      f"{size(free)} free ({fits})")
    layer_bytes = expert_bytes * experts_per_layer
    max_window = min(free // layer_bytes - 1, moe_layers - 1)
    if placement == "streamed" or (placement == "auto" and max_window >= 1):
        if window is not None and window > max_window:
            raise MemoryBudgetError(f"streamed window {window} needs {window + 1} layers of experts = "
                                    f"{size((window + 1) * layer_bytes)} but {fits} leaves {size(free)} "
                                    f"(window {max(max_window, 0)} at most)")
        if max_window < 1:
            raise MemoryBudgetError(f"streamed placement needs 2 layers of experts ({size(2 * layer_bytes)}) on the "
                                    f"device but {fits} leaves {size(free)}; use placement 'cached' or a larger budget")
        return _streamed(base, window or min(DEFAULT_WINDOW, max_window),
                         f"experts {size(all_experts)} > {size(free)} free ({fits}); window {max_window} at most")
    pass_experts = _pass_experts(experts_per_layer, top_k)
    transient = max(pass_experts, PREFILL_STREAM_LAYERS * experts_per_layer if prefill_stream else 0)
    max_slots = min(free // expert_bytes - transient, experts_per_layer * moe_layers)
    slots = _every_expert_at_most(base, cache_slots) or max_slots
    if slots < top_k or slots > max_slots:
        per = "for a streamed prefill" if transient > pass_experts else "per pass"
        raise MemoryBudgetError(f"cached placement with {slots} slots needs ({slots} + {transient} {per}) x "
                                f"{size(expert_bytes)} but {fits} leaves {size(free)} (at most {max_slots} "
                                f"slots; at least top-k = {top_k} needed)")
    return _cached(base, slots, top_k, f"a layer of experts does not fit twice in {size(free)} free ({fits})"
                   if placement == "auto" else f"asked for; at most {max_slots} slots fit", asked=cache_slots,
                   prefill_stream=prefill_stream)


def lightning_expert_bytes(r_w: float, expert_bytes: int, experts_per_layer: int, moe_layers: int) -> int:
    """Expert bytes on the device under lightning: the resident share of every layer and the pages of two layers (the
    double buffer; the FFN reads each expert from its page, moejax.lightning.pages.paged_routed)."""
    keep = int(round(r_w * experts_per_layer))
    paged = experts_per_layer - keep
    return expert_bytes * (keep * moe_layers + 2 * paged)


def _lightning(base: dict[str, Any], plan: Any, budget_bytes: int | None, reserve: int, resident: int
               ) -> MemoryBudget:
    if plan is None:
        raise MemoryBudgetError("placement 'lightning' needs its policy (moejax.lightning.policy.resolve_plan)")
    budget = MemoryBudget("lightning", **base, lightning=plan, reason=f"policy {plan.describe()}")
    if budget_bytes is not None and budget.device_bytes > budget_bytes - reserve:
        raise MemoryBudgetError(
            f"placement 'lightning' with r_w = {plan.r_w:.2f}: resident weights {size(resident)} + experts "
            f"{size(budget.expert_device_bytes)} = {size(budget.device_bytes)} exceed the budget {size(budget_bytes)} "
            f"less the reserve {size(reserve)}; give a smaller resident_share")
    return budget


def _pass_experts(experts_per_layer: int, top_k: int) -> int:
    """Experts the cached FFN stacks per pass (before the cap by the slot count)."""
    return min(experts_per_layer, max(top_k, MIN_PASS_EXPERTS))


def _streamed(base: dict[str, Any], window: int, reason: str) -> MemoryBudget:
    if window < 1:
        raise MemoryBudgetError(f"streamed window must be >= 1, got {window}")
    return MemoryBudget("streamed", **base, window=int(window), reason=reason)


@overload
def _every_expert_at_most(base: dict[str, Any], slots: int) -> int: ...


@overload
def _every_expert_at_most(base: dict[str, Any], slots: None) -> None: ...


def _every_expert_at_most(base: dict[str, Any], slots: int | None) -> int | None:
    """More slots than the model has routed experts hold nothing more: as many as it has."""
    return slots and min(slots, base["experts_per_layer"] * base["moe_layers"])


def _cached(base: dict[str, Any], slots: int, top_k: int, reason: str, asked: int | None = None,
            prefill_stream: bool = False) -> MemoryBudget:
    if slots < top_k:
        raise MemoryBudgetError(f"cached placement needs at least top-k = {top_k} slots, got {slots}")
    if asked and asked > slots == base["experts_per_layer"] * base["moe_layers"]:
        reason += f"; {asked} slots asked, but the model has {slots} routed experts: every one has a slot"
    pass_experts = min(int(slots), _pass_experts(base["experts_per_layer"], top_k))
    return MemoryBudget("cached", **base, cache_slots=int(slots), pass_experts=pass_experts, reason=reason,
                        prefill_stream=prefill_stream)
