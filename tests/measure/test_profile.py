"""launch.profile_devices: a quick measured profile on 8 simulated CPU devices loads as a Profile, every figure is
positive and finite, and the profile predicts ops timed afresh in this process within a factor of 3 (CPU timings
in a busy test run are noisy; a fit that described another machine, or mixed up units, would be off by far more)."""
import json
import math
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding

from moejax.measure import hardware as measure
from moejax.plan.datasheets import load_profile
from moejax.plan.hardware import LINKS
from moejax.plan.paths import default_profile_path, device_tag

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FACTOR = 3.0  # predicted vs fresh timing
ATTEMPTS = 5  # fresh timings tried before a mismatch counts (another test may hold the cores for a moment)


def run_profile(*args, timeout=180):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    return subprocess.run([sys.executable, "-m", "launch.profile_devices", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("profile") / "cpu.json")
    done = run_profile("--quick", "--out", path)
    assert done.returncode == 0, done.stderr[-3000:]
    return path, done.stdout


@pytest.mark.slow
def test_quick_profile_loads_and_every_figure_is_positive(measured):
    path, stdout = measured
    profile = load_profile(path)
    assert profile.source == "measured"
    assert profile.name == device_tag(_cpu().device_kind)
    assert profile.gpus == 8 and profile.gpus_per_node == 8 and profile.dtype_bytes == 2
    for proc in (profile.device, profile.host):
        for value in (proc.memory_bytes, proc.flops, proc.bandwidth, proc.launch_s):
            assert math.isfinite(value) and value > 0, proc
    for name in ("matmul", "grouped", "attention"):
        curve = getattr(profile.device, name)
        assert curve.sizes and len(curve.sizes) == len(curve.rates), name
        assert all(a < b for a, b in zip(curve.sizes, curve.sizes[1:], strict=False)), name
        assert all(math.isfinite(r) and r > 0 for r in curve.rates), name
    assert profile.device.flops == max(max(getattr(profile.device, c).rates) for c in ("matmul", "grouped",
                                                                                       "attention"))
    for name in LINKS:
        link = getattr(profile, name)
        assert link.alpha_s >= 0 and math.isfinite(link.alpha_s), name
        assert link.bandwidth > 0 and math.isfinite(link.bandwidth), name
    assert "simulated CPU devices" in profile.notes and "network is the d2d fit" in profile.notes
    with open(path) as f:  # exactly Profile's fields: the file is what load_profile reads, nothing more
        assert set(json.load(f)) == set(profile.as_dict())
    for name in ("h2d", "d2d", *measure.COLLECTIVES):
        assert any(line.strip().startswith(name) and "R2" in line for line in stdout.splitlines()), name
    assert "profile cpu (measured)" in stdout


def _cpu():
    """The profile measured CPU devices: time them here too, even where this process has a GPU."""
    return jax.devices("cpu")[0]


def _median_seconds(fn, repeats=5):
    return measure.median_seconds(fn, repeats)


def _within_factor(predicted: float, fresh_timing) -> tuple[bool, list[float]]:
    seen = []
    for _ in range(ATTEMPTS):
        seen.append(fresh_timing())
        if predicted / FACTOR <= seen[-1] <= predicted * FACTOR:
            return True, seen
    return False, seen


@pytest.mark.slow
def test_profile_predicts_a_matmul_timed_afresh(measured):
    profile = load_profile(measured[0])
    shapes = measure.Shapes.generic(quick=True)
    m, D, F = max(measure.QUICK.rows), shapes.hidden, shapes.dense_width
    predicted = profile.device.op_time(2 * m * D * F, 2 * (m * D + D * F + m * F), "matmul", size=m)
    x = jax.device_put(jnp.ones((m, D), jnp.bfloat16), _cpu())
    w = jax.device_put(jnp.ones((D, F), jnp.bfloat16), _cpu())
    matmul = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(a.dtype))
    ok, seen = _within_factor(predicted, lambda: _median_seconds(lambda: matmul(x, w)))
    assert ok, f"[{m}, {D}] x [{D}, {F}]: predicted {predicted * 1e3:.2f} ms, timed {[s * 1e3 for s in seen]} ms"


@pytest.mark.slow
def test_profile_predicts_a_memory_pass_timed_afresh(measured):
    profile = load_profile(measured[0])
    x = jax.device_put(np.zeros(measure.QUICK.bandwidth_bytes // 4, np.float32), _cpu())
    predicted = profile.device.op_time(0, 2 * x.nbytes)
    add_one = jax.jit(lambda a: a + 1)
    ok, seen = _within_factor(predicted, lambda: _median_seconds(lambda: add_one(x)))
    assert ok, f"x + 1 over {x.nbytes} B: predicted {predicted * 1e3:.2f} ms, timed {[s * 1e3 for s in seen]} ms"


@pytest.mark.slow
def test_profile_predicts_a_host_to_device_copy_timed_afresh(measured):
    profile = load_profile(measured[0])
    device = _cpu()
    array = np.ones(max(measure.QUICK.transfer_bytes) // 4, np.float32)
    pinned = jax.device_put(array, SingleDeviceSharding(device, memory_kind="pinned_host"))
    to_device = SingleDeviceSharding(device, memory_kind="device")
    predicted = profile.h2d.time(array.nbytes)
    ok, seen = _within_factor(predicted, lambda: _median_seconds(lambda: jax.device_put(pinned, to_device)))
    assert ok, f"{array.nbytes} B to the device: predicted {predicted * 1e3:.2f} ms, timed {[s * 1e3 for s in seen]} ms"


def test_unwritable_out_is_a_clear_error_before_measuring(tmp_path, capsys):
    from launch.profile_devices import main
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    start = time.perf_counter()
    assert main(["--quick", "--out", str(blocker / "profile.json")]) == 2
    out = capsys.readouterr()
    assert "cannot write the profile to" in out.err and "is a file, not a folder" in out.err, out.err
    assert "measuring on" not in out.out  # refused before any measurement
    assert time.perf_counter() - start < 5
    assert main(["--quick", "--out", str(tmp_path)]) == 2 and "is a directory" in capsys.readouterr().err


def test_unknown_model_is_a_clear_error(capsys):
    from launch.profile_devices import main
    assert main(["--quick", "--model", "no-such-model", "--out", os.devnull]) == 2
    err = capsys.readouterr().err
    assert "--model no-such-model" in err and "presets" in err


def test_default_profile_path_follows_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_profile_path("NVIDIA H100 80GB HBM3") == str(tmp_path / "moejax" / "profiles" /
                                                                 "NVIDIA_H100_80GB_HBM3.json")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_profile_path("cpu") == os.path.expanduser("~/.cache/moejax/profiles/cpu.json")


def test_device_tag_matches_the_benchmarks():
    from launch.bench.provenance import device_tag as bench_tag
    for kind in ("NVIDIA H100 80GB HBM3", "cpu", "  TPU v5 lite ", "a/b:c", ""):
        assert device_tag(kind) == bench_tag(kind)


def test_alpha_beta_fit_recovers_a_line_and_clamps_alpha():
    sizes = [2**i for i in range(10, 20, 2)]
    fit = measure.fit_alpha_beta([(n, 20e-6 + n / 5e9) for n in sizes])
    assert fit.link.alpha_s == pytest.approx(20e-6, rel=1e-6) and fit.link.bandwidth == pytest.approx(5e9, rel=1e-6)
    assert fit.r2 == pytest.approx(1.0)
    convex = measure.fit_alpha_beta([(n, n / 1e9 * (0.2 + n / 2**18)) for n in sizes])  # a line through it: α < 0
    assert convex.link.alpha_s == 0 and convex.link.bandwidth > 0
    flat = measure.fit_alpha_beta([(n, 1e-3) for n in sizes])  # overhead swamps every size
    assert flat.link.alpha_s == 0 and flat.link.bandwidth == pytest.approx(sizes[-1] / 1e-3) and flat.note


def test_sent_bytes_follow_the_ring_convention():
    assert measure.sent_bytes("all_to_all", 800, 8) == 700
    assert measure.sent_bytes("reduce_scatter", 800, 8) == 700
    assert measure.sent_bytes("all_gather", 100, 8) == 700  # (P-1)/P of the 800-byte result


def test_model_shapes_follow_the_config():
    from launch.profile_devices import model_shapes
    shapes = model_shapes("qwen3-30b-a3b", quick=False)
    assert (shapes.hidden, shapes.dense_width, shapes.experts, shapes.expert_width) == (2048, 6144, 128, 768)
    assert (shapes.heads, shapes.kv_heads, shapes.d_qk, shapes.d_v) == (32, 4, 128, 128)
    mla = model_shapes("deepseek-v2-lite", quick=False)
    assert (mla.heads, mla.kv_heads, mla.d_qk, mla.d_v) == (16, 16, 192, 128)
