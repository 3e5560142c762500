"""The profile pass behind the streamed placement's saturation threshold Θ (MoE-Prefill Eq. 3, §B.4;
moejax.offload.saturation): every layer timed twice on a reference row — compute only (each layer's experts already
on the device) and with streaming — and Θ from those times."""
from __future__ import annotations

import time
from typing import cast

import jax
import numpy as np

from moejax.engine import Engine
from moejax.offload.layered_steps import Layer, LayeredSteps, LayerRuntime
from moejax.offload.saturation import EPSILON, Saturation, saturation_from_times
from moejax.offload.streamed import StreamedExpertsRuntime
from moejax.sharding.gathered import GatheredStreamed


class _Stopwatch(LayerRuntime):
    """Wraps a streamed runtime (StreamedExpertsRuntime, or AsyncEP's two-channel GatheredStreamed): waits for every
    MoE layer's output and times it from the previous one's; with `compute_only`, the next layer's experts are put in
    place (the runtime's `ready_experts`) and waited for before its clock starts."""

    name = "stopwatch"

    def __init__(self, streamed: StreamedExpertsRuntime | GatheredStreamed, compute_only: bool) -> None:
        self.inner, self.compute_only = streamed, compute_only
        self.times: dict[int, float] = {}
        self.stats = streamed.stats

    def describe(self) -> str:
        return self.inner.describe()

    def begin_pass(self, steps: LayeredSteps) -> None:
        self._order = steps.moe_layers
        self._ready = self._load(self._order[0]) if self.compute_only else None
        self.inner.begin_pass(steps)
        self._start = time.perf_counter()

    def _load(self, layer: int) -> dict[str, jax.Array]:
        return self.inner.ready_experts(layer)

    def moe(self, handle: Layer, x: jax.Array, y: jax.Array, idx: jax.Array | None, weights: jax.Array | None
            ) -> jax.Array:
        assert idx is not None and weights is not None  # a streamed runtime's layers run their routers
        layer = handle.index
        if self.compute_only:
            assert self._ready is not None  # this layer's, loaded by begin_pass or the previous MoE layer
            out = self.inner.moe_ready(handle, x, y, idx, weights, self._ready)
        else:
            out = self.inner.moe(handle, x, y, idx, weights)
        jax.block_until_ready(out)
        self.times[layer] = min(self.times.get(layer, np.inf), time.perf_counter() - self._start)
        if self.compute_only:
            nxt = self._order.index(layer) + 1
            self._ready = self._load(self._order[nxt]) if nxt < len(self._order) else None
        self._start = time.perf_counter()
        return out


def profile_saturation(engine: Engine, *, tokens: int = 512, epsilon: float = EPSILON, repeats: int = 2,
                       seed: int = 0) -> Saturation:
    """Profile a streamed engine on one row of `tokens` random ids (after a warm-up pass that compiles)."""
    if not engine.placement.profiles_theta:
        raise ValueError("profile_saturation: the engine's placement is not 'streamed' with stream='python'")
    steps = engine.layered_steps
    streamed = cast("StreamedExpertsRuntime | GatheredStreamed", steps.placement)  # profiles_theta: one of these
    tokens = min(tokens, engine.config.max_position_embeddings)
    ids = np.random.default_rng(seed).integers(0, engine.config.vocab_size, (1, tokens))
    engine.logits(ids)  # compile every shape first
    watches = {mode: _Stopwatch(streamed, mode) for mode in (True, False)}
    try:
        for _ in range(repeats):
            for watch in watches.values():
                steps.placement = watch
                engine.logits(ids)
    finally:
        steps.placement = streamed
        engine.reset_stats()
    saturation = saturation_from_times(engine.config, tokens, watches[True].times, watches[False].times, epsilon)
    engine.use_theta(saturation)
    return saturation
