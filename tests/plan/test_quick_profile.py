"""Without a hardware profile (a CPU has no datasheet), the choices that need one measure a quick profile at load,
cache it where launch.profile_devices writes, and say so: lightning's policy search, layout auto and DEP's auto
fields then work instead of refusing; later loads read the cached one without measuring. The cache folder is this
test's own (XDG_CACHE_HOME), so no other test sees the profile."""
import json
import os
import subprocess
import sys

import pytest
from conftest import fixture_dir

import moejax
from moejax.plan.paths import default_profile_path

pytestmark = pytest.mark.slow  # measures the device (about 10 s on one CPU device), then two CLI runs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_auto_choices_measure_a_quick_profile_once_and_cache_it(tmp_path, monkeypatch, capsys):
    import jax
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = default_profile_path(jax.devices()[0].device_kind)
    lightning = moejax.load(fixture_dir("qwen3_moe"), dtype="float32", placement="lightning")
    said = "no hardware profile for 1 x 'cpu': measured a quick one in"
    assert lightning.decisions[0].startswith(said) and f"cached it at {path} for later loads" in lightning.decisions[0]
    assert "from the policy search" in lightning.memory_budget.lightning.source
    assert f"note: {said}" in capsys.readouterr().err
    with open(path) as f:
        assert json.load(f)["source"] == "measured"
    again = moejax.load(fixture_dir("qwen3_moe"), dtype="float32", placement="lightning")
    assert not any("measured a quick one" in d for d in again.decisions)  # read from the cache
    assert "measured a quick one" not in capsys.readouterr().err
    # layout auto and DEP's auto fields on 8 simulated devices read it too (before: refused, no profile)
    (tmp_path / "in.jsonl").write_text('{"custom_id": "c", "url": "/v1/completions", "body": {"prompt": [1, 2], '
                                       '"max_tokens": 2}}\n')
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path), XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")
    for layout, chose in (("auto", "layout auto: "), ("attn=dp,experts=dep,r1=auto,r2=auto,order=auto",
                                                      "DEP r1, r2, order=auto: ")):
        run = subprocess.run([sys.executable, "-m", "launch.serve", "--model", "tiny-qwen3-moe", "--input",
                              str(tmp_path / "in.jsonl"), "--layout", layout, "--explain"], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-2000:]
        assert chose in run.stdout and "measured a quick one" not in run.stderr
