"""Speculating Experts' Eq. 1 (arXiv 2603.19289, §5.1): the time per output token (TPOT) of an offloaded decode
from its compute time and the time of its expert copies, per placement.

With the experts loaded on demand (after routing) every copy is on the critical path:
    TPOT_on-demand = compute + copy.
Prefetching overlaps copies with compute; copies still run one after another (one copy engine) and so does compute,
so the TPOT improvement is at most min(compute, copy) (Eq. 1) and no schedule gets below
    TPOT_overlapped = max(compute, copy).
compute is one decode step with every expert already on the device (attention, routing and the experts' FFN of all
layers); copy = experts copied per step x bytes per expert / copy bandwidth. Per placement:
- resident: no copies; TPOT = compute.
- cached: the experts that missed the cache (and those prefetched) are copied; on demand without a predictor,
  with prefetch toward the overlapped bound.
- streamed: every expert of every MoE layer is copied each step, a window of layers ahead: overlapped.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class TpotBound:
    """Eq. 1 for one placement: seconds per output token."""
    placement: str
    compute_s: float  # one decode step, every expert on the device
    copy_s: float  # the step's expert copies, one after another
    experts_copied: float  # per step, over all MoE layers

    @property
    def on_demand_s(self) -> float:
        """TPOT with every copy on the critical path."""
        return self.compute_s + self.copy_s

    @property
    def overlapped_s(self) -> float:
        """The least TPOT any overlap of copies with compute reaches (Eq. 1)."""
        return max(self.compute_s, self.copy_s)

    @property
    def saving_s(self) -> float:
        """Eq. 1: what overlapping can save at most, on_demand_s - overlapped_s."""
        return min(self.compute_s, self.copy_s)

    def as_dict(self) -> dict[str, float | str]:
        return dict(placement=self.placement, compute_s=self.compute_s, copy_s=self.copy_s,
                    experts_copied=self.experts_copied, on_demand_s=self.on_demand_s,
                    overlapped_s=self.overlapped_s, saving_s=self.saving_s)


def misses_per_layer(hit_rate: float, top_k: int, batch: int = 1) -> float:
    """Experts copied per MoE layer and step at this hit rate, with batch x top_k distinct experts wanted (small
    batches: the tokens rarely share experts)."""
    if not 0.0 <= hit_rate <= 1.0:
        raise ValueError(f"hit_rate must be in [0, 1], got {hit_rate}")
    return (1.0 - hit_rate) * top_k * batch


def tpot_bounds(compute_s: float | Sequence[float], expert_bytes: int, copy_bytes_per_s: float, moe_layers: int,
                experts_per_layer: int, copied_per_layer: float | Sequence[float]) -> dict[str, TpotBound]:
    """Eq. 1 per placement (resident, cached, streamed).

    compute_s: one decode step with every expert on the device, or its time per layer (summed); expert_bytes: one
    expert's weights; copy_bytes_per_s: host -> device bandwidth of copying one expert; copied_per_layer: experts
    the cached placement copies per MoE layer and step (misses and prefetches; misses_per_layer from a hit rate),
    one number for every layer or one per MoE layer."""
    compute = float(compute_s) if isinstance(compute_s, int | float) else float(sum(compute_s))
    if compute < 0 or expert_bytes <= 0 or copy_bytes_per_s <= 0 or moe_layers <= 0 or experts_per_layer <= 0:
        raise ValueError("tpot_bounds: compute_s must be >= 0; expert_bytes, copy_bytes_per_s, moe_layers and "
                         "experts_per_layer > 0")
    if isinstance(copied_per_layer, int | float):
        cached = float(copied_per_layer) * moe_layers
    elif len(copied_per_layer) != moe_layers:
        raise ValueError(f"tpot_bounds: {len(copied_per_layer)} copied_per_layer values for {moe_layers} MoE layers")
    else:
        cached = float(sum(copied_per_layer))
    per_expert = expert_bytes / copy_bytes_per_s
    streamed = float(moe_layers * experts_per_layer)
    return {"resident": TpotBound("resident", compute, 0.0, 0.0),
            "cached": TpotBound("cached", compute, cached * per_expert, cached),
            "streamed": TpotBound("streamed", compute, streamed * per_expert, streamed)}
