"""The GPU check (`launch.gpu_check`): its CPU dry run runs every step and writes every output, so the script
cannot rot between GPU runs; its step runner keeps going past failing, slow and unreadable steps; the Pallas
kernels step aside, with a clear reason, when a JAX cannot run their Triton lowering."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from jax._src import deprecations

from launch.step_runner import Step, run_steps, table
from moejax.kernels.backends import TRITON_DEPRECATION_ID, Kernels, pallas_unavailable, resolve

STEPS = ["install", "environment", "ceilings", "kernel_tests", "parity_tests", "bench_kernels", "bench_offload",
         "bench_serve", "offload_tests", "bench_generate", "bench_plans"]


def test_dry_run_runs_every_step_and_writes_every_output(gpu_check_dry_run):
    """The dry run starts when the session is collected (conftest) and runs beside the other tests."""
    run = gpu_check_dry_run
    assert run["returncode"] == 0, run["stdout"][-5000:] + run["stderr"][-3000:]
    out, results = Path(run["out"]), Path(run["results"])
    record = json.loads((out / "gpu_check-cpu.json").read_text())
    status = {s["name"]: s["status"] for s in record["steps"]}
    assert list(status) == STEPS
    assert all(status[s] == "passed" for s in STEPS), status
    assert record["mode"] == "dry-run" and record["seconds"] < record["budget_s"]

    env = record["environment"]
    assert env["device"]["platform"] == "cpu" and env["versions"]["jax"] and env["pallas_unavailable"] is None
    assert env["lowering"]["errors"] == {}
    assert env["lowering"]["triton_calls"]["expert_ffn"] == 2 and min(env["lowering"]["triton_calls"].values()) == 1
    for name in ("matmul_bf16", "device_stream", "h2d_pinned"):
        r = record["ceilings"]["jax"][name]
        assert r["value"] > 0 and len(r["seconds"]) == record["ceilings"]["sizes"]["repeats"]
    assert isinstance(record["ceilings"]["torch"], str)  # no CUDA here: says why instead of numbers

    kernels = {t["test"]: t["outcome"] for t in record["tests"]["kernel_tests"]["tests"]}
    assert kernels["tests/test_attention_kernels.py::test_explicit_edges[pallas_interpret]"] == "passed"
    assert kernels["tests/test_attention_kernels.py::test_cudnn_matches_oracle_on_gpu"] == "skipped"
    parity = record["tests"]["parity_tests"]
    assert parity["counts"] == {"passed": 2} and all("[qwen3_moe]" in t["test"] for t in parity["tests"])
    offload = record["tests"]["offload_tests"]["tests"]
    assert [(t["test"], t["outcome"]) for t in offload] == [
        ("tests/test_offload.py::test_offloaded_store_lives_in_host_memory", "passed")]

    files = sorted(os.listdir(out))
    assert files == ["generate-cpu.json", "gpu_check-cpu.json", "gpu_check-cpu.log", "kernels-cpu.json",
                     "offload-cpu.json", "plans-cpu.json", "serve-cpu.json"]  # the device tool brings back at most 8
    for bench in ("kernels", "offload", "serve", "generate", "plans"):
        runs = json.loads((results / f"{bench}-cpu.json").read_text())["runs"]
        assert len(runs) == 1 and runs[0]["benchmark"] == bench and runs[0]["device"]["kind"] == "cpu"
        assert record["benchmarks"][bench] == f"{bench}-cpu.json"
    assert len(json.loads((results / "gpu_check-cpu.json").read_text())["runs"]) == 1
    log = (out / "gpu_check-cpu.log").read_text()
    assert all(f"===== {s}:" in log for s in STEPS)
    summary = run["stdout"][run["stdout"].rindex("step "):]
    assert all(s in summary for s in STEPS)


def test_runner_keeps_going_past_failing_slow_and_unreadable_steps(tmp_path):
    log, py = str(tmp_path / "log"), sys.executable

    def unreadable():
        raise KeyError("ceilings")
    steps = [Step("fails", "exits 3", [[py, "-c", "print('boom'); raise SystemExit(3)"], [py, "-c", "print('never')"]],
                  30),
             Step("slow", "sleeps past its limit", [[py, "-c", "import time; time.sleep(60)"]], 1.5),
             Step("unreadable", "passes, but its outputs cannot be read", [[py, "-c", "pass"]], 30, read=unreadable),
             Step("absent", "not written yet", [], 30, absent="no such module"),
             Step("passes", "still runs", [[py, "-c", "print('ran')"]], 30, read=lambda: "read ok")]
    results = run_steps(steps, log, budget_s=60, echo=lambda line: None)
    got = {r.name: (r.status, r.detail) for r in results}
    assert got["fails"] == ("failed", f"exit status 3 from {py} -c print('boom'); raise SystemExit(3)")
    assert got["slow"][0] == "timeout" and results[1].seconds < 10
    assert got["unreadable"] == ("failed", "its outputs could not be read: KeyError: 'ceilings'")
    assert got["absent"] == ("absent", "no such module") and got["passes"] == ("passed", "read ok")
    text = open(log).read()
    assert "boom" in text and "never" not in text and "ran" in text
    assert "FAILED" in table(results) and "TIMEOUT" in table(results)

    late = run_steps(steps[-1:], log, budget_s=5, echo=lambda line: None)  # under MIN_START_S left: not started
    assert late[0].status == "skipped" and "not started" in late[0].detail


@pytest.fixture
def triton_deprecation_is_an_error():
    """The state a JAX that turns its Triton deprecation (0.11) into an error leaves: deprecations.warn raises."""
    registered = TRITON_DEPRECATION_ID in deprecations._registered_deprecations
    if not registered:
        deprecations.register(TRITON_DEPRECATION_ID)
    before = deprecations.is_accelerated(TRITON_DEPRECATION_ID)
    deprecations.accelerate(TRITON_DEPRECATION_ID)
    yield
    if registered:
        deprecations._registered_deprecations[TRITON_DEPRECATION_ID].accelerated = before
    else:
        deprecations.unregister(TRITON_DEPRECATION_ID)


def test_pallas_kernels_step_aside_when_jax_refuses_triton(triton_deprecation_is_an_error):
    why = pallas_unavailable()
    assert why is not None and "Triton deprecation into an error" in why
    message = Kernels.parse("experts=pallas_interpret,attention=xla").unavailable()
    assert message.startswith("experts=pallas_interpret needs Pallas's Triton backend") and "use auto or xla" in message
    assert Kernels.parse("xla").unavailable() is None
    assert resolve("expert_ffn", "auto", ("xla", "pallas")) == "xla"



def test_outcomes_plugin_records_each_test_as_it_ends(tmp_path):
    (tmp_path / "test_sample.py").write_text(
        "import pytest\n"
        "def test_ok(): pass\n"
        "def test_bad(): assert 1 == 2, 'one is not two'\n"
        "@pytest.mark.skip(reason='not here')\n"
        "def test_skipped(): pass\n"
        "@pytest.mark.xfail(reason='known')\n"
        "def test_known(): assert False\n"
        "@pytest.fixture\n"
        "def broken(): raise RuntimeError('fixture broke')\n"
        "def test_setup_error(broken): pass\n")
    out = tmp_path / "outcomes.jsonl"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "launch.pytest_outcomes",
                    str(tmp_path / "test_sample.py"), "--outcomes", str(out), "--rootdir", str(tmp_path)],
                   cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), capture_output=True, timeout=120)
    lines = {json.loads(x)["test"].split("::")[-1]: json.loads(x) for x in out.read_text().splitlines()}
    assert {k: v["outcome"] for k, v in lines.items()} == {
        "test_ok": "passed", "test_bad": "failed", "test_skipped": "skipped", "test_known": "xfailed",
        "test_setup_error": "error"}
    assert "one is not two" in lines["test_bad"]["message"] and "fixture broke" in lines["test_setup_error"]["message"]
    assert lines["test_skipped"]["message"] == "Skipped: not here"
