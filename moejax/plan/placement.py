"""Which offloading placement serves a step fastest on one device, when the memory budget leaves a choice (the experts
do not all fit, and both a streaming window and an expert cache do): predicted step times from the analytic costs
and the profile. What `placement="auto"` asks once bytes alone no longer decide. Each placement adds up the parts
(StepCosts) its own way (moejax.placements: Placement.predicted_step), per MoE layer of a prefill step of `tokens`
tokens, dense work at the profile's roofline: resident computes only, streamed hides each layer's copy behind its
compute, cached loads its misses on demand."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

from moejax.config import ModelConfig
from moejax.costs import prefill_flops
from moejax.offload.memory_budget import MemoryBudget
from moejax.plan.hardware import Profile


@dataclasses.dataclass(frozen=True)
class PlacementOption:
    placement: str
    predicted_s: float
    detail: str


@dataclasses.dataclass(frozen=True)
class StepCosts:
    """The parts of a prefill step's time every placement's prediction is made of (seconds)."""
    dense: float  # everything but the routed experts, at the profile's roofline
    per_layer: float  # one MoE layer's routed experts computing
    layer_copy: float  # one layer's routed experts copied host -> device
    moe: int  # MoE layers


def step_costs(cfg: ModelConfig, profile: Profile, memory_budget: MemoryBudget, tokens: int) -> StepCosts:
    """The parts of a step of `tokens` tokens under `memory_budget`; each placement adds them up its own way
    (moejax.placements: Placement.predicted_step)."""
    moe = max(memory_budget.moe_layers, 1)
    E, k = max(cfg.num_experts, 1), max(cfg.num_experts_per_tok, 1)
    flops = prefill_flops(cfg, 1, tokens, all_logits=False)
    dense = profile.device.op_time(flops.total - flops.experts, memory_budget.resident_bytes, "matmul", tokens)
    per_layer = profile.device.op_time(flops.experts / moe, memory_budget.layer_expert_bytes, "grouped",
                                       tokens * k / E)
    return StepCosts(dense, per_layer, profile.h2d.time(memory_budget.layer_expert_bytes), moe)


def choose_placement(profile: Profile, plans: list[MemoryBudget], tokens: int,
                     predict: Callable[[Profile, MemoryBudget], PlacementOption]) -> tuple[MemoryBudget, str]:
    """plans: the feasible MemoryBudgets; predict: a budget's step time on a profile (its placement's
    predicted_step) -> (the fastest, the decision as text)."""
    options = sorted(((predict(profile, p), p) for p in plans), key=lambda o: o[0].predicted_s)
    best = options[0][0]
    lines = [f"placement auto: {best.placement} predicted {tokens / best.predicted_s:,.0f} tokens/s for steps of "
             f"{tokens} tokens on profile {profile.name} ({profile.source}): {best.detail}"]
    lines += [f"  {o.placement}: {tokens / o.predicted_s:,.0f} tokens/s ({o.detail})" for o, _ in options[1:]]
    return options[0][1], "\n".join(lines)
