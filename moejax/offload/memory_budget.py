"""Device memory budgeting for one GPU: from a budget (`device_memory_gb`), decide where routed experts live and
how big the streaming window or the expert cache is, or refuse with the numbers. Everything that is not a
routed expert (embeddings, attention, norms, routers, shared experts) is always resident; a fraction of the
budget is kept for activations and KV caches. A model that fits entirely stays resident unless told otherwise.

What differs per placement (how many expert bytes it keeps on the device, how it says so, whether it offloads,
how it sizes a budget) is asked of the placement (moejax.placements), which implements BudgetRules; this module
holds what every budget shares: the model's bytes (ModelBytes), what was asked (BudgetAsk) and the result."""
from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax

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


class BudgetRules(Protocol):
    """What a MemoryBudget asks of its placement (the placement classes of moejax.placements that size budgets)."""

    @property
    def name(self) -> str:
        """The placement, as the `placement` option names it."""
        ...

    @property
    def offloads(self) -> bool:
        """Whether routed experts live in host memory (all or a share of them)."""
        ...

    def expert_device_bytes(self, budget: MemoryBudget) -> int:
        """The routed experts' bytes on the device under `budget`."""
        ...

    def describe_experts(self, budget: MemoryBudget) -> str:
        """Where the experts live under `budget`, for MemoryBudget.describe."""
        ...


@dataclasses.dataclass(frozen=True)
class MemoryBudget:
    rules: BudgetRules  # the placement that sized it
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
    kv_row_tokens: int | None = None  # lightning: the KV tokens per row its policy was sized for (plan seq + gen)

    @property
    def placement(self) -> str:
        return self.rules.name

    @property
    def layer_expert_bytes(self) -> int:
        return self.expert_bytes * self.experts_per_layer

    @property
    def expert_device_bytes(self) -> int:
        return self.rules.expert_device_bytes(self)

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
        """Whether routed experts live in host memory (streamed, cached, lightning)."""
        return self.rules.offloads

    def describe(self) -> str:
        budget = "no cap" if self.budget_bytes is None else size(self.budget_bytes)
        what = self.rules.describe_experts(self)
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


@dataclasses.dataclass(frozen=True)
class ModelBytes:
    """The bytes a budget divides: the model's weights, its routed experts and the device's cap (None: no cap)."""
    total_bytes: int
    expert_bytes: int  # one routed expert of one layer
    experts_per_layer: int
    moe_layers: int
    top_k: int
    budget_bytes: int | None

    @property
    def all_experts(self) -> int:
        return self.expert_bytes * self.experts_per_layer * self.moe_layers

    @property
    def layer_bytes(self) -> int:
        return self.expert_bytes * self.experts_per_layer

    @property
    def resident(self) -> int:
        """Weights that never move."""
        return self.total_bytes - self.all_experts

    @property
    def reserve(self) -> int:
        return 0 if self.budget_bytes is None else int(RESERVE_FRACTION * self.budget_bytes)

    def fields(self) -> dict[str, Any]:
        """MemoryBudget's fields these bytes decide."""
        return dict(budget_bytes=self.budget_bytes, resident_bytes=self.resident, expert_bytes=self.expert_bytes,
                    experts_per_layer=self.experts_per_layer, moe_layers=self.moe_layers, reserve_bytes=self.reserve)

    def free(self) -> int:
        """Bytes left for routed experts under the cap (which there is); MemoryBudgetError when not even the
        resident weights and the reserve fit."""
        assert self.budget_bytes is not None
        free = self.budget_bytes - self.reserve - self.resident
        if free < 0:
            raise MemoryBudgetError(f"cannot fit: the weights that always stay on the device ({size(self.resident)}) "
                                    f"plus the reserve ({size(self.reserve)}) exceed the budget of "
                                    f"{size(self.budget_bytes)}")
        return free

    def fits(self) -> str:
        """How free() is reckoned, for messages."""
        assert self.budget_bytes is not None
        return (f"budget {size(self.budget_bytes)} - reserve {size(self.reserve)} - resident weights "
                f"{size(self.resident)}")


@dataclasses.dataclass(frozen=True)
class BudgetAsk:
    """What the settings ask of a budget (None: the placement's rules decide). lightning: placement lightning's
    LightningPlan (moejax.lightning.policy); prefill_stream: a cached placement's prefill passes stream whole layers
    (PREFILL_STREAM_LAYERS of them beside the slots)."""
    window: int | None = None
    cache_slots: int | None = None
    lightning: Any = None
    prefill_stream: bool = False
