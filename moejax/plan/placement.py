"""Which offloading placement serves a step fastest on one device, when the memory budget leaves a choice (the experts
do not all fit, and both a streaming window and an expert cache do): predicted step times from the analytic costs
and the profile. What `placement="auto"` asks once bytes alone no longer decide.

Model for a prefill step of `tokens` tokens (per MoE layer; dense work at the profile's roofline):
  resident  compute only
  streamed  max(compute, one layer's experts host -> device): the window hides the copy behind the compute
  cached    compute + the misses loaded on demand: a step touches E·(1 - (1 - k/E)^tokens) experts of a layer
            (uniform routing), of which the cache holds slots / (E·layers) (no predictor assumed)"""
from __future__ import annotations

import dataclasses

from moejax.config import ModelConfig
from moejax.costs import prefill_flops
from moejax.plan.hardware import Profile

from moejax.offload.memory_budget import MemoryBudget


@dataclasses.dataclass(frozen=True)
class PlacementOption:
    placement: str
    predicted_s: float
    detail: str


def predict_placement(cfg: ModelConfig, profile: Profile, memory_budget: MemoryBudget, tokens: int) -> PlacementOption:
    """Predicted seconds of one step of `tokens` tokens under `memory_budget` (a MemoryBudget of any placement)."""
    moe = max(memory_budget.moe_layers, 1)
    E, k = max(cfg.num_experts, 1), max(cfg.num_experts_per_tok, 1)
    flops = prefill_flops(cfg, 1, tokens, all_logits=False)
    dense = profile.device.op_time(flops.total - flops.experts, memory_budget.resident_bytes, "matmul", tokens)
    per_layer = profile.device.op_time(flops.experts / moe, memory_budget.layer_expert_bytes, "grouped",
                                       tokens * k / E)
    layer_copy = profile.h2d.time(memory_budget.layer_expert_bytes)
    if memory_budget.placement == "resident":
        return PlacementOption("resident", dense + moe * per_layer, "compute only")
    if memory_budget.placement == "streamed":
        return PlacementOption("streamed", dense + moe * max(per_layer, layer_copy),
                               f"per MoE layer max(compute {per_layer * 1e3:.2f} ms, copy {layer_copy * 1e3:.2f} ms)")
    touched = E * (1 - (1 - k / E) ** tokens)
    assert memory_budget.cache_slots is not None  # the cached placement's budget has its slots
    held = min(1.0, memory_budget.cache_slots / (E * moe))
    loads = touched * (1 - held) * profile.h2d.time(memory_budget.expert_bytes)
    return PlacementOption("cached", dense + moe * (per_layer + loads),
                           f"per MoE layer compute {per_layer * 1e3:.2f} ms + {touched * (1 - held):.1f} misses "
                           f"loaded {loads * 1e3:.2f} ms")


def choose_placement(cfg: ModelConfig, profile: Profile, plans: list[MemoryBudget], tokens: int
                     ) -> tuple[MemoryBudget, str]:
    """plans: the feasible MemoryBudgets -> (the fastest, the decision as text)."""
    options = sorted(((predict_placement(cfg, profile, p, tokens), p) for p in plans), key=lambda o: o[0].predicted_s)
    best = options[0][0]
    lines = [f"placement auto: {best.placement} predicted {tokens / best.predicted_s:,.0f} tokens/s for steps of "
             f"{tokens} tokens on profile {profile.name} ({profile.source}): {best.detail}"]
    lines += [f"  {o.placement}: {tokens / o.predicted_s:,.0f} tokens/s ({o.detail})" for o, _ in options[1:]]
    return options[0][1], "\n".join(lines)
