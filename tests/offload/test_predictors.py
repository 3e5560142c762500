"""Learned expert predictors: routing traces, the distilled estimator and the predictors built on it,
replayed over traces and run in the cached placement against the resident float32 model."""
import json
import os

import numpy as np
import pytest
from conftest import fixture_dir

import moejax
from moejax.offload.predict import (
    EstimatorNet,
    EstimatorPredictor,
    HybridPredictor,
    OraclePredictor,
    PreviousHiddenPredictor,
    RouterPredictor,
    replay,
)
from moejax.offload.predict.traces import Traces, record
from moejax.train.distill import choose_hybrid, distill
from moejax.train.model import forward_with_router

TOL = 1e-6
# gpt_oss: three MoE layers (distance 1 and 2 both have pairs), expert biases; deepseek_v3: a dense first layer
# and a correction bias, which routing from predicted logits must apply.
NAME = "gpt_oss"


def _prompts(cfg, n=20, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, cfg.vocab_size, size=int(rng.integers(8, 32))).tolist() for _ in range(n)]


def _rel(out, ref):
    return float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))


@pytest.fixture(scope="module")
def resident():
    return moejax.load(fixture_dir(NAME), dtype="float32")


@pytest.fixture(scope="module")
def recorded(resident):
    return record(resident, _prompts(resident.config))


@pytest.fixture(scope="module")
def distilled(resident, recorded, tmp_path_factory):
    """A short distillation, saved and loaded back: (EstimatorNet as trained, its directory)."""
    traces, vectors = recorded
    net = distill(replay.steps_of(resident), traces, vectors, train_steps=120, batch=256, lr=3e-3, latent=32,
                  mlp=64, eval_every=40, validation_every=5, log=lambda *a: None, progress=False)
    path = net.save(str(tmp_path_factory.mktemp("estimator") / "est"))
    return net, path


def test_traces_hold_each_prompts_tokens_and_the_models_router_logits(resident, recorded, tmp_path):
    traces, vectors = recorded
    prompts = _prompts(resident.config)
    assert traces.tokens.tolist() == [t for p in prompts for t in p]
    assert np.diff(traces.starts).tolist() == [len(p) for p in prompts]
    cfg = resident.config
    assert traces.moe_layers == [i for i in range(cfg.num_layers) if cfg.is_moe(i)]
    # the router logits the training forward sees for the first prompt, alone
    import jax.numpy as jnp
    from flax import nnx
    model = nnx.merge(resident.graphdef, resident.params)
    _, router = forward_with_router(model, jnp.asarray([prompts[0]]), resident.kernels)
    for m in range(len(traces.moe_layers)):
        np.testing.assert_allclose(traces.router_logits[:len(prompts[0]), m], np.asarray(router[m]), rtol=1e-5,
                                   atol=1e-5)
    assert vectors.counts[traces.moe_layers].sum() == len(traces.tokens) * len(traces.moe_layers) * \
        cfg.num_experts_per_tok
    traces.save(str(tmp_path / "t.npz"))
    back = Traces.load(str(tmp_path / "t.npz"))
    assert back.moe_layers == traces.moe_layers and np.array_equal(back.residual, traces.residual)
    train, held = traces.split(5)
    assert train.num_prompts + held.num_prompts == traces.num_prompts
    assert len(train.tokens) + len(held.tokens) == len(traces.tokens)


def test_oracle_replay_recalls_everything_and_baselines_are_measured(resident, recorded):
    traces, vectors = recorded
    steps = replay.steps_of(resident)
    assert replay.recall_by_layer(steps, OraclePredictor(), traces)["overall"] == 1.0
    for predictor in (RouterPredictor(vectors, 1), PreviousHiddenPredictor(1), PreviousHiddenPredictor(2)):
        out = replay.recall_by_layer(steps, predictor, traces)
        assert sorted(out["per_layer"]) == traces.moe_layers[predictor.distance:]
        assert all(0.0 <= r <= 1.0 for r in out["per_layer"].values())


def test_distillation_lowers_the_validation_kl_and_round_trips(distilled):
    net, path = distilled
    history = net.info["history"]
    assert history[-1]["validation_kl"] < history[0]["validation_kl"]
    assert history[-1]["train_kl"] < history[0]["train_kl"]
    back = EstimatorNet.load(path)
    assert back.shape == net.shape and back.info["hybrid_layers"] == net.info["hybrid_layers"]
    assert all(np.array_equal(np.asarray(back.params[k]), np.asarray(net.params[k])) for k in net.params)
    np.testing.assert_array_equal(back.vectors.vectors, net.vectors.vectors)
    with open(os.path.join(path, "estimator.json")) as f:
        assert json.load(f)["shape"]["distance"] == 1


def test_choose_hybrid_takes_the_estimator_where_the_router_is_worse():
    router = {1: 0.5, 2: 0.9, 3: 0.7}
    estimator = {1: 0.8, 2: 0.6, 3: 0.75}
    tau, layers = choose_hybrid(router, estimator)
    assert layers == [1, 3] and 0.7 < tau <= 0.9
    assert choose_hybrid(router, {1: 0.1, 2: 0.1, 3: 0.1}) == (0.0, [])  # never better: no estimator layer


@pytest.mark.parametrize("predictor", ["estimator", "hybrid", "previous_hidden"])
def test_exact_cached_with_each_new_predictor_equals_resident(predictor, resident, distilled):
    _, path = distilled
    cfg = resident.config
    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 11))
    ref = resident.logits(ids)
    options = dict(estimator=path) if predictor != "previous_hidden" else {}
    engine = moejax.load(fixture_dir(NAME), dtype="float32", placement="cached", cache_slots=2 * cfg.num_experts,
                         predictor=predictor, **options)
    assert _rel(engine.logits(ids), ref) <= TOL
    assert engine.stats()["total"]["prefetches"] > 0


def test_speculative_estimator_runs_its_predictions(resident, distilled):
    _, path = distilled
    cfg = resident.config
    engine = moejax.load(fixture_dir(NAME), dtype="float32", placement="cached", cache_slots=2 * cfg.num_experts,
                         predictor="estimator", estimator=path, speculative=True)
    out = engine.logits(np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 11)))
    total = engine.stats()["total"]
    assert np.isfinite(out).all() and total["speculated_tokens"] > 0
    assert engine.stats()["layers"][engine.layered_steps.moe_layers[0]]["speculated_tokens"] == 0


def test_replay_uses_the_predictors_own_code(resident, recorded, distilled):
    """Hybrid = the estimator on its chosen target layers and the router predictor elsewhere, layer by layer."""
    net, _ = distilled
    traces, _ = recorded
    steps = replay.steps_of(resident)
    est = replay.recall_by_layer(steps, EstimatorPredictor(net), traces)["per_layer"]
    router = replay.recall_by_layer(steps, RouterPredictor(net.vectors, 1), traces)["per_layer"]
    hybrid = replay.recall_by_layer(steps, HybridPredictor(net), traces)["per_layer"]
    for t, r in hybrid.items():
        assert r == (est[t] if t in net.info["hybrid_layers"] else router[t])


@pytest.mark.parametrize("options, message", [
    (dict(predictor="estimator"), "needs estimator"),
    (dict(predictor="previous_hidden", estimator="/x"), "estimator applies to predictor"),
    (dict(predictor="estimator", estimator="/nonexistent/est"), "holds no estimator.json"),
])
def test_bad_estimator_options_are_clear_errors(options, message):
    with pytest.raises(ValueError, match=message):
        moejax.load("tiny-qwen3-moe", placement="cached", **options)


def test_an_estimator_serves_only_its_own_distance(distilled):
    _, path = distilled
    with pytest.raises(ValueError, match="differs from the estimator's, built for distance 1"):
        moejax.load(fixture_dir(NAME), placement="cached", predictor="estimator", estimator=path,
                    prefetch_distance=2)


def test_launch_distill_from_text_writes_a_servable_estimator(tmp_path, capsys):
    from launch.distill import main
    text = tmp_path / "docs"
    text.mkdir()
    (text / "a.txt").write_text("def add(a, b):\n    return a + b\n" * 40)
    out = tmp_path / "est"
    assert main(["--model", fixture_dir("qwen3_moe"), "--text", str(text), "--out", str(out), "--window", "32",
                 "--tokens", "640", "--steps", "30", "--batch", "128", "--latent", "16", "--mlp", "32",
                 "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "validation recall per target layer" in err and "hybrid: estimator on layers" in err
    net = EstimatorNet.load(str(out))
    assert net.info["train_tokens"] + net.info["validation_tokens"] <= 640 and net.info["source"] == str(text)
    engine = moejax.load(fixture_dir("qwen3_moe"), dtype="float32", placement="cached", predictor="hybrid",
                         estimator=str(out))
    assert "hybrid" in engine.explain()
    with pytest.raises(SystemExit, match="already exists"):
        main(["--model", fixture_dir("qwen3_moe"), "--text", str(text), "--out", str(out)])


def test_cache_replay_counts_hits_misses_and_bytes():
    from moejax.offload.predict.cache_replay import replay_cache
    truth = [np.array([[0, 1], [0, 1], [2, 3]]), np.array([[1, 2], [1, 2], [1, 2]])]  # 2 MoE layers, 3 tokens
    cold = replay_cache(truth, [1, 3], slots=8, policy="lru", expert_bytes=10)
    # layer 1: miss miss, hit hit, miss miss; layer 3: miss miss, hit hit, hit hit
    assert (cold["hits"], cold["misses"], cold["prefetch_loads"]) == (6, 6, 0) and cold["bytes_moved"] == 60
    oracle = {1: (truth[0], np.ones((3, 2))), 3: (truth[1], np.ones((3, 2)))}
    warm = replay_cache(truth, [1, 3], slots=8, policy="lru", predicted=oracle, distance=0, expert_bytes=10)
    assert warm["hit_rate"] == 1.0 and warm["prefetch_loads"] == 6 and warm["bytes_moved"] == 60
    # layer 1 predicts layer 3's experts after it runs; with 2 slots each prefetch evicts what layer 1 used, so
    # layer 3 always hits and layer 1 always misses
    ahead = {3: (truth[1], np.ones((3, 2)))}
    tight = replay_cache(truth, [1, 3], slots=2, policy="lru", predicted=ahead, distance=1, expert_bytes=1)
    assert (tight["hits"], tight["misses"], tight["prefetch_loads"], tight["bytes_moved"]) == (6, 6, 6, 12)


@pytest.mark.slow  # a whole benchmark or CLI run end to end (tens of seconds)
def test_bench_predictors_reports_every_measure(tmp_path):
    import argparse

    from launch.bench import predictors as bench_predictors
    parser = argparse.ArgumentParser()
    bench_predictors.add_parser(parser.add_subparsers())
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.py").write_text("for i in range(10):\n    print(i, i * i)\n" * 30)
    args = parser.parse_args(["predictors", "--model", fixture_dir("qwen3_moe"), "--dtype", "float32", "--text",
                              str(docs), "--train-text", str(docs), "--tokens", "256", "--train-tokens", "512",
                              "--distill-steps", "10", "--window", "64", "--cache-tokens", "32", "--slots", "4,16",
                              "--speculative-windows", "1", "--plot", str(tmp_path / "recall.png"),
                              "--maps-plot", str(tmp_path / "maps.png")])
    out = bench_predictors.predictors(args, {})
    names = {(r["predictor"], r["distance"]) for r in out["recall"]}
    assert names == {("oracle", 0)} | {(n, 1) for n in ("previous_hidden", "router", "estimator", "hybrid",
                                                         "expert_map", "moe_infinity")}
    matrices = next(r for r in out["recall"] if r["predictor"] == "moe_infinity")
    assert 0 < matrices["overall"] <= 1 and len(matrices["per_layer"]) >= 1
    maps = next(r for r in out["recall"] if r["predictor"] == "expert_map")
    assert maps["set_size"] >= 2 and len(maps["per_layer"]) >= 1
    assert next(r for r in out["recall"] if r["predictor"] == "oracle")["overall"] == 1.0
    assert {(c["policy"], c["slots"]) for c in out["cache"]} == {(p, s) for p in ("lru", "lfu", "priority")
                                                                for s in (4, 16)}
    assert all(c["hit_rate"] == 1.0 for c in out["cache"] if c["prefetch"] == "oracle")
    assert all(c["bytes_moved"] > 0 for c in out["cache"])
    spec = {s["predictor"]: s for s in out["speculative"]}
    assert set(spec) == {"previous_hidden", "router", "estimator", "hybrid"}
    assert all(s["perplexity"] > 1 and s["multiple_choice"] == 0 for s in spec.values())  # no --input here
    assert {c["prefetch"] for c in out["cache"]} == {"none", "oracle", "previous_hidden", "router", "estimator",
                                                     "hybrid", "expert_map", "moe_infinity"}
    assert os.path.getsize(tmp_path / "recall.png") > 0 and "expert maps built from" in out["estimators"]
    drift = {(r["representation"], r["distance"]): r["mean"] for r in out["analyses"]["cosine_drift"]}
    assert set(drift) == {("true", 0), ("previous_hidden", 1), ("quasi_hidden", 1)}
    assert drift[("true", 0)] == pytest.approx(1.0, abs=1e-6)
    assert all(len(r["hit_rate_by_rank"]) == 2 for r in out["analyses"]["rank_alignment"])  # top-2 model
    ablation = out["expert_map_ablation"]
    # the expert maps' three and Fig. 12a's coarse request-level hit counts, counted from the calibration traces
    assert [v["variant"] for v in ablation["variants"]] == ["T", "T+S", "T+S+δ", "Hit count"]
    assert all(len(v["cache"]) == 4 and 0 < v["recall"] <= 1 for v in ablation["variants"])
    assert [s["maps"] for s in ablation["store_sizes"]] == sorted(s["maps"] for s in ablation["store_sizes"])
    assert os.path.getsize(tmp_path / "maps.png") > 0


def test_router_free_chains_each_prediction_from_the_previous_one(resident, distilled):
    """§6.4: with router_free the estimator at layer l is fed the routing it predicted for l, not the router's."""
    net, _ = distilled
    seen = []

    class Recording(EstimatorPredictor):
        def predict(self, pass_no, layer, x, y, idx, weights):
            out = super().predict(pass_no, layer, x, y, idx, weights)
            seen.append((layer, np.asarray(idx), {t: np.asarray(i) for t, (i, _) in out.items()}))
            return out

    cfg = resident.config
    ids = np.random.default_rng(6).integers(0, cfg.vocab_size, (2, 11))
    for router_free in (False, True):
        seen.clear()
        engine = moejax.load(fixture_dir(NAME), dtype="float32", placement="cached", cache_slots=2 * cfg.num_experts,
                             predictor=Recording(net), speculative=True, router_free=router_free)
        engine.logits(ids)
        (_, _, made0), (l1, given1, _) = seen[0], seen[1]
        assert np.array_equal(given1, made0[l1]) == router_free
    with pytest.raises(ValueError, match="router_free=True applies to speculative=True"):
        moejax.load(fixture_dir(NAME), placement="cached", predictor="oracle", router_free=True)


def test_router_free_skips_the_router_unless_mispredictions_are_counted(resident, distilled):
    """§6.4: a router-free layer whose experts were predicted attends without the router (LayeredSteps' attend);
    count_mispredictions runs it anyway, only to count, and the logits do not change."""
    from moejax.offload import layered_steps
    net, _ = distilled
    cfg = resident.config
    ids = np.random.default_rng(7).integers(0, cfg.vocab_size, (2, 9))
    logits = {}
    for count in (False, True):
        engine = moejax.load(fixture_dir(NAME), dtype="float32", placement="cached", cache_slots=2 * cfg.num_experts,
                             predictor=EstimatorPredictor(net), speculative=True, router_free=True,
                             count_mispredictions=count)
        logits[count] = engine.logits(ids)
        steps = engine.layered_steps
        first, *later = [steps.layers[i] for i in steps.moe_layers]
        # nothing predicted for it yet
        assert first.ran(layered_steps.attend_route) and not first.ran(layered_steps.attend)
        assert later and all(layer.ran(layered_steps.attend_route) == count != layer.ran(layered_steps.attend)
                             for layer in later)
        total = engine.stats()["total"]
        assert total["speculated_tokens"] > 0 and total["speculated_tokens"] % len(later) == 0  # padded rows too
        assert total["checked_tokens"] == (total["speculated_tokens"] if count else 0)
        assert ("mispredictions not counted" in engine.explain()) != count
    assert _rel(logits[False], logits[True]) < TOL
    with pytest.raises(ValueError, match="count_mispredictions=True applies to router_free=True"):
        moejax.load(fixture_dir(NAME), placement="cached", predictor="oracle", speculative=True,
                    count_mispredictions=True)


def test_best_answers_pick_the_candidate_with_the_highest_log_probability(resident):
    from moejax.eval.speculation_cost import best_answers
    from moejax.requests.parse import Candidate, ScoreRequest
    prompt = (5, 9, 2, 7)
    candidates = tuple(Candidate(None, (t,)) for t in (3, 11, 17))
    request = ScoreRequest(1, "mc", prompt, (), candidates)
    logits = resident.logits([list(prompt)])[0, -1]
    assert best_answers(resident, [request]) == [int(np.argmax(logits[[3, 11, 17]]))]
