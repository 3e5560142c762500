"""Predictors replayed over routing traces: each MoE layer's recorded residual and true routing go through the
predictor's own `predict` (the code the cached placement runs), and what it predicts for each target layer is
compared with that layer's true top-k. Recall = the share of true (token, layer, expert) choices predicted."""
from __future__ import annotations

import numpy as np

from moejax.offload.layered_steps import LayeredSteps
from moejax.offload.predict.layer_ops import mlp_norm, route_logits
from moejax.offload.predict.protocol import Predictor, resolved
from moejax.offload.predict.router import EngineModel
from moejax.offload.predict.traces import Traces


def steps_of(engine: EngineModel) -> LayeredSteps:
    """The engine's layers as per-layer jits (no placement: predictors only call norms and routers)."""
    return LayeredSteps(engine.graphdef, engine.params, engine.kernels,
                        placement=None)  # type: ignore[arg-type]  # no MoE layer runs: no runtime


def true_routing(steps: LayeredSteps, traces: Traces, chunk: int = 8192) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per MoE layer (in order): the true (expert ids [N, k], weights [N, k]) from the recorded logits."""
    out = []
    for m, layer in enumerate(traces.moe_layers):
        parts = [steps.layers[layer](route_logits, traces.router_logits[s:s + chunk, m])
                 for s in range(0, len(traces.tokens), chunk)]
        out.append((np.concatenate([np.asarray(i) for i, _ in parts]),
                    np.concatenate([np.asarray(w) for _, w in parts])))
    return out


def predictions(steps: LayeredSteps, predictor: Predictor, traces: Traces,
                truth: list[tuple[np.ndarray, np.ndarray]] | None = None, chunk: int = 8192) -> dict[int, tuple]:
    """{target layer: (predicted expert ids [N, k], their weights [N, k])} from replaying every source MoE layer
    through `predictor`."""
    truth = truth or true_routing(steps, traces, chunk)
    predictor.begin_pass(steps)
    found: dict[int, list] = {}
    for m, layer in enumerate(traces.moe_layers):
        for s in range(0, len(traces.tokens), chunk):
            x = traces.residual[s:s + chunk, m]
            y = steps.layers[layer](mlp_norm, x)
            idx, weights = (a[s:s + chunk] for a in truth[m])
            for target, prediction in predictor.predict(0, layer, x, y, idx, weights).items():
                p_idx, p_weights = resolved(prediction)
                found.setdefault(target, []).append((np.asarray(p_idx), np.asarray(p_weights)))
    return {t: (np.concatenate([i for i, _ in parts]), np.concatenate([w for _, w in parts]))
            for t, parts in found.items()}


def recall(predicted: np.ndarray, true: np.ndarray) -> float:
    """Share of the true choices [N, k] that appear among the predicted ones [N, k']."""
    return float(np.mean(np.any(true[:, :, None] == predicted[:, None, :], axis=2)))


def recall_by_layer(steps: LayeredSteps, predictor: Predictor | None, traces: Traces,
                    truth: list[tuple[np.ndarray, np.ndarray]] | None = None,
                    predicted: dict[int, tuple] | None = None) -> dict:
    """-> {"per_layer": {target layer: recall}, "overall": recall over every predicted (token, layer)}. predictor:
    None where `predicted` holds its predictions already."""
    truth = truth or true_routing(steps, traces)
    position = {layer: m for m, layer in enumerate(traces.moe_layers)}
    if not predicted:
        assert predictor is not None, "recall_by_layer: a predictor, or its predictions"
        predicted = predictions(steps, predictor, traces, truth)
    per_layer = {t: recall(p, truth[position[t]][0]) for t, (p, _) in sorted(predicted.items())}
    overall = float(np.mean(list(per_layer.values()))) if per_layer else float("nan")  # equal tokens per layer
    return dict(per_layer=per_layer, overall=overall)
