"""The look-ahead oracle: at MoE layer l it gives MoE layer l+1's true experts, read from a routing trace of the
same requests recorded beforehand (`RoutingRecorder`). It has the lead time a real predictor has (distance 1) and
its predictions are never wrong: the bound any layer-ahead predictor can reach. (`OraclePredictor` predicts the
layer itself, with no lead time: it moves nothing ahead of the layer that needs it.)

A trace is keyed by the pass's number since `restart()` and the MoE layer: the same requests served the same way
(the same scheduler, pool and batch) run the same passes in the same order. A pass or layer the trace does not hold,
or one whose rows differ from the recorded pass's, gets no prediction (counted in `unmatched`); the first MoE layer
of a pass is never predicted (the token it routes is not known before the previous pass ends)."""
from __future__ import annotations

from typing import Any

from moejax.offload.layered_steps import LayeredSteps
from moejax.offload.predict.protocol import Arrays, Prediction

# (pass number since restart, MoE layer) -> the true (expert ids [N, k], weights [N, k]) as computed
RoutingTrace = dict[tuple[int, int], tuple[Any, Any]]


class RoutingRecorder:
    """A predictor that predicts nothing (the placement behaves as with none) and keeps every MoE layer's true
    routing by pass: `trace` after a run is what `LookAheadOracle` serves. Keeps the device arrays (no host sync)."""

    distance = 0

    def __init__(self) -> None:
        self.trace: RoutingTrace = {}
        self._pass = -1

    def restart(self) -> None:
        """A new run starts: pass numbers count from here, the trace so far is dropped."""
        self.trace, self._pass = {}, -1

    def begin_pass(self, steps: LayeredSteps) -> None:
        self._pass += 1

    def predict(self, pass_no: int, layer: int, x: Arrays, y: Arrays, idx: Arrays, weights: Arrays) -> Prediction:
        self.trace[(self._pass, layer)] = (idx, weights)
        return {}

    def describe(self) -> str:
        return "recorder (no prediction; keeps the true routing of each pass)"


class LookAheadOracle:
    """At MoE layer l of pass p: {layer l+1: its true (ids, weights) at pass p} from `trace` (RoutingRecorder's)."""

    distance = 1

    def __init__(self, trace: RoutingTrace | None = None) -> None:
        self.trace: RoutingTrace = dict(trace or {})
        self._pass = -1
        self._moe: list[int] = []
        self.served = self.unmatched = 0

    def restart(self, trace: RoutingTrace | None = None) -> None:
        """A new run of the recorded requests starts (optionally with a new trace): pass numbers count from here."""
        if trace is not None:
            self.trace = dict(trace)
        self._pass, self.served, self.unmatched = -1, 0, 0

    def begin_pass(self, steps: LayeredSteps) -> None:
        self._pass += 1
        self._moe = steps.moe_layers

    def predict(self, pass_no: int, layer: int, x: Arrays, y: Arrays, idx: Arrays, weights: Arrays) -> Prediction:
        j = self._moe.index(layer) + 1
        if j >= len(self._moe):
            return {}
        found = self.trace.get((self._pass, self._moe[j]))
        if found is None or found[0].shape[0] != idx.shape[0]:
            self.unmatched += 1
            return {}
        self.served += 1
        return {self._moe[j]: found}

    def describe(self) -> str:
        return f"look-ahead oracle (layer l+1's true routing from a trace, distance 1; {len(self.trace)} entries)"
