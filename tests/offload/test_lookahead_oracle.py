"""The look-ahead oracle (layer l+1's true experts at layer l, from a recorded trace of the same requests): exact
decode equal to the resident float32 model, and every layer it predicts hits the cache when the cache holds two
layers' experts, where the same cache loading on demand misses."""
import numpy as np
import pytest
from conftest import fixture_dir

import moejax
from launch.bench.offload import decode_loop
from moejax.offload.predict.lookahead import LookAheadOracle, RoutingRecorder

NAME = "qwen3_moe"  # MoE layers 0 and 2 (layer 1 dense): the oracle predicts layer 2 at layer 0
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79]
NEW = 12


def _rel(out, ref):
    return float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))


def _decode(engine, predictor):
    predictor.restart()
    return decode_loop(engine, PROMPT, NEW, 0.0, 0)


@pytest.fixture(scope="module")
def resident():
    return moejax.load(fixture_dir(NAME), dtype="float32")


def test_lookahead_oracle_hits_every_predicted_layer_and_equals_resident(resident):
    cfg = resident.config
    slots = 2 * cfg.num_experts_per_tok  # one decode token's experts of two layers, no more
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 9))
    recorder = RoutingRecorder()
    on_demand = moejax.load(fixture_dir(NAME), dtype="float32", placement="cached", cache_slots=slots,
                            eviction="lru", predictor=recorder)
    recorder.restart()
    on_demand.logits(ids)
    logits_trace = recorder.trace
    base = _decode(on_demand, recorder)
    trace = recorder.trace

    oracle = LookAheadOracle(logits_trace)
    engine = moejax.load(fixture_dir(NAME), dtype="float32", placement="cached", cache_slots=slots, eviction="lru",
                         predictor=oracle)
    oracle.restart()
    assert _rel(engine.logits(ids), resident.logits(ids)) <= 1e-6
    oracle.restart(trace)
    run = _decode(engine, oracle)
    assert run["tokens"] == base["tokens"] == resident.generate([PROMPT], NEW)[0]
    assert oracle.unmatched == 0 and oracle.served == NEW  # one prediction (layer 2) per pass
    rate = lambda s: s["hits"] / (s["hits"] + s["misses"])  # noqa: E731
    layers = run["stats"]["layers"]
    moe = [i for i in range(cfg.num_layers) if cfg.is_moe(i)]
    assert rate(layers[moe[1]]) == 1.0  # predicted a layer ahead: always in the cache when its layer runs
    assert rate(base["stats"]["layers"][moe[1]]) < 0.9  # on demand, the same cache misses there
    assert run["stats"]["total"]["prefetches"] > 0


def test_lookahead_oracle_gives_nothing_for_passes_it_did_not_record(resident):
    engine = moejax.load(fixture_dir(NAME), dtype="float32", placement="cached", cache_slots=8,
                         predictor=LookAheadOracle({}))
    oracle = engine.layered_steps.placement.predictor
    assert engine.generate([PROMPT], 3) == resident.generate([PROMPT], 3)
    assert oracle.served == 0 and oracle.unmatched == 3
