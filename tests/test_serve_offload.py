"""launch.serve with the routed experts offloaded: a model over the device budget serves the same results as
the resident model (float32: same tokens, log-probabilities within 1e-5), scoring with the prefix KV cache
and completions alike, and the run metrics carry the offloading counters."""
import json
import os
import subprocess
import sys

import pytest

import moejax
from conftest import fixture_dir
from moejax.offload.memory_plan import RESERVE_FRACTION

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
    plan = moejax.load(fixture_dir(NAME), dtype="float32").memory_plan
    return (plan.resident_bytes + 2.5 * plan.layer_expert_bytes) / (1 - RESERVE_FRACTION) / 2**30


def _serve(tmp_path, tag, *flags):
    inp, out, metrics = tmp_path / "in.jsonl", tmp_path / f"{tag}.jsonl", tmp_path / f"{tag}.json"
    inp.write_text("\n".join(_lines()) + "\n")
    run = subprocess.run([sys.executable, "-m", "launch.serve", "--model", fixture_dir(NAME), "--dtype", "float32",
                          "--input", str(inp), "--output", str(out), "--metrics", str(metrics), "--kv-cache", "on",
                          "--max-batch-tokens", "64", *flags], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    return [json.loads(line) for line in out.read_text().splitlines()], json.loads(metrics.read_text())


def _same(rows, ref):
    for row, want in zip(rows, ref, strict=True):
        body, want = row["response"]["body"], want["response"]["body"]
        if body["object"] == "score":
            for got_r, want_r in zip(body["results"], want["results"], strict=True):
                assert [c["token_ids"] for c in got_r["candidates"]] == [c["token_ids"] for c in want_r["candidates"]]
                for c, w in zip(got_r["candidates"], want_r["candidates"]):
                    assert c["logprob"] == pytest.approx(w["logprob"], rel=1e-5, abs=1e-5)
        else:
            assert [c["token_ids"] for c in body["choices"]] == [c["token_ids"] for c in want["choices"]]
            for c, w in zip(body["choices"], want["choices"]):
                if w["logprobs"] is not None:
                    assert c["logprobs"]["token_logprobs"] == pytest.approx(w["logprobs"]["token_logprobs"], abs=1e-5)


def test_a_model_over_the_budget_serves_streamed_and_cached(tmp_path):
    budget = _budget_gb()
    assert moejax.load(fixture_dir(NAME), dtype="float32", device_memory_gb=budget).memory_plan.placement == "streamed"
    ref, ref_metrics = _serve(tmp_path, "resident")
    assert ref_metrics["offload"] == {"placement": "resident"} and ref_metrics["requests_ok"] == 8
    for placement in ("streamed", "cached"):
        rows, metrics = _serve(tmp_path, placement, "--placement", placement, "--device-memory-gb", f"{budget:.9f}")
        _same(rows, ref)
        assert metrics["requests_ok"] == 8 and metrics["cached_prompt_tokens"] > 0
        assert metrics["offload"]["placement"] == placement and metrics["offload"]["total"]["bytes_h2d"] > 0


def test_explain_prints_the_memory_plan_and_the_saturation_threshold(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(_lines()) + "\n")
    run = subprocess.run([sys.executable, "-m", "launch.serve", "--model", fixture_dir(NAME), "--input", str(inp),
                          "--placement", "streamed", "--window", "1", "--explain"], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert "memory plan: streamed (window 1" in run.stdout and "saturation threshold: Θ" in run.stdout
    bad = subprocess.run([sys.executable, "-m", "launch.serve", "--model", fixture_dir(NAME), "--input", str(inp),
                          "--placement", "resident", "--device-memory-gb", "0.0001", "--dtype", "bfloat16"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)  # bf16: the dense weights fit, the experts not
    assert bad.returncode != 0 and "placement 'resident': all routed experts need" in bad.stderr


def test_calibrate_and_distill_clis_then_serve_with_the_router_and_hybrid_predictors(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(_lines()) + "\nnot json\n")
    out = tmp_path / "vectors"
    run = subprocess.run([sys.executable, "-m", "launch.calibrate", "--model", fixture_dir(NAME), "--dtype",
                          "float32", "--input", str(inp), "--out", str(out)], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert "8 prompts" in run.stderr and "1 bad lines skipped" in run.stderr
    ref, _ = _serve(tmp_path, "resident")
    rows, metrics = _serve(tmp_path, "router", "--placement", "cached", "--cache-slots", "8", "--predictor", "router",
                           "--default-vectors", str(out))
    _same(rows, ref)
    assert metrics["offload"]["total"]["prefetches"] > 0
    again = subprocess.run([sys.executable, "-m", "launch.calibrate", "--model", fixture_dir(NAME), "--input",
                            str(inp), "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode != 0 and "already exists" in again.stderr
    est = tmp_path / "estimator"
    run = subprocess.run([sys.executable, "-m", "launch.distill", "--model", fixture_dir(NAME), "--dtype", "float32",
                          "--input", str(inp), "--out", str(est), "--steps", "20", "--batch", "64", "--latent", "16",
                          "--mlp", "32", "--no-progress"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert "hybrid: estimator on layers" in run.stderr
    rows, metrics = _serve(tmp_path, "hybrid", "--placement", "cached", "--cache-slots", "8", "--predictor", "hybrid",
                           "--estimator", str(est))
    _same(rows, ref)  # exact mode: the predictor only moves weights
    assert metrics["offload"]["total"]["prefetches"] > 0
