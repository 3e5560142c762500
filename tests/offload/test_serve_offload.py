"""launch.serve with the routed experts offloaded: a model over the device budget serves the same results as
the resident model (float32: same tokens, log-probabilities within 1e-5), scoring with the prefix KV cache
and completions alike, and the run metrics carry the offloading counters. The CLIs (launch.serve,
launch.calibrate, launch.distill) run in this process, through their main(argv): tests/serving/test_serve.py runs
launch.serve as a process where the process is the point."""
import json

import pytest
from conftest import fixture_dir

import moejax
from launch import calibrate as calibrate_cli
from launch import distill as distill_cli
from launch import serve as serve_cli
from moejax.offload.memory_budget import RESERVE_FRACTION

NAME = "gpt_oss"  # three MoE layers, sinks and a sliding window


def _lines() -> list[str]:
    shared = list(range(10, 42))  # two prefix blocks shared by every request: the KV pool is read and written
    out = []
    for i in range(4):
        body = {"prompt_token_ids": shared + [50 + i, 60 + i], "candidate_token_ids": [[70], [71, 72], [73]]}
        out.append(json.dumps({"custom_id": f"s{i}", "url": "/v1/score", "body": body}))
        body = {"prompt_token_ids": shared + [80 + i], "max_tokens": 6}
        if i % 2:  # several sampled choices from one prefill, and their log-probabilities
            body.update(n=2, temperature=0.8, seed=i, logprobs=2)
        out.append(json.dumps({"custom_id": f"c{i}", "url": "/v1/completions", "body": body}))
    return out


def _budget_gb() -> float:
    """Room for the resident weights and 2.5 of the model's 3 layers of experts."""
    plan = moejax.load(fixture_dir(NAME), dtype="float32").memory_budget
    return (plan.resident_bytes + 2.5 * plan.layer_expert_bytes) / (1 - RESERVE_FRACTION) / 2**30


def _input(tmp_path, extra: str = ""):
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(_lines()) + "\n" + extra)
    return inp


def _serve(tmp_path, tag, *flags):
    inp, out, metrics = _input(tmp_path), tmp_path / f"{tag}.jsonl", tmp_path / f"{tag}.json"
    status = serve_cli.main(["--model", fixture_dir(NAME), "--dtype", "float32", "--input", str(inp), "--output",
                             str(out), "--metrics", str(metrics), "--kv-cache", "on", "--max-batch-tokens", "64",
                             *flags])
    assert status == 0
    return [json.loads(line) for line in out.read_text().splitlines()], json.loads(metrics.read_text())


@pytest.fixture(scope="module")
def resident(tmp_path_factory):
    """The resident model's rows and metrics: what every offloaded run must reproduce."""
    return _serve(tmp_path_factory.mktemp("resident"), "resident")


def _same(rows, ref):
    for row, want in zip(rows, ref, strict=True):
        body, want = row["response"]["body"], want["response"]["body"]
        if body["object"] == "score":
            for got_r, want_r in zip(body["results"], want["results"], strict=True):
                assert [c["token_ids"] for c in got_r["candidates"]] == [c["token_ids"] for c in want_r["candidates"]]
                for c, w in zip(got_r["candidates"], want_r["candidates"], strict=True):
                    assert c["logprob"] == pytest.approx(w["logprob"], rel=1e-5, abs=1e-5)
        else:
            assert [c["token_ids"] for c in body["choices"]] == [c["token_ids"] for c in want["choices"]]
            for c, w in zip(body["choices"], want["choices"], strict=True):
                if w["logprobs"] is not None:
                    assert c["logprobs"]["token_logprobs"] == pytest.approx(w["logprobs"]["token_logprobs"], abs=1e-5)


@pytest.mark.slow  # a whole benchmark or CLI run end to end (tens of seconds)
def test_a_model_over_the_budget_serves_streamed_and_cached(tmp_path, resident):
    budget = _budget_gb()
    engine = moejax.load(fixture_dir(NAME), dtype="float32", device_memory_gb=budget)
    assert engine.memory_budget.placement == "streamed"
    ref, ref_metrics = resident
    assert ref_metrics["offload"] == {"placement": "resident"} and ref_metrics["requests_ok"] == 8
    for placement in ("streamed", "cached"):
        rows, metrics = _serve(tmp_path, placement, "--placement", placement, "--device-memory-gb", f"{budget:.9f}")
        _same(rows, ref)
        assert metrics["requests_ok"] == 8 and metrics["cached_prompt_tokens"] > 0
        assert metrics["offload"]["placement"] == placement and metrics["offload"]["total"]["bytes_h2d"] > 0


def test_explain_prints_the_memory_plan_and_the_saturation_threshold(tmp_path, capsys):
    inp = _input(tmp_path)
    assert serve_cli.main(["--model", fixture_dir(NAME), "--input", str(inp), "--placement", "streamed", "--window",
                           "1", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "memory budget: streamed (window 1" in out and "saturation threshold: Θ" in out
    with pytest.raises(SystemExit) as bad:  # bf16: the dense weights fit, the experts not
        serve_cli.main(["--model", fixture_dir(NAME), "--input", str(inp), "--placement", "resident",
                        "--device-memory-gb", "0.0001", "--dtype", "bfloat16"])
    assert bad.value.code.startswith("--placement resident: all routed experts need"), bad.value.code


@pytest.mark.slow  # a whole benchmark or CLI run end to end (tens of seconds)
def test_calibrate_and_distill_clis_then_serve_with_the_router_and_hybrid_predictors(tmp_path, capsys, resident):
    inp = _input(tmp_path, "not json\n")
    out = tmp_path / "vectors"
    assert calibrate_cli.main(["--model", fixture_dir(NAME), "--dtype", "float32", "--input", str(inp), "--out",
                               str(out)]) == 0
    err = capsys.readouterr().err
    assert "8 prompts" in err and "1 bad lines skipped" in err
    ref, _ = resident
    rows, metrics = _serve(tmp_path, "router", "--placement", "cached", "--cache-slots", "8", "--predictor", "router",
                           "--default-vectors", str(out))
    _same(rows, ref)
    assert metrics["offload"]["total"]["prefetches"] > 0
    with pytest.raises(SystemExit) as again:
        calibrate_cli.main(["--model", fixture_dir(NAME), "--input", str(inp), "--out", str(out)])
    assert "already exists" in again.value.code
    est = tmp_path / "estimator"
    assert distill_cli.main(["--model", fixture_dir(NAME), "--dtype", "float32", "--input", str(inp), "--out",
                             str(est), "--steps", "20", "--batch", "64", "--latent", "16", "--mlp", "32",
                             "--no-progress"]) == 0
    assert "hybrid: estimator on layers" in capsys.readouterr().err
    rows, metrics = _serve(tmp_path, "hybrid", "--placement", "cached", "--cache-slots", "8", "--predictor", "hybrid",
                           "--estimator", str(est))
    _same(rows, ref)  # exact mode: the predictor only moves weights
    assert metrics["offload"]["total"]["prefetches"] > 0
