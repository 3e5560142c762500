"""The expert cache replayed over traces as batch-1 decode: token by token, each MoE layer requests its true
experts from an ExpertCache (moejax.offload.expert_cache, the bookkeeping the cached placement runs), then
prefetches what a predictor said at that layer for layer l + d (its predicted weights are the priority scores).
A token's routing in a prefill is its routing when decoded, so a prefill trace is a decode trace too."""
from __future__ import annotations

import numpy as np

from moejax.offload.expert_cache import ExpertCache


def replay_cache(truth_idx: list[np.ndarray], moe_layers: list[int], slots: int, policy: str, *,
                 predicted: dict | None = None, distance: int = 1, sources: dict | None = None,
                 expert_bytes: int = 0) -> dict:
    """truth_idx: per MoE layer, the true expert ids [N, k]; predicted: {target layer: (ids [N, k'] (-1: none),
    weights)} from replay.predictions, made at MoE layer target - distance (or at sources[target]; a prediction
    made at its own layer loads before the layer runs). -> hits, misses, prefetch loads, hit rate, bytes moved
    host -> device (misses and prefetches, expert_bytes each)."""
    cache = ExpertCache(slots, policy)
    made_at: dict[int, list] = {}  # source layer -> [(target layer, (ids, weights))]
    for target, pred in (predicted or {}).items():
        source = sources[target] if sources else moe_layers[moe_layers.index(target) - distance]
        made_at.setdefault(source, []).append((target, pred))
    loads = 0

    def prefetch(target: int, idx: np.ndarray, weights: np.ndarray) -> int:
        keep = np.asarray(idx) >= 0
        keys = [(target, int(e)) for e in np.asarray(idx)[keep]]
        got, _ = cache.prefetch(keys, dict(zip(keys, np.asarray(weights, float)[keep].tolist(), strict=True)))
        return len(got)

    for t in range(len(truth_idx[0])):
        for m, layer in enumerate(moe_layers):
            ahead = made_at.get(layer, ())
            for target, (idx, weights) in ahead:  # distance 0 (the oracle): loaded before the layer runs
                if target == layer:
                    loads += prefetch(target, idx[t], weights[t])
            cache.request([(layer, int(e)) for e in truth_idx[m][t]])
            for target, (idx, weights) in ahead:  # after the layer's work is issued, as the placement does
                if target != layer:
                    loads += prefetch(target, idx[t], weights[t])
    s = cache.stats()
    requests = s["hits"] + s["misses"]
    return dict(hits=s["hits"], misses=s["misses"], prefetch_loads=loads, hit_rate=s["hits"] / max(requests, 1),
                bytes_moved=(s["misses"] + loads) * expert_bytes)
