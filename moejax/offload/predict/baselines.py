"""The previous-hidden baseline (Speculating Experts §3.3): MoE layer l's normalized router input y_l, fed as it
is to the router of MoE layer l + d. No default vectors, no training: what the quasi-hidden state must beat."""
from __future__ import annotations

from moejax.offload.layered_steps import LayeredSteps
from moejax.offload.predict.layer_ops import route_input
from moejax.offload.predict.protocol import Arrays, Prediction


class PreviousHiddenPredictor:
    def __init__(self, distance: int = 1):
        if distance < 1:
            raise ValueError(f"previous_hidden predictor: distance must be >= 1, got {distance}")
        self.distance = int(distance)

    def begin_pass(self, steps: LayeredSteps) -> None:
        self._steps = steps

    def predict(self, pass_no: int, layer: int, x: Arrays, y: Arrays, idx: Arrays, weights: Arrays) -> Prediction:
        moe = self._steps.moe_layers
        j = moe.index(layer) + self.distance
        if j >= len(moe):
            return {}
        return {moe[j]: self._steps.layers[moe[j]](route_input, y)}

    def describe(self) -> str:
        return f"previous_hidden (layer l's router input to layer l+d's router, distance {self.distance})"
