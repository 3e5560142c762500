"""MoE-Infinity's request-level predictor (moejax.offload.predict.activation_matrices), fMoE's baseline: recall
against the true routing on traces where requests repeat, and the cached placement with it against the resident
model."""
import numpy as np
import pytest
from conftest import fixture_dir

import moejax
from moejax.offload.predict.activation_matrices import (
    ActivationMatrices,
    ActivationMatrixPredictor,
    replay_online,
)
from moejax.offload.predict.hit_counts import replay_hit_counts, request_counts
from moejax.offload.predict.replay import recall
from moejax.offload.predict.traces import Traces

M, E, K = 4, 8, 2
NAME = "gpt_oss"  # three MoE layers


def traces_of(logits: np.ndarray, lengths: list[int]) -> Traces:
    N = len(logits)
    return Traces(np.zeros((N, M, 1), np.float32), logits.astype(np.float32), np.zeros(N, np.int32),
                  np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64), [1, 2, 4, 5])


def repeating_workload(seed: int = 0) -> tuple[Traces, int]:
    """Five kinds of request, each favouring its own experts at each layer (noise on top), served twice over in
    order: -> (traces, where the second round starts, in tokens)."""
    rng = np.random.default_rng(seed)
    kinds = rng.standard_normal((5, M, E)) * 3
    lengths = [int(n) for n in rng.integers(4, 9, 10)]
    logits = np.concatenate([kinds[r % 5] + rng.standard_normal((n, M, E)) for r, n in enumerate(lengths)])
    return traces_of(logits, lengths), int(sum(lengths[:5]))


def overall(predicted: dict, truth: Traces, since: int) -> float:
    true = np.argsort(-truth.router_logits, axis=-1, kind="stable")[..., :K]
    layers = {layer: m for m, layer in enumerate(truth.moe_layers)}
    return float(np.mean([recall(ids[since:], true[since:, layers[t]]) for t, (ids, _) in predicted.items()]))


def test_online_recall_beats_random_and_matches_hit_counts_when_requests_repeat():
    """Served online from an empty collection, the second round's requests are matched to the first round's
    matrices: recall well above a random predictor's (k/E = 0.25), and at least that of the hit counts replayed
    from the first round's matrices given beforehand (the same matching from a calibration, checked against a plain
    reference in test_hit_counts): on the second round the two predict the same sets."""
    traces, second = repeating_workload()
    rng = np.random.default_rng(1)
    random = {layer: (np.argsort(rng.random((len(traces.tokens), E)), axis=1)[:, :K], None)
              for layer in traces.moe_layers}
    calibrated = request_counts(traces.prompts(range(5)), K)
    for distance in (1, 2):
        online = replay_online(traces, K, distance=distance)
        assert all((ids[:traces.starts[1]] == -1).all() for ids, _ in online.values())  # nothing stored yet
        got = overall(online, traces, second)
        hit_counts, _ = replay_hit_counts(calibrated, traces, K, distance=distance)
        assert got > overall(random, traces, second) + 0.3
        assert got >= overall(hit_counts, traces, second)
        assert sorted(online) == sorted(hit_counts)
        for t, (ids, _) in online.items():
            np.testing.assert_array_equal(ids[second:], hit_counts[t][0][second:, :K])


def test_a_full_collection_replaces_its_oldest_matrix():
    c = ActivationMatrices(2)
    for v in (1.0, 2.0, 3.0):
        c.add(np.full((1, M, E), v))
    assert len(c) == 2 and sorted(c.matrices[:, 0, 0]) == [2.0, 3.0]
    with pytest.raises(ValueError, match="collection is empty"):
        ActivationMatrixPredictor(ActivationMatrices(4))  # no fallback: nothing could predict


@pytest.fixture(scope="module")
def resident():
    return moejax.load(fixture_dir(NAME), dtype="float32")


def test_cached_with_moe_infinity_gives_the_resident_tokens_and_collects_requests(resident):
    """predictor="moe_infinity": the fallback predicts the first requests; once they are done (the next prefill)
    their matrices are stored, one per request, counting each of its tokens' k choices per MoE layer, and the later
    requests prefetch from their matches. The tokens stay the resident model's."""
    cfg = resident.config
    engine = moejax.load(fixture_dir(NAME), dtype="float32", placement="cached", cache_slots=2 * cfg.num_experts,
                         predictor="moe_infinity")
    predictor = engine.layered_steps.placement.predictor
    assert isinstance(predictor, ActivationMatrixPredictor) and "previous_hidden" in predictor.describe()
    fallback_calls = []
    fallback_predict = predictor.fallback.predict
    predictor.fallback.predict = lambda *args: fallback_calls.append(args[0]) or fallback_predict(*args)
    prompts = [list(range(3, 12)), list(range(40, 47))]
    assert engine.generate(prompts, 4) == resident.generate(prompts, 4)
    assert len(predictor.collection) == 0 and fallback_calls  # still in flight: the fallback predicted
    fallback_calls.clear()
    assert engine.generate(prompts, 4) == resident.generate(prompts, 4)
    assert not fallback_calls  # matched against the first requests' matrices
    moe = len(engine.layered_steps.moe_layers)
    assert predictor.collection.matrices.shape == (2, moe, cfg.num_experts)
    # the prompt's tokens and three decode tokens (the fourth is sampled, not fed), k choices each, per MoE layer
    k = cfg.num_experts_per_tok
    np.testing.assert_array_equal(predictor.collection.matrices.sum(axis=2), [[(9 + 3) * k] * moe, [(7 + 3) * k] * moe])
    assert engine.stats()["total"]["prefetches"] > 0
    with pytest.raises(ValueError, match="prefetches only"):
        moejax.load(fixture_dir(NAME), placement="cached", predictor="moe_infinity", speculative=True)


@pytest.mark.slow  # the continuous scheduler over a cached engine (tens of seconds)
def test_continuous_batching_with_moe_infinity_gives_the_resident_tokens(resident):
    """Under the continuous scheduler (chunked prefills between decode passes of the pool's slots) requests are
    stored in pieces (the module docstring); the matching still only moves weights: the resident model's tokens."""
    import jax

    from moejax.sched.continuous import GenRequest, Scheduler
    from moejax.sched.pool_size import pool_size

    def serve(engine, prompts):
        key = np.asarray(jax.random.key_data(jax.random.key(0)))
        requests = [GenRequest(p, 6, key, tag=i) for i, p in enumerate(prompts)]
        size = pool_size(engine, [(len(r.prompt), r.max_tokens) for r in requests])
        out: dict = {}
        Scheduler(engine, size.blocks, max_rows=2, **engine.placement.scheduler_defaults()).run(
            requests, lambda g, t, c: out.__setitem__(g.tag, list(t)), lambda g, m: out.__setitem__(g.tag, m))
        return [out[i] for i in range(len(requests))]

    cfg = resident.config
    engine = moejax.load(fixture_dir(NAME), dtype="float32", placement="cached", cache_slots=2 * cfg.num_experts,
                         predictor="moe_infinity")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, cfg.vocab_size, int(rng.integers(5, 20))).tolist() for _ in range(5)]
    assert serve(engine, prompts) == serve(resident, prompts)
    assert len(engine.layered_steps.placement.predictor.collection) >= 2  # requests, or their pieces, were stored
    assert engine.stats()["total"]["prefetches"] > 0
