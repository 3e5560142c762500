"""The oracle predictor: it "predicts" each MoE layer's experts as that layer's true router output, at distance
0. A speculative run with it must equal the resident model; its hit rate is the ceiling of any predictor."""
from __future__ import annotations

from moejax.offload.layered_steps import LayeredSteps
from moejax.offload.predict.protocol import Arrays, Prediction


class OraclePredictor:
    distance = 0

    def begin_pass(self, steps: LayeredSteps) -> None:
        pass

    def predict(self, pass_no: int, layer: int, x: Arrays, y: Arrays, idx: Arrays, weights: Arrays) -> Prediction:
        return {layer: (idx, weights)}

    def describe(self) -> str:
        return "oracle (true router, distance 0)"
