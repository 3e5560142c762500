"""fMoE §4.6 in the cached placement: prefetches wait in a queue with at most prefetch_depth copies on their way,
and a miss is copied ahead of the queued ones (moejax.offload.cached)."""
import numpy as np
import pytest
from conftest import fixture_dir

import moejax

NAME = "gpt_oss"  # 8 experts, top-2, three MoE layers
IDS = np.array([[5]])  # one token: a few experts per layer, so most of a layer's experts are unused


class _Fixed:
    """A predictor that predicts, at the first MoE layer, the experts given for the next one (a wrong guess: the
    experts the true router does not pick there), and at the second those given for the third (`then`)."""
    distance = 1

    def __init__(self, target: int, experts: list[int], then: list[int] | None = None) -> None:
        self.target, self.experts, self.then, self.moe = target, experts, then, []

    def begin_pass(self, steps) -> None:
        self.moe = steps.moe_layers

    def predict(self, pass_no, layer, x, y, idx, weights):
        if layer == self.moe[0]:
            return {self.target: self._guess(self.experts)}
        if layer == self.moe[1] and self.then:
            return {self.moe[2]: self._guess(self.then)}
        return {}

    @staticmethod
    def _guess(experts):
        ids = np.array([experts])
        return ids, np.full(ids.shape, 1.0 / ids.shape[1])

    def describe(self) -> str:
        return "fixed"


class _Routing(_Fixed):
    """Records the true router's experts of each MoE layer (and predicts nothing)."""
    def __init__(self) -> None:
        super().__init__(-1, [])
        self.used: dict[int, list[int]] = {}

    def predict(self, pass_no, layer, x, y, idx, weights):
        self.used[layer] = np.unique(np.asarray(idx)).tolist()
        return {}


@pytest.fixture(scope="module")
def reference():
    return moejax.load(fixture_dir(NAME), dtype="float32").logits(IDS)


def _fetches(engine) -> list[tuple[int, int]]:
    """Record the (layer, expert) copies the engine's cached placement starts, in order."""
    store, log = engine.layered_steps.placement.store, []
    fetch = store.fetch_expert

    def recording(layer, expert):
        log.append((layer, expert))
        return fetch(layer, expert)
    store.fetch_expert = recording
    return log


def test_a_miss_is_copied_before_the_prefetches_still_queued(reference):
    depth = 1  # one token leaves 4 of the 8 experts unused: room for a queue at depth 1 only
    routing = _Routing()
    probe = moejax.load(fixture_dir(NAME), dtype="float32", placement="cached", cache_slots=24, predictor=routing)
    probe.logits(IDS)
    target = probe.layered_steps.moe_layers[1]
    wrong = [e for e in range(probe.config.num_experts) if e not in routing.used[target]]
    assert len(wrong) > 2 * depth  # enough wrong guesses that some are still queued when the misses come

    engine = moejax.load(fixture_dir(NAME), dtype="float32", placement="cached", cache_slots=24,
                         predictor=_Fixed(target, wrong), prefetch_depth=depth)
    log = _fetches(engine)
    logits = engine.logits(IDS)
    np.testing.assert_allclose(logits, reference, rtol=1e-6, atol=1e-6)  # exact mode: the resident model's
    at_target = [expert for layer, expert in log if layer == target]
    first_miss = next(i for i, e in enumerate(at_target) if e in routing.used[target])
    # started before the misses: the depth at the prefetch, and at most the depth again when the layer begins
    assert first_miss <= 2 * depth < len(wrong)
    assert sorted(at_target[first_miss: first_miss + len(routing.used[target])]) == routing.used[target]
    layer = engine.stats()["layers"][target]
    assert layer["misses"] == len(routing.used[target]) and layer["hits"] == 0
    assert layer["prefetches"] == len(at_target) - len(routing.used[target])  # copies started, not queued ones
    assert f"{depth} prefetch copies in flight at most" in engine.explain()


def test_guesses_for_a_layer_that_has_run_wait_behind_those_for_the_layers_ahead(reference):
    routing = _Routing()
    probe = moejax.load(fixture_dir(NAME), dtype="float32", placement="cached", cache_slots=24, predictor=routing)
    probe.logits(IDS)
    moe = probe.layered_steps.moe_layers
    wrong = [e for e in range(probe.config.num_experts) if e not in routing.used[moe[1]]]
    engine = moejax.load(fixture_dir(NAME), dtype="float32", placement="cached", cache_slots=24,
                         predictor=_Fixed(moe[1], wrong, then=routing.used[moe[2]]), prefetch_depth=1)
    log = _fetches(engine)
    np.testing.assert_allclose(engine.logits(IDS), reference, rtol=1e-6, atol=1e-6)
    first_ahead = next(i for i, (layer, _) in enumerate(log) if layer == moe[2])
    last_miss = max(i for i, (layer, e) in enumerate(log) if layer == moe[1] and e in routing.used[moe[1]])
    stale = [e for layer, e in log[last_miss + 1: first_ahead] if layer == moe[1]]
    # at most the one copy started before the guesses for the layer ahead came (depth 1); the queue held more
    assert len(stale) <= 1 < len(wrong) - 2


def test_prefetch_depth_must_be_positive():
    with pytest.raises(ValueError, match="prefetch_depth must be an int >= 1, got 0"):
        moejax.load(fixture_dir(NAME), placement="cached", prefetch_depth=0)
