"""The GPU check's full-depth group (`--only full_depth`): its CPU dry run, on a deep micro model, runs
correctness, the dispatch probe, the full-depth decode and prefill benchmarks and the kernel rows, in that order,
with the ceilings it measured as their utilisation figures' denominators and the bytes and FLOPs behind them
written out; and the bytes a decode step reads are counted as the model's arrays hold them."""
import json
import os
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

import moejax
from launch import gpu_check
from launch.bench import decode_bytes
from launch.bench.results import read_runs

GROUP = ["install", "environment", "ceilings", "depth_tests", "dispatch_probe", "bench_decode_full",
         "bench_prefill_full", "bench_kernels"]


@pytest.mark.slow  # minutes, in the background from collection on (conftest), beside the other tests
def test_full_depth_dry_run_runs_its_steps_in_order(gpu_check_full_depth_dry_run):
    run = gpu_check_full_depth_dry_run
    assert run["returncode"] == 0, run["stdout"][-5000:] + run["stderr"][-3000:]
    out = Path(run["out"])
    record = json.loads((out / "gpu_check-cpu.json").read_text())
    assert [(s["name"], s["status"]) for s in record["steps"]] == [(s, "passed") for s in GROUP]
    assert record["only"] == GROUP and record["seconds"] < record["budget_s"]
    files = sorted(os.listdir(out))
    assert files == ["dispatch_probe-cpu.json", "generate-decode-cpu.json", "gpu_check-cpu.json", "gpu_check-cpu.log",
                     "kernels-cpu.json", "serve-full-cpu.json"]
    ceilings = {name: r["value"] for name, r in record["ceilings"]["jax"].items()}
    assert {t["outcome"] for t in record["tests"]["depth_tests"]["tests"]} == {"passed"}

    [probe] = read_runs(str(out / "dispatch_probe-cpu.json"))
    assert probe["config"]["model"] == "micro-qwen3-moe-deep" and probe["config"]["num_layers"] == 12
    assert probe["decode_calls"] > 0 and probe["xla_startup"]["command_buffers"]
    assert "--xla_gpu_enable_command_buffer=" in probe["xla_startup"]["variables"]["XLA_FLAGS"]

    [decode] = read_runs(str(out / "generate-decode-cpu.json"))
    assert decode["benchmark"] == "generate --decode-batches" and decode["config"]["num_layers"] == 12
    assert decode["config"]["weights"]["source"] == "preset, drawn on the device"
    assert decode["copy_ceiling"]["value"] == pytest.approx(ceilings["device_stream"], rel=1e-5)
    assert decode["xla_startup"]["command_buffers"]
    assert [r["batch"] for r in decode["results"]] == [1, 4]
    first = decode["results"][0]["first_run_compiles"]
    assert first["programs"] > 0 and first["compile_s_by_function"]
    for r in decode["results"]:
        assert r["output_tokens"] == r["requests"] * 17 == r["batch"] * 2 * 17
        b = r["bytes"]
        assert b["tokens"] == r["requests"] * 16  # every token after the chunk step's is a decode row's
        assert b["total"] == pytest.approx(b["dense_weights"] + b["embedding_rows"] + b["routed_experts"] + b["kv"])
        assert 0 < b["routed_experts"] and 0 < b["kv"]
        assert r["mean_rows"] <= r["batch"] and r["scheduler"]["peak_rows"] <= r["batch"]
        assert r["mbu"] is None or r["mbu"] == pytest.approx(b["total"] / r["decode_s"] / decode["copy_ceiling"][
            "value"] / 1e9)
        assert r["first_run_compiles"]["compile_s"] >= 0  # what no batch before it compiled
        assert 0 <= r["host_share_of_decode"]["share"] <= 1

    [prefill] = read_runs(str(out / "serve-full-cpu.json"))
    assert prefill["peak"]["flops_per_s"] == pytest.approx(ceilings["matmul_bf16"] * 1e12, rel=1e-5)
    [row] = prefill["results"]
    assert row["kv_cache"] == "off" and row["prompt_tokens"] == 8 * 32 and row["mfu"] > 0
    assert row["flops"]["total"] == row["flops"]["decoder_matmuls"] + row["flops"]["lm_head"] > 0
    assert row["first_run_compiles"]["programs"] > 0 and prefill["resident_prefill"] is None
    assert prefill["config"]["weights"]["materialize_s"] > 0


def test_a_group_goes_alone_and_a_stopped_group_reruns_in_its_order(capsys):
    with pytest.raises(SystemExit):
        gpu_check.main(["--out", "x", "--only", "full_depth,ceilings"])
    assert "a group (full_depth) goes alone" in capsys.readouterr().err
    assert gpu_check._order(["bench_kernels", "bench_decode_full"]) == [
        "install", "environment", "bench_decode_full", "bench_kernels"]  # the group's order, kernels last
    assert gpu_check._order(["bench_kernels", "ceilings"]) == ["install", "environment", "ceilings", "bench_kernels"]
    assert gpu_check._order(None) == gpu_check.ORDER


def test_expected_experts_is_what_random_routing_hits():
    rng = np.random.default_rng(0)
    for experts, k, tokens in ((128, 8, 1), (128, 8, 64), (128, 8, 256), (8, 2, 3)):
        hit = [len({e for _ in range(tokens) for e in rng.choice(experts, k, replace=False)}) for _ in range(400)]
        assert decode_bytes.expected_experts(experts, k, tokens) == pytest.approx(np.mean(hit), rel=0.02)


def test_a_decode_step_reads_the_arrays_the_model_holds():
    """Counted against the model's own arrays: with every expert hit, a step reads every weight but the embedding
    table (its rows instead); with one token, k experts a layer."""
    engine = moejax.load("micro-qwen3-moe", dtype="float32", compilation_cache=False)
    cfg, total = engine.config, engine.param_bytes()
    leaves = [(path, v.get_value()) for path, v in nnx.to_flat_state(engine.abstract_params)]
    routed = sum(np.prod(v.shape) * 4 for path, v in leaves if str(path[-1]).startswith("we_"))
    embedding = sum(np.prod(v.shape) * 4 for path, v in leaves if path == ("embed",))
    kv = engine.kv_bytes_per_token()
    every = decode_bytes.decode_step_bytes(cfg, total, 4, kv, rows=10_000, context=100)
    assert every["routed_experts"] == pytest.approx(routed)
    assert every["dense_weights"] + every["routed_experts"] == pytest.approx(total - embedding)
    assert every["kv"] == 10_000 * 100 * kv and every["embedding_rows"] == cfg.vocab_size * cfg.hidden_size * 4
    one = decode_bytes.decode_step_bytes(cfg, total, 4, kv, rows=1, context=7)
    assert one["routed_experts"] == pytest.approx(routed * cfg.num_experts_per_tok / cfg.num_experts)
    assert one["embedding_rows"] == cfg.hidden_size * 4 and one["kv"] == 7 * kv
    summed = decode_bytes.iterations_bytes(cfg, total, 4, kv, [(1, 7), (2, 30)])
    two = decode_bytes.decode_step_bytes(cfg, total, 4, kv, rows=2, context=15)
    assert summed["total"] == pytest.approx(one["total"] + two["total"]) and summed["tokens"] == 3
