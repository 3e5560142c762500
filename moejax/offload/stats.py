"""Counters of an offloaded placement, per MoE layer: what `Engine.stats()` reports."""
from __future__ import annotations

import dataclasses
from collections import defaultdict


@dataclasses.dataclass
class LayerStats:
    hits: int = 0  # experts (cached) or layers (streamed) already on the device or on their way when needed
    misses: int = 0  # loaded on demand, with the step waiting for them
    prefetches: int = 0  # loads started ahead of use
    bytes_h2d: int = 0  # host -> device bytes moved
    streamed_experts: int = 0  # cached, prefill="stream": experts copied in whole layers for prefill passes
    wait_s: float = 0.0  # time the step waited on transfers of this layer
    speculated_tokens: int = 0  # speculative execution: tokens run with predicted experts
    checked_tokens: int = 0  # ... checked against the true router (router-free: only with count_mispredictions)
    mispredicted_tokens: int = 0  # ... of those, whose predicted expert set differs from the true router's
    mispredicted_choices: int = 0  # predicted (token, expert) choices the true router did not make (of k per token)


class OffloadStats:
    def __init__(self) -> None:
        self.layers: dict[int, LayerStats] = defaultdict(LayerStats)

    def __getitem__(self, layer: int) -> LayerStats:
        return self.layers[layer]

    def as_dict(self, extra: dict | None = None) -> dict:
        per_layer = {layer: dataclasses.asdict(s) for layer, s in sorted(self.layers.items())}
        totals = {f.name: sum(s[f.name] for s in per_layer.values()) for f in dataclasses.fields(LayerStats)}
        looked_up = totals["hits"] + totals["misses"]
        totals["hit_rate"] = totals["hits"] / looked_up if looked_up else None
        return {"total": totals | (extra or {}), "layers": per_layer}
