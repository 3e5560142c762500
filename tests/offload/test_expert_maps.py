"""fMoE expert maps: the store's search, dedup and persistence, Eq. 6-8's selection, §4.5's
priorities, and the predictor in the cached placement against the resident float32 model."""
import numpy as np
import pytest
from conftest import fixture_dir

import moejax
from moejax.offload.expert_cache import ExpertCache, prefetch_priority
from moejax.offload.predict.expert_maps import ExpertMapStore, build_store, predict_sets, select_experts
from moejax.offload.predict.traces import Traces


def _store(n=6, M=3, E=8, D=5, capacity=100, distance=1, seed=0):
    rng = np.random.default_rng(seed)
    store = ExpertMapStore.empty(capacity, distance, M, E, D)
    for _ in range(n):
        store.add(rng.standard_normal(D), rng.dirichlet(np.ones(E), size=M))
    return store


def test_select_experts_is_the_smallest_set_reaching_delta_and_at_least_k():
    p = np.array([0.05, 0.4, 0.1, 0.3, 0.15])
    assert select_experts(p, score=1.0, k=2).tolist() == [1, 3]  # delta 0: just the k most probable
    assert select_experts(p, score=0.5, k=1).tolist() == [1, 3]  # delta 0.5: 0.4 < 0.5 <= 0.7
    assert select_experts(p, score=0.3, k=1).tolist() == [1, 3]  # delta 0.7 reached exactly
    assert select_experts(p, score=0.2, k=1).tolist() == [1, 3, 4]  # delta 0.8: 0.85
    assert select_experts(p, score=-0.5, k=1).tolist() == [1, 3, 4, 2, 0]  # delta clipped to 1: everything
    assert select_experts(p, score=0.9, k=3).tolist() == [1, 3, 4]  # delta 0.1, but k = 3


def test_prefetch_priority_favours_probable_and_near_layers():
    assert prefetch_priority(np.array([0.6]), 5, 4)[0] == pytest.approx(0.6)
    assert prefetch_priority(np.array([0.6]), 6, 4)[0] == pytest.approx(0.3)
    near_low, far_high = prefetch_priority(np.array([0.3]), 5, 4)[0], prefetch_priority(np.array([0.5]), 7, 4)[0]
    assert near_low > far_high


def test_eviction_priority_evicts_the_lowest_frequency_times_probability():
    cache = ExpertCache(2, "priority")
    cache.request([(0, 1)])
    cache.request([(0, 1)])
    cache.request([(0, 2)])
    cache.set_scores({(0, 1): 0.1, (0, 2): 0.9})  # (2+1)*0.1 = 0.3 < (1+1)*0.9 = 1.8
    _, _, evicted = cache.request([(0, 3)])
    assert evicted == [(0, 1)]


def test_search_returns_the_planted_nearest_map():
    store = _store(n=20, M=4, E=8, D=6, seed=1)
    planted = 13
    noisy_embedding = store.embeddings[planted] + 0.01 * np.random.default_rng(2).standard_normal(6)
    i, score = store.semantic(noisy_embedding)
    assert i == planted and score > 0.99
    observed = store.maps[planted, :2] + 0.001
    i, score = store.trajectory(observed / observed.sum(-1, keepdims=True))
    assert i == planted and score > 0.99
    sets = predict_sets(store, noisy_embedding, observed, position=0, k=2)
    assert sorted(sets) == [0, 1]  # semantic for the first d = 1 layer, trajectory for layer 0 + d
    for target, (ids, p) in sets.items():
        np.testing.assert_allclose(p, store.maps[planted, target, ids])


def test_a_full_store_replaces_its_most_redundant_map_and_round_trips(tmp_path):
    store = _store(n=4, capacity=4, seed=3)
    before = store.maps.copy()
    store.add(store.embeddings[2] * 3.0, before[2] * 0.5 + 0.5 / 8)  # nearly map 2 again
    assert len(store) == 4
    assert not np.allclose(store.maps[2], before[2]) and np.allclose(store.maps[[0, 1, 3]], before[[0, 1, 3]])
    fresh = ExpertMapStore(store.capacity, store.distance, store.embeddings, store.maps)  # its norms from scratch
    np.testing.assert_allclose(store.prefix_norms2, fresh.prefix_norms2)  # kept up to date by add
    back = ExpertMapStore.load(store.save(str(tmp_path / "maps")))
    assert (back.capacity, back.distance) == (4, 1)
    np.testing.assert_array_equal(back.maps, store.maps)
    np.testing.assert_array_equal(back.embeddings, store.embeddings)


def test_the_hit_count_policy_keeps_the_maps_searches_chose(tmp_path):
    """The store's replacement ablation (least chosen first, not §4.4's redundancy): the same new map, nearly map 2
    again, replaces map 2 under §4.4's redundancy but the least chosen map under "hits" (map 0 here: maps 1-3 were
    matched by the matcher's searches, map 2 most). Before, a store had no policy: this failed."""
    from moejax.offload.predict.expert_maps import _PassMatcher
    store = _store(n=4, capacity=4, seed=3)
    hits = ExpertMapStore(store.capacity, store.distance, store.embeddings.copy(), store.maps.copy(), "hits")
    matcher = _PassMatcher(hits, hits.embeddings[[1, 2, 2, 3]], requests=np.array([True, True, True, True]))
    matcher.semantic(k=2)  # each row's own embedding: maps 1, 2, 2 and 3 chosen
    assert hits.hits.tolist() == [0, 1, 2, 1]
    before = store.maps.copy()
    new = (store.embeddings[2] * 3.0, before[2] * 0.5 + 0.5 / 8)
    store.add(*new)
    hits.add(*new)
    assert not np.allclose(store.maps[2], before[2]) and np.allclose(store.maps[0], before[0])
    assert not np.allclose(hits.maps[0], before[0]) and np.allclose(hits.maps[1:], before[1:])
    assert hits.hits.tolist() == [0, 1, 2, 1]  # the new map starts uncounted
    back = ExpertMapStore.load(hits.save(str(tmp_path / "hits")))
    assert back.policy == "hits"
    with pytest.raises(ValueError, match="policy"):
        ExpertMapStore.empty(4, 1, 3, 8, 5, policy="lfu")


def test_a_batch_of_new_iterations_replaces_distinct_maps():
    """§4.4's batched update: two new iterations both nearest stored map 2 replace map 2 and another one, so both
    are kept (one after the other, the second would replace the first)."""
    store = _store(n=4, capacity=4, seed=6)
    before = store.maps.copy()
    near = [before[2] * 0.5 + 0.5 / 8, before[2] * 0.6 + 0.4 / 8]
    store.add_batch(np.stack([store.embeddings[2] * 2.0, store.embeddings[2] * 3.0]), np.stack(near))
    assert len(store) == 4 and (store.maps != before).any(axis=(1, 2)).sum() == 2
    assert not np.allclose(store.maps[2], before[2])
    for m in near:
        assert np.isclose(store.maps, m).all(axis=(1, 2)).any()
    fresh = ExpertMapStore(store.capacity, store.distance, store.embeddings, store.maps)
    np.testing.assert_allclose(store.prefix_norms2, fresh.prefix_norms2)


def test_build_store_keeps_one_map_per_iteration():
    """fMoE §4.1: a prompt's prefill is one map (its mean gate distribution, keyed by its mean embedding), and
    each decode iteration after it one more (its token's own); before, one mean map per prompt (this failed)."""
    rng = np.random.default_rng(4)
    logits = rng.standard_normal((7, 2, 4)).astype(np.float32)
    traces = Traces(np.zeros((7, 2, 3), np.float32), logits, np.array([0, 1, 2, 0, 1, 3, 3]),
                    np.array([0, 3, 7]), [0, 1])
    embed = rng.standard_normal((5, 3)).astype(np.float32)
    p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    unit = lambda v: v / np.linalg.norm(v)  # noqa: E731
    store = build_store(traces, embed, capacity=8, prefill_lengths=[2, 2])  # 1 + 1 and 1 + 2 iterations
    assert len(store) == 5 and store.nbytes == store.maps.nbytes + store.embeddings.nbytes
    np.testing.assert_allclose(store.maps[0], p[:2].mean(0), rtol=1e-6)  # prompt 0's prefill
    np.testing.assert_allclose(store.maps[1], p[2], rtol=1e-6)  # its decode iteration
    np.testing.assert_allclose(store.maps[2], p[3:5].mean(0), rtol=1e-6)
    np.testing.assert_allclose(store.maps[4], p[6], rtol=1e-6)
    np.testing.assert_allclose(store.embeddings[2], unit(embed[[0, 1]].mean(0)), rtol=1e-6)
    np.testing.assert_allclose(store.embeddings[3], unit(embed[3]), rtol=1e-6)
    whole = build_store(traces, embed, capacity=8)  # prefill-only traces: one prefill iteration per prompt
    np.testing.assert_allclose(whole.maps[1], p[3:].mean(0), rtol=1e-6)
    with pytest.raises(ValueError, match="prefill_lengths"):
        build_store(traces, embed, prefill_lengths=[4, 1])


def test_calibrate_maps_cli_then_exact_cached_equals_resident(tmp_path, capsys):
    import json

    from launch.calibrate import main
    name = "gpt_oss"
    lines = [json.dumps({"custom_id": f"c{i}", "url": "/v1/completions",
                         "body": {"prompt_token_ids": list(range(5 + i, 30 + 2 * i)), "max_tokens": 3}})
             for i in range(6)]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    assert main(["--model", fixture_dir(name), "--dtype", "float32", "--input", str(tmp_path / "in.jsonl"),
                 "--out", str(tmp_path / "all"), "--maps", "--capacity", "100"]) == 0
    everything = ExpertMapStore.load(str(tmp_path / "all"))
    assert len(everything) == 6 * 3  # per prompt: its prefill and the 2 decode iterations that fed a token
    assert "18 iterations (6 prefills, 12 decodes)" in capsys.readouterr().err
    small = ExpertMapStore.empty(4, 1, *everything.maps.shape[1:], everything.embeddings.shape[1])
    for e, m in zip(everything.embeddings, everything.maps, strict=True):
        small.add(e, m)
    small.save(str(tmp_path / "maps"))
    resident = moejax.load(fixture_dir(name), dtype="float32")
    ids = np.random.default_rng(5).integers(0, resident.config.vocab_size, (2, 11))
    ref = resident.logits(ids)
    engine = moejax.load(fixture_dir(name), dtype="float32", placement="cached", cache_slots=6, eviction="priority",
                         predictor="expert_map", maps=str(tmp_path / "maps"))
    before = small.maps
    out = engine.logits(ids)
    assert float(np.max(np.abs(out - ref)) / np.max(np.abs(ref))) <= 1e-6
    assert engine.stats()["total"]["prefetches"] > 0
    predictor = engine.layered_steps.placement.predictor
    predictor.drain()
    served = predictor.store  # each row's map replaced the stored map most redundant with it
    assert len(served) == 4 and 1 <= (served.maps != before).any(axis=(1, 2)).sum() <= 2
    with pytest.raises(ValueError, match="prefetches only"):
        moejax.load(fixture_dir(name), placement="cached", predictor="expert_map", maps=str(tmp_path / "maps"),
                    speculative=True)


def test_prefetch_priority_orders_the_copies_across_the_layers_ahead(tmp_path):
    """fMoE §4.5: at the first MoE layer, a distance-2 store predicts the next two MoE layers; the
    cached placement queues their experts together by p / (MoE layers ahead), so the likely expert two layers on
    goes before the unlikely one of the next layer. Before, each layer's set was queued whole, nearest layer first
    (and the predictor re-sorted one layer's set by p / a constant, which changed nothing): this test failed."""
    name = "gpt_oss"  # three MoE layers
    resident = moejax.load(fixture_dir(name), dtype="float32")
    cfg = resident.config
    E, D = cfg.num_experts, cfg.hidden_size
    maps = np.full((3, E), 0.2 / (E - 2))
    maps[1, [0, 1]] = [0.5, 0.3]  # the next MoE layer: 0.5 and 0.3 the most likely
    maps[2, :] = 0.08 / (E - 1)
    maps[2, 5] = 0.92  # two MoE layers on: expert 5 at 0.92, priority 0.46, above the next layer's 0.3
    maps[0] = maps[1]
    store = ExpertMapStore.empty(4, 2, 3, E, D)
    store.add(np.ones(D), maps)
    store.save(str(tmp_path / "maps"))
    engine = moejax.load(fixture_dir(name), dtype="float32", placement="cached", cache_slots=3 * E,
                         predictor="expert_map", maps=str(tmp_path / "maps"))
    placement, moe = engine.layered_steps.placement, engine.layered_steps.moe_layers
    assert len(moe) == 3
    issued: list[list[tuple[int, int]]] = []
    prefetch = placement.cache.prefetch  # the real cache, its queues recorded
    placement.cache.prefetch = lambda keys, scores=None: (issued.append(list(keys)), prefetch(keys, scores))[1]
    ids = np.random.default_rng(5).integers(0, cfg.vocab_size, (1, 9))
    out, ref = engine.logits(ids), resident.logits(ids)
    assert float(np.max(np.abs(out - ref)) / np.max(np.abs(ref))) <= 1e-5
    ahead = [key for keys in issued for key in keys if key[0] in (moe[1], moe[2])][:4]  # the first MoE layer's
    priority = {(moe[1], e): maps[1, e] for e in range(E)} | {(moe[2], e): maps[2, e] / 2 for e in range(E)}
    assert ahead == sorted(ahead, key=lambda key: -priority[key]), ahead
    assert ahead.index((moe[2], 5)) < ahead.index((moe[1], 1))  # 0.92 / 2 before 0.3 / 1
