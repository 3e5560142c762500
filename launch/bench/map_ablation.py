"""fMoE §6.5-6.6 on held-out traces (`launch.bench predictors`): the expert-map ablation Map (T) / Map (T+S) /
Map (T+S+δ), and Fig. 12a's coarse "Hit count" (request-level expert hit counts, MoE-Infinity's; when the
calibration traces are at hand: moejax.offload.predict.hit_counts) (recall, set size, expert-cache hit rate and bytes
with each prefetching) and the store capacity (maps kept, bytes, mean semantic and trajectory similarity scores
found, recall and hit rate of T+S+δ).

A smaller store is the given store's maps added in order into an empty store of that capacity (its §4.4
deduplication decides what stays), which is what building it from the same prompts would keep."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from moejax.offload.layered_steps import LayeredSteps
from moejax.offload.predict import replay
from moejax.offload.predict.cache_replay import replay_cache
from moejax.offload.predict.expert_maps import ExpertMapStore, gate_probabilities, replay_predictions
from moejax.offload.predict.hit_counts import replay_hit_counts
from moejax.offload.predict.traces import Traces

VARIANTS = {"T": dict(semantic=False, adaptive=False), "T+S": dict(semantic=True, adaptive=False),
            "T+S+δ": dict(semantic=True, adaptive=True)}


def _sources(moe: list[int]) -> dict[int, int]:
    """Target layer -> the layer its map prediction is made at (the first layer's, semantic, before it runs)."""
    return {moe[t]: moe[max(t - 1, 0)] for t in range(len(moe))}


def _cache_rows(truth_head: list[np.ndarray], moe: list[int], predicted: dict[int, tuple], n: int,
                slot_counts: list[int], expert_bytes: int) -> list[dict]:
    cut = {t: (i[:n], w[:n]) for t, (i, w) in predicted.items()}
    rows = []
    for policy in ("lru", "priority"):
        for slots in slot_counts:
            r = replay_cache(truth_head, moe, slots, policy, predicted=cut, distance=1, sources=_sources(moe),
                             expert_bytes=expert_bytes)
            rows.append(dict(policy=policy, slots=slots, hit_rate=r["hit_rate"], bytes_moved=r["bytes_moved"]))
    return rows


def resized(store: ExpertMapStore, capacity: int) -> ExpertMapStore:
    out = ExpertMapStore.empty(capacity, store.distance, store.maps.shape[1], store.maps.shape[2],
                               store.embeddings.shape[1])
    for e, g in zip(store.embeddings, store.maps, strict=True):
        out.add(e, g)
    return out


def similarity_scores(store: ExpertMapStore, traces: Traces, embed_table: np.ndarray, tokens: int) -> dict:
    """Mean best semantic score over the held-out prompts; mean best trajectory score over the first `tokens`
    tokens at every MoE layer a trajectory search runs at (the first M - d)."""
    sem = [store.semantic(embed_table[traces.tokens[traces.starts[r]:traces.starts[r + 1]]].mean(axis=0))[1]
           for r in range(traces.num_prompts)]
    probs = gate_probabilities(traces.router_logits[:tokens])
    M = probs.shape[1]
    traj = [store.trajectory(probs[n, :j + 1])[1] for n in range(len(probs)) for j in range(M - store.distance)]
    return dict(semantic_score=float(np.mean(sem)), trajectory_score=float(np.mean(traj)) if traj else None)


def map_ablation(store: ExpertMapStore, traces: Traces, embed_table: np.ndarray, steps: LayeredSteps,
                 truth: list[tuple[np.ndarray, np.ndarray]], *, slot_counts: list[int],
                 cache_tokens: int, expert_bytes: int, capacities: list[int], log: Callable[[str], None],
                 hit_counts: np.ndarray | None = None) -> dict:
    """hit_counts: the calibration requests' hit-count matrices [R, M, E] (hit_counts.request_counts), or None
    (maps loaded from a file: no traces to count)."""
    k = truth[0][0].shape[1]
    n = min(cache_tokens, len(traces.tokens))
    head = [idx[:n] for idx, _ in truth]
    moe = traces.moe_layers
    variants = []
    for name, switches in VARIANTS.items():
        predicted, set_size = replay_predictions(store, traces, embed_table, k, **switches)
        r = replay.recall_by_layer(steps, None, traces, truth, predicted)
        cache = _cache_rows(head, moe, predicted, n, slot_counts, expert_bytes)
        variants.append(dict(variant=name, **switches, recall=r["overall"],
                             per_layer={str(t): v for t, v in r["per_layer"].items()}, set_size=set_size,
                             cache=cache))
        log(f"  expert maps {name:6s}: recall {r['overall']:.3f} ({set_size:.1f} experts a set), hit rate " +
            " ".join(f"{c['policy']}/{c['slots']}={c['hit_rate']:.3f}" for c in cache))
    if hit_counts is not None:
        predicted, set_size = replay_hit_counts(hit_counts, traces, k, store.distance)
        r = replay.recall_by_layer(steps, None, traces, truth, predicted)
        cache = _cache_rows(head, moe, predicted, n, slot_counts, expert_bytes)
        variants.append(dict(variant="Hit count", tracking="request-level expert hit counts (MoE-Infinity)",
                             requests=int(len(hit_counts)), recall=r["overall"],
                             per_layer={str(t): v for t, v in r["per_layer"].items()}, set_size=set_size,
                             cache=cache))
        log(f"  hit count        : recall {r['overall']:.3f} ({set_size:.1f} experts a set), hit rate " +
            " ".join(f"{c['policy']}/{c['slots']}={c['hit_rate']:.3f}" for c in cache))
    sizes = []
    middle = slot_counts[len(slot_counts) // 2]
    for capacity in sorted(set(min(c, len(store)) for c in capacities)):
        small = resized(store, capacity)
        predicted, set_size = replay_predictions(small, traces, embed_table, k)
        r = replay.recall_by_layer(steps, None, traces, truth, predicted)
        lru = _cache_rows(head, moe, predicted, n, [middle], expert_bytes)[0]
        sizes.append(dict(capacity=capacity, maps=len(small), bytes=int(small.maps.nbytes + small.embeddings.nbytes),
                          **similarity_scores(small, traces, embed_table, min(n, 256)), recall=r["overall"],
                          set_size=set_size, lru_slots=middle, lru_hit_rate=lru["hit_rate"]))
        log(f"  expert maps capacity {capacity:5d}: {sizes[-1]['bytes'] / 1024:8.1f} KiB, semantic "
            f"{sizes[-1]['semantic_score']:.3f}, trajectory {sizes[-1]['trajectory_score']:.3f}, recall "
            f"{r['overall']:.3f}, lru/{middle} hit rate {lru['hit_rate']:.3f}")
    return dict(distance=store.distance, tokens=int(len(traces.tokens)), cache_tokens=n, variants=variants,
                store_sizes=sizes, note=__doc__)
