"""Predictors built on the distilled estimator (Speculating Experts §6.3):

- `estimator` (Est-PF): at every MoE layer l, the estimator's logits for layer l + d from the quasi-hidden state,
  routed as layer l + d's router would route them (its correction bias included).
- `hybrid` (Hybrid-PF): the estimator for the target layers where the router predictor's held-out recall fell
  below the threshold chosen at distillation (saved with the estimator as `hybrid_layers`), the router
  predictor (quasi-hidden state through the true router) everywhere else."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from moejax.offload.layered_steps import LayeredSteps
from moejax.offload.predict import estimator as est
from moejax.offload.predict.layer_ops import quasi_hidden, route_logits
from moejax.offload.predict.protocol import Arrays, Prediction
from moejax.offload.predict.router import RouterPredictor


@functools.partial(jax.jit, static_argnames=("source",))
def _logits(params: dict, q: jax.Array, *, source: int) -> jax.Array:
    return est.apply(params, q, jnp.full((q.shape[0],), source, jnp.int32))


class EstimatorPredictor:
    def __init__(self, net: est.EstimatorNet):
        self.net, self.distance = net, net.shape.distance
        self._vectors = jnp.asarray(net.vectors.vectors)

    def begin_pass(self, steps: LayeredSteps) -> None:
        self._steps = steps
        if self._vectors.shape[0] != len(steps.layers):
            raise ValueError(f"estimator: its default vectors cover {self._vectors.shape[0]} layers, the model has "
                             f"{len(steps.layers)}")

    def target(self, layer: int) -> int | None:
        moe = self._steps.moe_layers
        j = moe.index(layer)
        return moe[j + self.distance] if j + self.distance < len(moe) else None

    def predict(self, pass_no: int, layer: int, x: Arrays, y: Arrays, idx: Arrays, weights: Arrays) -> Prediction:
        target = self.target(layer)
        if target is None:
            return {}
        moe = self._steps.moe_layers
        j = moe.index(layer)
        x2 = x.reshape(-1, x.shape[-1])
        q = self._steps.layers[moe[j + 1]](quasi_hidden, x2, self._vectors[layer], idx, weights)
        return {target: self._steps.layers[target](route_logits, _logits(self.net.params, q, source=j))}

    def describe(self) -> str:
        return f"estimator (distilled, distance {self.distance})"


class HybridPredictor:
    def __init__(self, net: est.EstimatorNet):
        if "hybrid_layers" not in net.info:
            raise ValueError("hybrid predictor: the estimator holds no hybrid_layers (distil it with launch.distill)")
        self.estimator = EstimatorPredictor(net)
        self.router = RouterPredictor(net.vectors, net.shape.distance)
        self.distance, self.estimator_targets = net.shape.distance, set(net.info["hybrid_layers"])

    def begin_pass(self, steps: LayeredSteps) -> None:
        self.estimator.begin_pass(steps)
        self.router.begin_pass(steps)

    def predict(self, pass_no: int, layer: int, x: Arrays, y: Arrays, idx: Arrays, weights: Arrays) -> Prediction:
        use = self.estimator if self.estimator.target(layer) in self.estimator_targets else self.router
        return use.predict(pass_no, layer, x, y, idx, weights)

    def describe(self) -> str:
        return (f"hybrid (estimator for target layers {sorted(self.estimator_targets)}, router elsewhere, "
                f"distance {self.distance})")
