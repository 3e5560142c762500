"""Request-level expert hit counts, the coarse pattern fMoE's Fig. 12a sets its expert maps against ("Hit count",
MoE-Infinity's expert activation matrices; fMoE: Fine-Grained Expert Offloading for Large Mixture-of-Experts
Serving, arXiv 2502.05370, §6.5): per served request one matrix [MoE layers, experts] of how many of its tokens
each expert took (top-k selections, probabilities dropped). A new request's matrix so far (its earlier tokens, and
the current token up to the layer it has reached) is matched to the most similar stored one by cosine, and the k
experts that request used most at the layer d ahead are predicted.

Replayed on recorded traces as batch-1 decode iterations (`replay_hit_counts`), beside the expert maps' own
ablation rows (launch/bench/map_ablation.py), so the three trackings are compared on the same held-out tokens."""
from __future__ import annotations

import numpy as np

from moejax.offload.predict.traces import Traces


def top_k_hits(router_logits: np.ndarray, k: int) -> np.ndarray:
    """Router logits [N, M, E] -> each token's top-k selections as 0/1 [N, M, E] (float64)."""
    top = np.argpartition(-router_logits, k - 1, axis=-1)[..., :k]
    hits = np.zeros(router_logits.shape, np.float64)
    np.put_along_axis(hits, top, 1.0, axis=-1)
    return hits


def request_counts(traces: Traces, k: int) -> np.ndarray:
    """One hit-count matrix per traced request (its prompt and generated tokens): [R, M, E]."""
    hits = top_k_hits(traces.router_logits, k)
    return np.stack([hits[traces.starts[r]:traces.starts[r + 1]].sum(axis=0) for r in range(traces.num_prompts)])


def _earlier(hits: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Each token's request's counts over its earlier tokens [N, M, E] (an exclusive running sum per request)."""
    out = np.zeros_like(hits)
    for r in range(len(starts) - 1):
        a, b = int(starts[r]), int(starts[r + 1])
        out[a + 1:b] = np.cumsum(hits[a:b - 1], axis=0)
    return out


def replay_hit_counts(stored: np.ndarray, traces: Traces, k: int, distance: int = 1
                      ) -> tuple[dict[int, tuple[np.ndarray, np.ndarray]], float]:
    """Predictions for every traced token from the stored matrices [C, M, E], as expert_maps.replay_predictions
    gives them: ({target layer: (ids [N, E] padded with -1, count shares [N, E])}, experts per set). At MoE layer
    j the token's observation is its request's earlier counts plus its own selections at layers <= j, predicting
    layer j + distance; the first `distance` layers are predicted from the earlier counts alone (none for a
    request's first token)."""
    N, M, E = traces.router_logits.shape
    C = len(stored)
    hits = top_k_hits(traces.router_logits, k)
    prior = _earlier(hits, traces.starts)
    S = stored.astype(np.float64)
    s2 = (S.reshape(C, -1) ** 2).sum(axis=1)  # [C]
    base = prior.reshape(N, -1) @ S.reshape(C, -1).T  # [N, C]
    base2 = (prior.reshape(N, -1) ** 2).sum(axis=1)  # [N]
    # through layer j: the token's own selections added to the earlier counts
    dots = base[:, None, :] + np.cumsum(np.einsum("nje,cje->njc", hits, S), axis=1)  # [N, M, C]
    norm2 = base2[:, None] + np.cumsum(2 * (prior * hits).sum(-1) + (hits ** 2).sum(-1), axis=1)  # [N, M]
    ids = {t: np.full((N, E), -1, np.int32) for t in range(M)}
    shares = {t: np.zeros((N, E), np.float32) for t in range(M)}

    def predict(rows: np.ndarray, scores: np.ndarray, target: int) -> None:
        best = np.argmax(scores, axis=1)
        counts = S[best, target]  # [n, E]
        chosen = np.argsort(-counts, axis=1, kind="stable")[:, :k]
        ids[target][rows, :k] = chosen
        shares[target][rows, :k] = np.take_along_axis(counts, chosen, axis=1) / np.maximum(
            counts.sum(axis=1, keepdims=True), 1)

    seen = base2 > 0  # the request has earlier tokens: its counts can be matched before any layer runs
    for t in range(min(distance, M)):
        if seen.any():
            predict(np.flatnonzero(seen), base[seen] / np.sqrt(base2[seen, None] * s2[None, :]), t)
    for j in range(M - distance):
        scores = dots[:, j] / np.sqrt(np.maximum(norm2[:, j, None] * s2[None, :], 1e-12))
        predict(np.arange(N), scores, j + distance)
    out = {traces.moe_layers[t]: (ids[t], shares[t]) for t in range(M) if (ids[t] >= 0).any()}
    return out, float(k)
