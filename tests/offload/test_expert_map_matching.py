"""fMoE's matching as the paper runs it: asynchronous (the layer loop never waits on the
device for it), per request inside a batch, and the union of the requests' sets prefetched."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import fixture_dir

import moejax
from moejax.offload.predict.expert_maps import ExpertMapPredictor, ExpertMapStore, _row_gates, predict_sets
from moejax.offload.predict.protocol import Pending, resolved
from moejax.offload.predict.replay import steps_of

NAME = "gpt_oss"  # three MoE layers


@pytest.fixture(scope="module")
def resident():
    return moejax.load(fixture_dir(NAME), dtype="float32")


@jax.jit
def _slow_zero(a: jax.Array) -> jax.Array:
    """0.0, after seconds of matrix products: what depends on it is not ready for that long."""
    return 0.0 * jnp.sum(jax.lax.fori_loop(0, 40, lambda i, m: jnp.tanh(m @ a), a))


def test_matching_never_blocks_the_layer_loop_on_the_device(resident):
    """Item 7: begin_pass and predict only dispatch device work and hand it to the matcher thread. Every array
    given to them here depends on a computation that takes seconds, and is still not ready when they return;
    before, begin_pass read the input embeddings and predict each layer's gate distributions with np.asarray on
    the layer loop's thread (two host syncs per pass and one per MoE layer), so this test failed. The pending
    sets, once resolved, are each row's sets of the synchronous search (predict_sets).
    Why readiness and not a count of transfers: on the CPU backend jax.transfer_guard does not fire for device ->
    host reads (jax-ml/jax#16602) and np.asarray takes the buffer protocol, which no Python wrapper sees; an input
    still not ready after the calls is the count itself: zero host syncs, per pass and per layer."""
    cfg = resident.config
    steps = steps_of(resident)
    moe, E, D, B, T, k = steps.moe_layers, cfg.num_experts, cfg.hidden_size, 3, 5, cfg.num_experts_per_tok
    rng = np.random.default_rng(0)
    store = ExpertMapStore.empty(8, 1, len(moe), E, D)
    for _ in range(6):
        store.add(rng.standard_normal(D), rng.dirichlet(np.full(E, 0.3), size=len(moe)))
    predictor = ExpertMapPredictor(store, update=False)
    x0 = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)
    ys = [jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32) for _ in moe]
    idx = jnp.zeros((B * T, k), jnp.int32)
    steps.inputs = x0
    predictor.begin_pass(steps)  # a first pass compiles what the loop dispatches
    for layer, y in zip(moe, ys, strict=True):
        predictor.predict(0, layer, y, y, idx, idx.astype(jnp.float32))
    predictor.drain()
    a = jnp.full((1024, 1024), 1.0 / 1024, jnp.float32)
    _slow_zero(a).block_until_ready()
    gate = _slow_zero(a)
    assert not gate.is_ready(), "the CPU backend ran the computation at dispatch: the test needs async dispatch"
    steps.inputs = x0 + gate
    predictor.begin_pass(steps)
    assert not gate.is_ready(), "begin_pass waited for the input embeddings"
    pending = {}
    for layer, y in zip(moe, ys, strict=True):
        pending[layer] = predictor.predict(0, layer, y + gate, y + gate, idx, idx.astype(jnp.float32))
        assert not gate.is_ready(), "predict waited for its device inputs"
    embeddings = np.asarray(x0).mean(axis=1)
    observed = np.stack([np.asarray(steps.layers[layer](_row_gates, y, rows=B))
                         for layer, y in zip(moe, ys, strict=True)], 1)
    for j, layer in enumerate(moe):
        got = {target: resolved(p) for target, p in pending[layer].items()}
        for b in range(B):
            want = predict_sets(store, embeddings[b], observed[b, :j + 1], j, k)
            assert sorted(got) == sorted(moe[t] for t in want)
            for t, (ids, p) in want.items():
                row_ids, row_p = got[moe[t]][0][b], got[moe[t]][1][b]
                assert row_ids[row_ids >= 0].tolist() == ids.tolist()
                np.testing.assert_allclose(row_p[:len(ids)], p, rtol=1e-6)


def test_each_request_is_matched_on_its_own_and_the_union_is_prefetched(resident, tmp_path):
    """Item 8: two requests with different routing in one batch. A first pass stores each request's iteration
    map (one per row, not one mean per pass); served from a store of just those two maps, each row finds its own
    map (scores ~1, so Eq. 6-8 picks its k most probable experts) and the placement prefetches the union, while
    the logits stay the resident model's. Before, the rows were averaged into one set per pass: this failed."""
    cfg = resident.config
    E, D, k = cfg.num_experts, cfg.hidden_size, cfg.num_experts_per_tok
    ids = np.stack([np.arange(3, 12), np.arange(40, 49) % cfg.vocab_size])
    dummy = ExpertMapStore.empty(3, 1, 3, E, D)
    dummy.add(np.ones(D), np.full((3, E), 1.0 / E))
    dummy.save(str(tmp_path / "dummy"))
    engine = moejax.load(fixture_dir(NAME), dtype="float32", placement="cached", cache_slots=3 * E,
                         predictor="expert_map", maps=str(tmp_path / "dummy"))
    engine.logits(ids)
    predictor = engine.layered_steps.placement.predictor
    predictor.drain()
    assert len(predictor.store) == 3  # the dummy and one map per row
    maps, embeddings = predictor.store.maps[1:], predictor.store.embeddings[1:]
    moe = engine.layered_steps.moe_layers
    tops = [[set(np.argsort(-maps[r, t])[:k].tolist()) for t in range(len(moe))] for r in range(2)]
    assert tops[0] != tops[1], "the two requests route alike: pick other tokens"
    store = ExpertMapStore.empty(4, 1, len(moe), E, D)
    for e, m in zip(embeddings, maps, strict=True):
        store.add(e, m)
    store.save(str(tmp_path / "two"))
    engine = moejax.load(fixture_dir(NAME), dtype="float32", placement="cached", cache_slots=3 * E,
                         predictor="expert_map", maps=str(tmp_path / "two"))
    placement = engine.layered_steps.placement
    placement.predictor.update = False
    seen: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    predict = placement.predictor.predict  # the real predictor, its answers recorded once resolved

    def recording(*args):
        out = predict(*args)
        seen.update({t: resolved(p) for t, p in out.items()})
        return out
    placement.predictor.predict = recording
    issued: list[tuple[int, int]] = []
    prefetch = placement.cache.prefetch
    placement.cache.prefetch = lambda keys, scores=None: (issued.extend(keys), prefetch(keys, scores))[1]
    out, ref = engine.logits(ids), resident.logits(ids)
    assert float(np.max(np.abs(out - ref)) / np.max(np.abs(ref))) <= 1e-6
    assert sorted(seen) == moe
    for t, layer in enumerate(moe):
        rows, _ = seen[layer]
        assert rows.shape[0] == 2  # one set per request
        for r in range(2):
            assert set(rows[r][rows[r] >= 0].tolist()) == tops[r][t]
        union = tops[0][t] | tops[1][t]
        assert {e for (l, e) in issued if l == layer} == union


def test_decoding_stores_one_map_per_iteration_of_each_request(resident, tmp_path):
    """Item 8 while serving: generating 4 tokens for 2 prompts runs a prefill and 3 decode iterations, each row of
    each storing its own map (2 x 4 with the one given); the tokens stay the resident model's."""
    cfg = resident.config
    store = ExpertMapStore.empty(100, 1, 3, cfg.num_experts, cfg.hidden_size)
    store.add(np.ones(cfg.hidden_size), np.full((3, cfg.num_experts), 1.0 / cfg.num_experts))
    store.save(str(tmp_path / "maps"))
    engine = moejax.load(fixture_dir(NAME), dtype="float32", placement="cached", cache_slots=2 * cfg.num_experts,
                         predictor="expert_map", maps=str(tmp_path / "maps"))
    prompts = [list(range(3, 12)), list(range(40, 47))]
    assert engine.generate(prompts, 4) == resident.generate(prompts, 4)
    predictor = engine.layered_steps.placement.predictor
    predictor.drain()
    assert len(predictor.store) == 1 + 2 * 4


def test_online_from_an_empty_store_falls_back_then_matches_the_maps_it_stored(resident):
    """fMoE's online setting (§6.3): predictor="expert_map" without maps starts from an empty store; the fallback
    (previous_hidden here: no default vectors given) predicts the passes begun on it, every pass's maps are
    stored, and from the next pass on (it waits for the first maps) the passes are matched against them. The
    tokens stay the resident model's. Before, the settings refused expert_map without maps and the predictor
    raised on an empty store."""
    cfg = resident.config
    engine = moejax.load(fixture_dir(NAME), dtype="float32", placement="cached", cache_slots=2 * cfg.num_experts,
                         predictor="expert_map")
    placement = engine.layered_steps.placement
    predictor = placement.predictor
    assert len(predictor.store) == 0 and "previous_hidden" in predictor.describe()
    kinds: list[tuple[int, bool]] = []  # (pass, whether it is the matcher's) of each prediction made
    predict = predictor.predict

    def recording(*args):
        out = predict(*args)
        kinds.extend((args[0], isinstance(p, Pending)) for p in out.values())
        return out
    predictor.predict = recording
    prompts = [list(range(3, 12)), list(range(40, 47))]
    assert engine.generate(prompts, 4) == resident.generate(prompts, 4)
    predictor.drain()
    assert len(predictor.store) == 2 * 4  # each row's prefill and 3 decode iterations
    assert predictor.store.maps.shape[1:] == (len(engine.layered_steps.moe_layers), cfg.num_experts)
    first = min(p for p, _ in kinds)
    assert [matched for p, matched in kinds if p == first] == [False, False]  # the fallback's: the store was empty
    later = [matched for p, matched in kinds if p > first]
    assert later and all(later)  # the matcher's, once maps were stored
    assert engine.stats()["total"]["prefetches"] > 0
    with pytest.raises(ValueError, match="store is empty"):
        ExpertMapPredictor(ExpertMapStore.unsized(4, 1))  # no fallback: nothing could predict


def test_padding_rows_and_tokens_are_neither_matched_nor_stored(resident):
    """The layer loop's validity mask: three prompts of 9, 7 and 5 tokens run as a prefill of 4 rows x 16 tokens
    (a padding row, padding tokens) and decode steps whose finished and padding rows still compute. The store
    then holds one map per request iteration: each prefill's map is the mean gate distribution over its prompt's
    own tokens and its key their mean embedding (as build_store makes them from the resident model's traces),
    and the padding row gets no prediction. Before, padded tokens entered the means and padding rows were
    matched and stored: this failed."""
    from flax import nnx

    from moejax.offload.predict.expert_maps import build_store
    from moejax.offload.predict.traces import record
    cfg = resident.config
    prompts = [list(range(3, 12)), list(range(40, 47)), list(range(60, 65))]
    engine = moejax.load(fixture_dir(NAME), dtype="float32", placement="cached", cache_slots=2 * cfg.num_experts,
                         predictor="expert_map")
    assert engine.padded_rows(3) > 3, "the fixture's batch is not padded: the test needs a padding row"
    predictor = engine.layered_steps.placement.predictor
    rows_seen: list[np.ndarray] = []
    predict = predictor.predict

    def recording(*args):
        out = predict(*args)
        rows_seen.extend(resolved(p)[0] for p in out.values() if isinstance(p, Pending))
        return out
    predictor.predict = recording
    outputs = engine.generate(prompts, 4)
    assert outputs == resident.generate(prompts, 4)
    predictor.drain()
    decodes = sum(len(o) - 1 for o in outputs)  # each row's decode iterations that fed a token
    assert len(predictor.store) == len(prompts) + decodes
    traces, _ = record(resident, prompts, max_tokens_per_prompt=16)
    embed = np.asarray(nnx.merge(resident.graphdef, resident.params).embed[...], np.float32)
    want = build_store(traces, embed, capacity=8)  # one prefill map per prompt, over its own tokens
    np.testing.assert_allclose(predictor.store.maps[:3], want.maps, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(predictor.store.embeddings[:3], want.embeddings, rtol=1e-5, atol=1e-6)
    assert rows_seen and all((ids[3:] < 0).all() for ids in rows_seen)  # the padding row: no experts predicted
