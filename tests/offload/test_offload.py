"""Offloaded placements against the resident model, float32: cached on every family fixture, streamed on the
families whose MoE blocks differ around the experts. Streamed and cached (exact) must give the resident logits
(relative max error <= 1e-6; the cached FFN stacks a subset of experts and, when a step needs more experts than
fit, sums passes, which may reorder float additions) and the same greedy tokens (cached: on the streamed
families)."""
import numpy as np
import pytest
from conftest import FIXTURE_NAMES, fast_tier, fixture_dir

import moejax
from moejax.costs import true_prefill_flops
from moejax.offload import ExpertCache
from moejax.offload.predict import DefaultVectors, calibrate
from moejax.offload.streamed import StreamedExpertsRuntime

PROMPTS = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11, 12, 13, 14]]
TOL = 1e-6


def _ids(cfg, shape=(2, 11), seed=0):
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, shape)


def _rel(out, ref):
    return float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))


@pytest.fixture(scope="module")
def resident_runs():
    cache = {}

    def run(name):
        if name not in cache:
            engine = moejax.load(fixture_dir(name), dtype="float32")
            cache[name] = engine.logits(_ids(engine.config)), engine.generate(PROMPTS, 6)
        return cache[name]
    return run


def _small_cache(cfg) -> int:
    return cfg.num_experts_per_tok + 1  # evictions on every layer, and passes when a step needs more experts


# The *_nonorm fixtures differ from their family only in attention norms, which offloading does not touch. The
# cache sees each family's routing (experts, top-k, groups), so it runs on every family; streaming moves a whole
# layer's experts whatever the routing, so what varies for it is the block around them: plain (qwen3_moe), dense
# first layers and shared experts (deepseek_v3), a gated shared expert (qwen2_moe), expert biases (gpt_oss).
FAMILIES = [n for n in FIXTURE_NAMES if not n.endswith("_nonorm")]
STREAMED = ["qwen3_moe", "deepseek_v3", "qwen2_moe", "gpt_oss"]


EXACT = ([(n, "cached") for n in FAMILIES] + [(n, "streamed") for n in STREAMED]
         + [(n, "streamed_in_jit") for n in STREAMED[1:]])


@pytest.mark.parametrize("name, placement", fast_tier(EXACT, lambda p: p in (
    ("qwen3_moe", "cached"), ("qwen3_moe", "streamed"), ("deepseek_v3", "streamed_in_jit"))))
def test_exact_placements_equal_resident(name, placement, resident_runs):
    ref_logits, ref_tokens = resident_runs(name)
    cfg = moejax.load(fixture_dir(name)).config
    options = {"streamed": dict(placement="streamed", window=1),
               "streamed_in_jit": dict(placement="streamed", stream="jit"),
               "cached": dict(placement="cached", cache_slots=_small_cache(cfg), eviction="lfu")}[placement]
    engine = moejax.load(fixture_dir(name), dtype="float32", **options)
    assert _rel(engine.logits(_ids(cfg)), ref_logits) <= TOL
    if name in STREAMED:  # decoding through the cache: on the four blocks; routing variants differ in logits
        assert engine.generate(PROMPTS, 6) == ref_tokens
    if placement == "streamed_in_jit":  # the jits take the experts from host memory; XLA copies them
        assert engine.stats() == {"placement": "streamed", "stream": "jit"}
        mlp = engine.params["layers"][engine.config.moe_layers.index(True)]["mlp"]
        assert mlp["we_gate_up"].get_value().sharding.memory_kind == "pinned_host"
        return
    stats = engine.stats()["total"]
    assert stats["misses"] + stats["hits"] > 0 and stats["bytes_h2d"] > 0


@pytest.mark.parametrize("name", fast_tier(["qwen3_moe", "deepseek_v3", "gpt_oss"]))
def test_speculative_with_the_oracle_equals_resident(name, resident_runs):
    ref_logits, ref_tokens = resident_runs(name)
    cfg = moejax.load(fixture_dir(name)).config
    engine = moejax.load(fixture_dir(name), dtype="float32", placement="cached", cache_slots=cfg.num_experts,
                         predictor="oracle", speculative=True, eviction="priority")
    assert _rel(engine.logits(_ids(cfg)), ref_logits) <= TOL
    if name in STREAMED:  # decoding through the cache: on the four blocks; routing variants differ in logits
        assert engine.generate(PROMPTS, 6) == ref_tokens
    total = engine.stats()["total"]
    assert total["speculated_tokens"] > 0 and total["mispredicted_tokens"] == total["mispredicted_choices"] == 0
    assert total["prefetches"] > 0


class _Recording(StreamedExpertsRuntime):
    """A real streamed run that also writes down which experts each MoE layer's tokens used."""

    def __init__(self, *args):
        super().__init__(*args)
        self.log = []

    def moe(self, layer, x, y, idx, weights):
        self.log.append((layer.index, np.unique(np.asarray(idx))))
        return super().moe(layer, x, y, idx, weights)


@pytest.mark.parametrize("policy", ["lru", "lfu", "priority"])
def test_cache_counts_match_a_replay(policy):
    name = "qwen3_moe"
    streamed = moejax.load(fixture_dir(name), dtype="float32", placement="streamed", window=1)
    steps = streamed.layered_steps
    steps.placement = recorder = _Recording(streamed.store, 1, streamed.kernels.experts)
    cfg = streamed.config
    streamed.logits(_ids(cfg))
    streamed.generate(PROMPTS, 5)

    slots = _small_cache(cfg)
    cached = moejax.load(fixture_dir(name), dtype="float32", placement="cached", cache_slots=slots, eviction=policy)
    cached.logits(_ids(cfg))
    cached.generate(PROMPTS, 5)

    replay, per_pass = ExpertCache(slots, policy), cached.memory_budget.pass_experts
    expected = {}
    for layer, experts in recorder.log:
        for start in range(0, len(experts), per_pass):
            hits, loads, _ = replay.request([(layer, int(e)) for e in experts[start: start + per_pass]])
            h, m = expected.get(layer, (0, 0))
            expected[layer] = (h + len(hits), m + len(loads))
    got = {layer: (s["hits"], s["misses"]) for layer, s in cached.stats()["layers"].items()}
    assert got == expected
    assert cached.stats()["total"]["bytes_h2d"] == sum(m for _, m in expected.values()) * \
        cached.store.expert_bytes(steps.moe_layers[0])


def test_router_predictor_exact_and_speculative(tmp_path, resident_runs):
    name = "qwen3_moe"
    ref_logits, ref_tokens = resident_runs(name)
    resident = moejax.load(fixture_dir(name), dtype="float32")
    cfg = resident.config
    prompts = [list(r) for r in _ids(cfg, (4, 20), seed=1)]
    vectors = calibrate(resident, prompts)
    moe_layers = [i for i in range(cfg.num_layers) if cfg.is_moe(i)]
    # every valid token is counted once per chosen expert (batch padding is not)
    assert vectors.counts[moe_layers].sum(axis=1).tolist() == [80 * cfg.num_experts_per_tok] * len(moe_layers)
    path = vectors.save(str(tmp_path / "vectors"))
    loaded = DefaultVectors.load(path)
    np.testing.assert_array_equal(loaded.vectors, vectors.vectors)

    slots = 2 * cfg.num_experts
    exact = moejax.load(fixture_dir(name), dtype="float32", placement="cached", cache_slots=slots,
                        predictor="router", default_vectors=path)
    assert _rel(exact.logits(_ids(cfg)), ref_logits) <= TOL
    assert exact.generate(PROMPTS, 6) == ref_tokens
    assert exact.stats()["total"]["prefetches"] > 0

    spec = moejax.load(fixture_dir(name), dtype="float32", placement="cached", cache_slots=slots,
                       predictor="router", default_vectors=path, speculative=True)
    out = spec.logits(_ids(cfg))
    total = spec.stats()["total"]
    assert np.isfinite(out).all()
    assert 0 < total["speculated_tokens"] and 0 <= total["mispredicted_tokens"] <= total["speculated_tokens"]
    assert total["mispredicted_tokens"] <= total["mispredicted_choices"] <= \
        cfg.num_experts_per_tok * total["mispredicted_tokens"]
    if total["mispredicted_tokens"]:  # speculation changed the experts of some tokens: outputs move with them
        assert _rel(out, ref_logits) > TOL
    per_layer = spec.stats()["layers"]
    assert per_layer[moe_layers[0]]["speculated_tokens"] == 0  # nothing predicts the first MoE layer


def test_offloaded_store_lives_in_host_memory():
    for placement in ("streamed", "cached"):
        engine = moejax.load("tiny-qwen3-moe", dtype="float32", placement=placement)
        params = engine.params
        mlp = params["layers"][0]["mlp"]
        assert mlp["we_gate_up"].get_value().shape == () and mlp["router"].get_value().ndim == 2  # stand-in / real
        arrays = engine.store.arrays(0)["we_gate_up"]
        for a in (arrays if engine.store.per_expert else [arrays]):
            assert a.sharding.memory_kind == "pinned_host"
        assert engine.layer_experts(0)["we_gate_up"].sharding.memory_kind == "device"


@pytest.mark.parametrize("options, message", [
    (dict(placement="everywhere"), "placement must be one of"),
    (dict(placement="cached", window=2), "window applies to placement 'streamed'"),
    (dict(placement="streamed", cache_slots=4), "cache_slots applies to placement 'cached'"),
    (dict(placement="cached", eviction="fifo"), "eviction must be one of"),
    (dict(placement="cached", predictor="router"), "needs default_vectors"),
    (dict(placement="cached", predictor="tea leaves"), "predictor must be one of"),
    (dict(placement="cached", speculative=True), "speculative=True needs a predictor"),
    (dict(placement="streamed", window=0), "window must be an int >= 1"),
    (dict(placement="streamed", stream="gpu"), "stream must be one of python, jit"),
    (dict(placement="streamed", stream="jit", window=2), "window applies to stream='python'"),
    (dict(placement="cached", stream="jit"), "stream applies to placement 'streamed'"),
    (dict(placement="cached", cache_slots=1), "at least top-k"),
    (dict(placement="cached", predictor="router", default_vectors="/nonexistent/vectors"), "cannot read"),
])
def test_bad_offload_options_are_clear_errors(options, message):
    with pytest.raises(ValueError, match=message):
        moejax.load("tiny-qwen3-moe", **options)


def test_saturation_profile_and_explain():
    from moejax.measure.saturation import profile_saturation
    engine = moejax.load("tiny-qwen3-moe", dtype="float32", placement="streamed", window=1)
    sat = profile_saturation(engine, tokens=64)
    assert sat.theta_flops == pytest.approx((1 + sat.epsilon) * max(sat.streamed_s.values()) / sat.t0_s * sat.ref_flops)
    # F_ref in Θ's unit, the one the scheduler admits batches in: true FLOPs, the reference row's attention included
    assert sat.ref_flops == pytest.approx(true_prefill_flops(engine.config, 64))
    assert sat.t0_s == sat.compute_s[engine.layered_steps.moe_layers[0]]
    assert sorted(sat.streamed_s) == engine.layered_steps.moe_layers
    assert engine.stats()["total"]["bytes_h2d"] == 0  # the profile's own transfers are not counted
    text = engine.explain()
    assert "memory budget: streamed" in text and "saturation threshold" in text and "window 1" in text
    with pytest.raises(ValueError, match="not 'streamed'"):
        profile_saturation(moejax.load("tiny-qwen3-moe", placement="cached"))


@pytest.mark.slow  # calibration and a second cached engine (about 20 s); one layer ahead is in the fast tier
def test_router_predictor_two_moe_layers_ahead(tmp_path, resident_runs):
    name = "gpt_oss"  # three MoE layers: layer 0 predicts layer 2 through layer 1's predicted routing
    ref_logits, ref_tokens = resident_runs(name)
    resident = moejax.load(fixture_dir(name), dtype="float32")
    path = calibrate(resident, [list(r) for r in _ids(resident.config, (2, 16), seed=2)]).save(str(tmp_path / "v"))
    engine = moejax.load(fixture_dir(name), dtype="float32", placement="cached", cache_slots=16, predictor="router",
                         default_vectors=path, prefetch_distance=2)
    assert _rel(engine.logits(_ids(resident.config)), ref_logits) <= TOL
    assert engine.generate(PROMPTS, 6) == ref_tokens
    layers = engine.stats()["layers"]
    assert layers[2]["prefetches"] > 0 and layers[1]["prefetches"] == 0


@pytest.mark.parametrize("name", fast_tier(["qwen3_moe", "deepseek_v3", "gpt_oss"]))
def test_bfloat16_placements_stay_within_bfloat16_rounding(name):
    """In bfloat16 the fused resident jit may keep excess precision between ops that the layer-by-layer steps
    round at their jit boundaries: results agree to bf16 rounding (measured <= 1.3% max relative here), and
    the two offloaded placements run the same layer-wise code, so they agree exactly."""
    ids = _ids(moejax.load(fixture_dir(name)).config)
    ref = moejax.load(fixture_dir(name)).logits(ids)
    streamed = moejax.load(fixture_dir(name), placement="streamed").logits(ids)
    cached = moejax.load(fixture_dir(name), placement="cached", cache_slots=64).logits(ids)
    assert _rel(streamed, ref) <= 3e-2
    np.testing.assert_array_equal(streamed, cached)
