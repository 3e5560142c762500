"""fMoE §6.5's ablation switches of the expert-map predictor: Map (T) drops the semantic search
of the first d layers, Map (T+S) drops δ's similarity-aware set size; both on is the default, Map (T+S+δ)."""
import numpy as np

from moejax.offload.predict.expert_maps import ExpertMapStore, predict_sets, replay_predictions
from moejax.offload.predict.traces import Traces

E, K = 8, 2


def _store():
    """One map: layer 0 peaked on expert 0, layer 1 flat (a poor trajectory match needs most of it)."""
    store = ExpertMapStore.empty(4, 1, 2, E, 3)
    peaked = np.full(E, 0.01 / (E - 1))
    peaked[0] = 0.99
    store.add(np.array([1.0, 0.0, 0.0]), np.stack([peaked, np.full(E, 1 / E)]))
    return store


def _far_observation():
    observed = np.full((1, E), 0.01 / (E - 1))
    observed[0, 5] = 0.99  # cosine to the map's layer 0 is about 0.02: δ is about 0.98
    return observed


def test_semantic_off_predicts_nothing_for_the_first_layer():
    store, embedding = _store(), np.array([1.0, 0.0, 0.0])
    assert sorted(predict_sets(store, embedding, _far_observation(), 0, K)) == [0, 1]
    assert sorted(predict_sets(store, embedding, _far_observation(), 0, K, semantic=False)) == [1]


def test_delta_off_takes_exactly_k_experts_where_a_poor_match_takes_more():
    store, embedding = _store(), np.array([1.0, 0.0, 0.0])
    adaptive = predict_sets(store, embedding, _far_observation(), 0, K)
    fixed = predict_sets(store, embedding, _far_observation(), 0, K, adaptive=False)
    assert len(adaptive[1][0]) == E and len(fixed[1][0]) == K  # δ ≈ 0.98 of a flat map: all eight
    assert len(adaptive[0][0]) == K  # the semantic match is exact (score 1, δ 0): k either way


def test_replay_honours_the_switches():
    store = _store()
    logits = np.log(np.stack([_far_observation()[0], np.full(E, 1 / E)]))[None].repeat(3, axis=0)
    traces = Traces(np.zeros((3, 2, 3), np.float32), logits.astype(np.float32), np.zeros(3, np.int32),
                    np.array([0, 3]), [0, 1])
    embed = np.array([[1.0, 0.0, 0.0]], np.float32)
    full, full_size = replay_predictions(store, traces, embed, K)
    t_only, t_size = replay_predictions(store, traces, embed, K, semantic=False, adaptive=False)
    assert set(full) == {0, 1} and set(t_only) == {1}
    assert (t_only[1][0] >= 0).sum(axis=1).tolist() == [K] * 3 and t_size == K
    assert full_size > t_size
