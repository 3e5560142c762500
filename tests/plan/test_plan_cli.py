"""`python -m launch.plan`: the JSON contract outside checks read, what-if overrides, plots, and clear errors."""
import json
import os

import pytest

from launch import plan as cli


def _json(capsys, *argv) -> dict:
    assert cli.main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_dep_json_has_the_contract_fields_and_the_exhaustive_search_agrees(capsys):
    out = _json(capsys, "dep", "--model", "deepseek-v2-lite", "--profile", "h100", "--tokens", "16384", "--devices",
                "8", "--exhaustive")
    fields = ("attn_devices", "expert_devices", "r1", "r2", "order")
    for key in fields + ("predicted_tokens_per_s", "solve_ms"):
        assert key in out and key in out["exhaustive"], key
    assert [out[k] for k in fields] == [out["exhaustive"][k] for k in fields]
    assert out["attn_devices"] + out["expert_devices"] == 8 and out["order"] in ("asas", "aass")
    assert out["speedup_vs_pppipe"] >= 1.0 and out["speedup_vs_default"] >= 1.0  # FinDEP's space holds both


def test_lightning_json_on_s1(capsys):
    out = _json(capsys, "lightning", "--model", "mixtral-8x7b", "--profile", "t4", "--prompt-len", "418",
                "--gen-len", "128")
    for key in ("N", "mu", "A_g", "F_g", "r_w", "r_c", "predicted_tokens_per_s", "solve_ms"):
        assert key in out, key
    assert (out["A_g"], out["F_g"]) == (0, 1) and out["executable"] is True  # CPU attention: placement lightning
    assert "placement 'lightning'" in out["note"]


def test_theta_json_and_a_what_if_override(capsys):
    base = _json(capsys, "theta", "--model", "mixtral-8x7b", "--profile", "h100")
    assert base["source"].startswith("Eq. 1") and base["theta_tokens"] > 0
    slow = _json(capsys, "theta", "--model", "mixtral-8x7b", "--profile", "h100", "--override", "h2d.bandwidth=32e9")
    assert slow["theta_flops"] == pytest.approx(2 * base["theta_flops"], rel=1e-3)  # half the bandwidth, twice Θ


def test_plots_are_written(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    for planner, extra in (("dep", ["--devices", "8", "--tokens", "8192"]), ("theta", []),
                           ("lightning", ["--prompt-len", "256"])):
        out = _json(capsys, planner, "--model", "mixtral-8x7b", "--profile", "a100", "--plot", str(tmp_path), *extra)
        assert out["plots"] and all(os.path.getsize(p) > 10_000 for p in out["plots"]), planner


@pytest.mark.parametrize("argv, message", [
    (["theta", "--model", "mixtral-8x7b", "--profile", "v100"], "neither a datasheet profile"),
    (["theta", "--model", "gpt-5", "--profile", "h100"], "--model 'gpt-5' is neither a checkpoint directory"),
    (["theta", "--model", "mixtral-8x7b", "--profile", "h100", "--override", "h2d.speed=1e9"],
     "Link has no field 'speed'"),
    (["theta", "--model", "mixtral-8x7b", "--profile", "h100", "--override", "h2d.bandwidth=fast"],
     "'fast' is not a number"),
    (["theta", "--model", "mixtral-8x7b", "--profile", "h100", "--override", "h2d"], "expected FIELD=VALUE"),
    (["dep", "--model", "mixtral-8x7b", "--profile", "h100", "--devices", "1"], "launch.plan dep: "),
])
def test_bad_arguments_name_what_is_wrong(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert message in str(e.value)


def test_serve_explains_theta_by_eq1_with_its_plot(tmp_path, capsys):
    """launch.serve --theta eq1 takes Θ from the hardware profile (no profiling pass), --explain prints it and
    --plot draws it; without a profile for the device (this CPU) it says how to get one."""
    pytest.importorskip("matplotlib")
    from launch import serve
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": [1, 2, 3, 4], "max_tokens": 2}\n')
    args = ["--input", str(inp), "--model", "tiny-qwen3-moe", "--placement", "streamed", "--window", "1",
            "--theta", "eq1", "--explain"]
    assert serve.main(args + ["--profile", "h100", "--plot", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "saturation threshold (Eq. 1 from profile h100 (datasheet))" in out
    assert os.path.getsize(tmp_path / "theta.png") > 10_000
    with pytest.raises(SystemExit) as e:
        serve.main(args)
    assert "--theta eq1: no hardware profile for" in str(e.value) and "launch.profile_devices" in str(e.value)


def _serve_on_two_devices(tmp_path, *flags):
    """launch.serve --explain of 40 short scoring lines under resident experts=async_ep, in a process with 2
    simulated CPU devices -> the finished process."""
    import subprocess
    import sys
    inp = tmp_path / "score.jsonl"
    inp.write_text("".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/score",
                                       "body": {"prompt_token_ids": [i + 1] * 24, "candidate_token_ids": [[9], [10]]}})
                           + "\n" for i in range(40)))
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "launch.serve", "--input", str(inp), "--model", "tiny-qwen3-moe",
                           "--layout", "attn=dp,experts=async_ep", "--max-batch-tokens", "32", "--explain", *flags],
                          env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_serve_fills_resident_asyncep_batches_to_eq1(tmp_path):
    """Resident experts=async_ep takes Θ by Eq. 1 in its all-gather channel under the default --theta
    (profile: not measurable on whole-model jits), --explain prints it and the scoring batches fill to it (40 short
    sequences in one batch, past the 32-token budget); without a hardware profile serve says it applies no Θ."""
    run = _serve_on_two_devices(tmp_path, "--profile", "h100")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "saturation threshold (Eq. 1 from profile h100 (datasheet))" in run.stdout
    assert "(async_ep; one MoE layer's experts" in run.stdout and "\n1 batches:" in run.stdout
    bare = _serve_on_two_devices(tmp_path)
    assert bare.returncode == 0, bare.stderr[-3000:]
    assert "saturation threshold" not in bare.stdout and "\n1 batches:" not in bare.stdout
    assert "takes Θ from Eq. 1, which needs a hardware profile: no hardware profile for 2 x" in bare.stderr
