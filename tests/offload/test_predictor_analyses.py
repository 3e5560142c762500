"""Speculating Experts' analyses (Fig. 3 and 5): cosine drift per layer distance and rank alignment of
predicted and true expert scores, on recorded traces of a fixture model."""
import numpy as np
import pytest
from conftest import fixture_dir

import moejax
from moejax.offload.predict import RouterPredictor, replay
from moejax.offload.predict.analyses import drift_and_alignment, hit_rate_by_rank, spearman
from moejax.offload.predict.traces import record

NAME = "gpt_oss"  # three MoE layers: distances 1 and 2 both have targets


@pytest.fixture(scope="module")
def measured():
    engine = moejax.load(fixture_dir(NAME), dtype="float32")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, engine.config.vocab_size, size=24).tolist() for _ in range(6)]
    traces, vectors = record(engine, prompts)
    steps = replay.steps_of(engine)
    truth = replay.true_routing(steps, traces)
    return steps, traces, vectors, truth, drift_and_alignment(steps, traces, vectors, truth, max_distance=2)


def _row(rows, representation, distance):
    return next(r for r in rows if (r["representation"], r["distance"]) == (representation, distance))


def test_distance_zero_is_no_drift_and_the_true_router_aligns_perfectly_with_itself(measured):
    *_, out = measured
    drift, alignment = _row(out["cosine_drift"], "true", 0), _row(out["rank_alignment"], "true", 0)
    assert len(drift["per_layer"]) == 3
    assert all(v == pytest.approx(1.0, abs=1e-6) for v in drift["per_layer"].values())
    assert alignment["spearman"] == pytest.approx(1.0)
    assert all(h == 1.0 for hits in alignment["per_layer_hit_rate_by_rank"].values() for h in hits)


def test_each_distance_reaches_the_layers_that_far_ahead_and_drift_is_below_one(measured):
    _, traces, *_, out = measured
    moe = traces.moe_layers
    for rep in ("previous_hidden", "quasi_hidden"):
        for d in (1, 2):
            row = _row(out["cosine_drift"], rep, d)
            assert sorted(int(t) for t in row["per_layer"]) == moe[d:]
            assert all(-1 <= v < 0.9999 for v in row["per_layer"].values())
            assert -1 <= _row(out["rank_alignment"], rep, d)["spearman"] < 1


@pytest.mark.parametrize("distance", [1, 2])
def test_hit_rates_by_rank_average_to_the_router_predictors_recall(measured, distance):
    steps, traces, vectors, truth, out = measured
    recall = replay.recall_by_layer(steps, RouterPredictor(vectors, distance), traces, truth)["per_layer"]
    hits = _row(out["rank_alignment"], "quasi_hidden", distance)["per_layer_hit_rate_by_rank"]
    assert {int(t) for t in hits} == set(recall)
    for t, r in recall.items():
        assert np.mean(hits[str(t)]) == pytest.approx(r, abs=1e-9)


def test_rank_measures_on_known_scores():
    scores = np.array([[0.1, 0.5, 0.3, 0.9], [1.0, 2.0, 3.0, 4.0]])
    np.testing.assert_allclose(spearman(scores, scores), [1.0, 1.0])
    np.testing.assert_allclose(spearman(-scores, scores), [-1.0, -1.0])
    true_idx, true_w = np.array([[3, 1], [0, 2]]), np.array([[0.7, 0.3], [0.2, 0.8]])
    np.testing.assert_allclose(hit_rate_by_rank(np.array([[3, 0], [0, 1]]), true_idx, true_w), [0.5, 0.5])
