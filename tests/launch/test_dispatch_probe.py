"""launch.dispatch_probe on the CPU: it records a continuous run's decode calls at the batch asked for and replays
every variant of them (the numbers only mean something on a GPU, bench/README.md's fifth check); the XLA settings it
takes are applied only before JAX's backend starts."""
import argparse
import json
import os
import subprocess
import sys

import pytest

from launch import dispatch_probe
from launch.bench.results import read_runs
from moejax.serving import xla_startup

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow  # 40 s: a model's continuous run, then six replays
def test_the_probe_replays_every_variant_at_the_batch_asked_for(tmp_path, monkeypatch, capsys):
    out = tmp_path / "probe.json"
    monkeypatch.setattr(sys, "argv", ["dispatch_probe", "--model", "tiny-qwen3-moe", "--batch", "3", "--prompt-len",
                                      "20", "--max-new", "10", "--out", str(out)])
    dispatch_probe.main()
    [record] = read_runs(str(out))
    variants = record["variants"]
    assert record["decode_calls"] > 0 and record["decode_rows"] == [4]  # 3 rows as a power of two, not 16 rows
    assert record["config"] == dict(model="tiny-qwen3-moe", num_layers=4, dtype="float32", batch=3, prompt_len=20,
                                    requests=3, max_new=10)
    for name in ("as run", "inputs on device", "no donation", "no donation, exit checked every token",
                 "no donation, fixed trip count", "no donation, fixed trip count, inputs on device"):
        assert variants[name]["calls"] == record["decode_calls"] and variants[name]["wall_ms_per_call"] > 0
    assert variants["guard"] == "no read back to the host inside the dispatch"
    share = record["scheduler_host_share_of_decode"]
    assert 0 < share["share_without_dispatch"] < share["share"] < 1 and share["host_s"] > 0
    assert record["xla_startup"]["command_buffers"] is False
    assert "decode calls" in capsys.readouterr().out


def test_startup_settings_are_set_before_the_backend_and_refused_after():
    env = xla_startup.environment(True, 0.9, True, base={"XLA_FLAGS": "--xla_dump_to=/x --xla_gpu_enable_command_"
                                                                      "buffer=FUSION"})
    assert env == {"XLA_FLAGS": f"--xla_dump_to=/x {xla_startup.COMMAND_BUFFER_FLAG}={xla_startup.COMMAND_BUFFERS}",
                   xla_startup.MEM_FRACTION: "0.9", xla_startup.TFRT_GPU_CLIENT: "1"}
    with pytest.raises(SystemExit, match="--mem-fraction must be in"):
        xla_startup.environment(mem_fraction=1.5, base={})
    with pytest.raises(SystemExit, match="XLA_PYTHON_CLIENT_MEM_FRACTION is set too"):
        xla_startup.environment(mem_fraction=0.5, base={"XLA_PYTHON_CLIENT_MEM_FRACTION": ".5"})
    import jax
    jax.devices()  # the backend has started in this process: a setting now would silently not apply
    with pytest.raises(SystemExit, match="has started already"):
        xla_startup.apply(argparse.Namespace(command_buffers=True, mem_fraction=None, tfrt_gpu_client=False))


@pytest.mark.slow  # a fresh process, so that the settings come before JAX starts
def test_a_fresh_process_applies_and_records_the_settings():
    code = ("import argparse, json, jax; from moejax.serving import xla_startup\n"
            "r = xla_startup.apply(argparse.Namespace(command_buffers=True, mem_fraction=0.5, tfrt_gpu_client=True))\n"
            "jax.numpy.ones(2).block_until_ready(); print(json.dumps(r))")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", xla_startup.DEPRECATED_MEM_FRACTION)}
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=dict(env, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"))
    assert run.returncode == 0, run.stderr[-2000:]
    record = json.loads(run.stdout.strip().splitlines()[-1])
    assert record["variables"] == {"XLA_FLAGS": f"{xla_startup.COMMAND_BUFFER_FLAG}={xla_startup.COMMAND_BUFFERS}",
                                   xla_startup.MEM_FRACTION: "0.5", xla_startup.TFRT_GPU_CLIENT: "1"}
