"""Speculating Experts' analyses over routing traces, per prefetch distance d (in MoE layers) and target MoE layer:

- cosine drift (Fig. 3): the mean cosine similarity between the representation a predictor builds at MoE layer l
  for layer l + d and layer l + d's true router input y_{l+d} = norm_{l+d}(r_{l+d}). "previous_hidden" is
  y_l itself (§3.3's baseline), "quasi_hidden" the router predictor's state norm_{l+d}(r_l + Σ g·d), chained
  through the predicted routing of the layers in between as `RouterPredictor` chains it; d = 0 is y_l against
  itself.
- rank alignment (Fig. 5): the predicted router scores (layer l + d's router on the representation) against the
  true ones: the mean per-token Spearman correlation over all experts, and the hit rate by rank, the share of
  tokens whose true rank-r expert (by the true routing weight) is in the predicted top-k. The mean of the hit
  rates over ranks is the recall of `replay.recall`."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.offload.layered_steps import LayeredSteps
from moejax.offload.predict.layer_ops import mlp_norm, route_logits
from moejax.offload.predict.router import DefaultVectors, _hop
from moejax.offload.predict.traces import Traces

_f32 = jnp.float32


def _router_scores(graphdef: nnx.GraphDef, state: nnx.State, y: jax.Array) -> jax.Array:
    """This MoE layer's router logits on router inputs y [N, D] -> [N, E] float32."""
    return nnx.merge(graphdef, state).mlp.router_logits(y.astype(_f32))


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity of [N, D] arrays -> [N]."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    norms = np.maximum(np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1), 1e-30)
    return (a * b).sum(-1) / norms


def spearman(predicted: np.ndarray, true: np.ndarray) -> np.ndarray:
    """Per-row Spearman rank correlation of scores [N, E] (ties broken by position) -> [N]."""
    rank = lambda s: np.argsort(np.argsort(np.asarray(s), axis=-1, kind="stable"), axis=-1)  # noqa: E731
    return cosine(*(r - (r.shape[-1] - 1) / 2 for r in (rank(predicted), rank(true))))


def hit_rate_by_rank(predicted_idx: np.ndarray, true_idx: np.ndarray, true_weights: np.ndarray) -> np.ndarray:
    """predicted expert ids [N, k'], the true ids and weights [N, k] -> [k]: for r = 1..k, the share of rows whose
    r-th heaviest true expert is among the predicted ones."""
    order = np.argsort(-np.asarray(true_weights), axis=-1, kind="stable")
    ranked = np.take_along_axis(np.asarray(true_idx), order, axis=-1)
    return np.any(ranked[:, :, None] == np.asarray(predicted_idx)[:, None, :], axis=2).mean(axis=0)


class _Sums:
    """Running sums of each (representation, distance, target layer)'s cosine, Spearman and hits by rank."""

    def __init__(self) -> None:
        self.rows: dict[tuple[str, int, int], dict] = {}

    def add(self, key: tuple[str, int, int], cos: np.ndarray, rho: np.ndarray, hits: np.ndarray) -> None:
        s = self.rows.setdefault(key, dict(n=0, cos=0.0, rho=0.0, hits=0.0))
        s["n"] += len(cos)
        s["cos"] += float(cos.sum())
        s["rho"] += float(rho.sum())
        s["hits"] = s["hits"] + hits * len(cos)

    def summary(self) -> dict:
        drift, alignment = [], []
        for rep, d in sorted({(r, d) for r, d, _ in self.rows}, key=lambda x: (x[1], x[0])):
            layers = {t: s for (r, dd, t), s in sorted(self.rows.items()) if (r, dd) == (rep, d)}
            cos = {str(t): s["cos"] / s["n"] for t, s in layers.items()}
            rho = {str(t): s["rho"] / s["n"] for t, s in layers.items()}
            hits = {str(t): (s["hits"] / s["n"]).tolist() for t, s in layers.items()}
            mean = lambda v: float(np.mean(list(v.values())))  # noqa: E731 (equal tokens per target layer)
            drift.append(dict(representation=rep, distance=d, mean=mean(cos), per_layer=cos))
            alignment.append(dict(representation=rep, distance=d, spearman=mean(rho), per_layer_spearman=rho,
                                  hit_rate_by_rank=np.mean(list(hits.values()), axis=0).tolist(),
                                  per_layer_hit_rate_by_rank=hits))
        return dict(cosine_drift=drift, rank_alignment=alignment)


def drift_and_alignment(steps: LayeredSteps, traces: Traces, vectors: DefaultVectors,
                        truth: list[tuple[np.ndarray, np.ndarray]], max_distance: int, chunk: int = 4096) -> dict:
    """-> {"cosine_drift": [{representation, distance, mean, per_layer}], "rank_alignment": [{representation,
    distance, spearman, per_layer_spearman, hit_rate_by_rank, per_layer_hit_rate_by_rank}]} for d = 0 ("true":
    each layer's own router input and router) and d = 1..max_distance (previous_hidden, quasi_hidden)."""
    moe, M = traces.moe_layers, len(traces.moe_layers)
    if max_distance < 0:
        raise ValueError(f"analyses: max_distance must be >= 0, got {max_distance}")
    sums = _Sums()
    device_vectors = jnp.asarray(vectors.vectors)
    for s in range(0, len(traces.tokens), chunk):
        rows = slice(s, s + chunk)
        y = [np.asarray(steps.layers[layer](mlp_norm, traces.residual[rows, m])) for m, layer in enumerate(moe)]
        true_logits = traces.router_logits[rows]
        true = [(idx[rows], w[rows]) for idx, w in truth]

        # measure reads this chunk's y, true_logits and true, and is called only within this chunk's iteration
        def measure(rep: str, m: int, d: int, q: np.ndarray, logits: np.ndarray) -> None:
            t = m + d
            p_idx, _ = steps.layers[moe[t]](route_logits, logits)
            sums.add((rep, d, moe[t]), cosine(q, y[t]), spearman(logits, true_logits[:, t]),  # noqa: B023
                     hit_rate_by_rank(np.asarray(p_idx), *true[t]))  # noqa: B023

        for m in range(M):
            measure("true", m, 0, y[m], true_logits[:, m])
            h, idx, weights = jnp.asarray(traces.residual[rows, m], _f32), jnp.asarray(true[m][0]), \
                jnp.asarray(true[m][1])
            for d in range(1, min(max_distance, M - 1 - m) + 1):
                target, prev = moe[m + d], moe[m + d - 1]
                previous = np.asarray(steps.layers[target](_router_scores, jnp.asarray(y[m])))
                measure("previous_hidden", m, d, y[m], previous)
                h, idx, weights = steps.layers[target](_hop, h, device_vectors[prev], idx, weights)
                q = np.asarray(steps.layers[target](mlp_norm, h))
                measure("quasi_hidden", m, d, q, np.asarray(steps.layers[target](_router_scores, jnp.asarray(q))))
    return sums.summary()
