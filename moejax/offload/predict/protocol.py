"""What every expert predictor answers (the package docstring lists them); the cached placement
(moejax.offload.cached) calls it once per forward pass and once per MoE layer."""
from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from typing import Any, Protocol

import jax
import numpy as np

from moejax.offload.layered_steps import LayeredSteps

Arrays = jax.Array | np.ndarray  # on the device, or replayed from recorded traces (moejax.offload.predict.replay)


@dataclasses.dataclass(frozen=True)
class Pending:
    """A prediction still being made on another thread (the expert-map matcher): result() waits for it."""
    future: Future
    target: int  # the key of its (ids, weights) in the future's result

    def result(self) -> tuple[Any, Any]:
        return self.future.result()[self.target]


# {target layer: (predicted expert ids [N, k], predicted weights [N, k])}, as jax or numpy arrays, or Pending
Prediction = dict[int, "tuple[Any, Any] | Pending"]


def resolved(value: tuple[Any, Any] | Pending) -> tuple[Any, Any]:
    """A prediction's (ids, weights), waiting for it if it is Pending."""
    return value.result() if isinstance(value, Pending) else value


class Predictor(Protocol):
    distance: int  # MoE layers ahead it predicts (0: the layer itself)

    def begin_pass(self, steps: LayeredSteps) -> None:
        """A forward pass starts over `steps` (the layer loop: its layers and MoE layer indices)."""

    def predict(self, pass_no: int, layer: int, x: Arrays, y: Arrays, idx: Arrays, weights: Arrays) -> Prediction:
        """At MoE layer `layer` of pass `pass_no`: its residual x, MoE input y and true routing -> predictions."""

    def describe(self) -> str:
        """One line for Engine.explain()."""
