"""The GPU check (`launch.gpu_check`): its CPU dry run runs every step in the order a short lease needs and writes
every output, so the script cannot rot between GPU runs; a benchmark stopped at its limit leaves its rows, once,
marked partial, and the check keeps them; --only runs chosen steps and the summary says how to run what did not
finish; its step runner keeps going past failing, slow and unreadable steps; the Pallas kernels step aside, with a
clear reason, when a JAX cannot run their Triton lowering."""
import argparse
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from jax._src import deprecations

from launch import gpu_check
from launch.bench.results import ResultsFile, read_runs, write_runs
from launch.bench.step_runner import Step, run_steps, table
from moejax.kernels.backends import Kernels
from moejax.kernels.platform import TRITON_DEPRECATION_ID, pallas_unavailable, resolve

# correctness before speed: the third GPU check spent its budget on benchmarks before two failing steps
STEPS = ["install", "environment", "ceilings", "kernel_tests", "parity_tests", "bench_generate", "offload_tests",
         "tune_gmm", "bench_kernels", "bench_offload", "bench_serve", "bench_plans"]
SWEEP = importlib.util.find_spec("launch.tune_gmm") is not None  # the tuning sweep's step is absent without it
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_dry_run_runs_every_step_and_writes_every_output(gpu_check_dry_run):
    """The dry run starts when the session is collected (conftest) and runs beside the other tests."""
    run = gpu_check_dry_run
    assert run["returncode"] == 0, run["stdout"][-5000:] + run["stderr"][-3000:]
    out, results = Path(run["out"]), Path(run["results"])
    record = json.loads((out / "gpu_check-cpu.json").read_text())
    status = {s["name"]: s["status"] for s in record["steps"]}
    assert list(status) == STEPS
    assert all(status[s] == ("absent" if s == "tune_gmm" and not SWEEP else "passed") for s in STEPS), status
    assert record["mode"] == "dry-run" and record["seconds"] < record["budget_s"] and "partial" not in record
    assert record["compilation_cache"]  # one persistent cache for every step

    env = record["environment"]
    assert env["device"]["platform"] == "cpu" and env["versions"]["jax"] and env["pallas_unavailable"] is None
    assert env["lowering"]["errors"] == {}
    assert env["lowering"]["triton_calls"]["expert_ffn"] == 2 and min(env["lowering"]["triton_calls"].values()) == 1
    for name in ("matmul_bf16", "device_stream", "h2d_pinned"):
        r = record["ceilings"]["jax"][name]
        assert r["value"] > 0 and len(r["seconds"]) == record["ceilings"]["sizes"]["repeats"]
    assert isinstance(record["ceilings"]["torch"], str)  # no CUDA here: says why instead of numbers

    kernels = {t["test"]: t["outcome"] for t in record["tests"]["kernel_tests"]["tests"]}
    assert kernels["tests/kernels/test_attention_kernels.py::test_explicit_edges[pallas_interpret]"] == "passed"
    assert kernels["tests/kernels/test_attention_kernels.py::test_cudnn_matches_oracle_on_gpu"] == "skipped"
    parity = record["tests"]["parity_tests"]
    assert parity["counts"] == {"passed": 2} and all("[qwen3_moe]" in t["test"] for t in parity["tests"])
    offload = record["tests"]["offload_tests"]["tests"]
    assert [(t["test"], t["outcome"]) for t in offload] == [
        ("tests/offload/test_offload.py::test_offloaded_store_lives_in_host_memory", "passed")]

    files = sorted(os.listdir(out))
    assert files == sorted(["generate-cpu.json", "gpu_check-cpu.json", "gpu_check-cpu.log", "kernels-cpu.json",
                            "offload-cpu.json", "plans-cpu.json", "serve-cpu.json"]
                           + (["tune_gmm-cpu.json"] if SWEEP else []))  # the device tool brings back at most 8
    assert len(files) <= 8
    for bench in ("kernels", "offload", "serve", "generate", "plans") + (("tune_gmm",) if SWEEP else ()):
        runs = json.loads((results / f"{bench}-cpu.json").read_text())["runs"]
        assert len(runs) == 1 and runs[0]["benchmark"] == bench and runs[0]["device"]["kind"] == "cpu"
        assert "partial" not in runs[0] and read_runs(str(out / f"{bench}-cpu.json")) == runs
        assert record["benchmarks"][bench] == f"{bench}-cpu.json"
    kernels = read_runs(str(results / "kernels-cpu.json"))[0]["results"]  # the dry run leaves it 100 KiB free:
    skipped = {r["name"] for r in kernels if "skipped" in r}  # what needs more is skipped, as on a GPU
    assert skipped == {"ragged_dot", "all_experts"} and all(r["skipped"].startswith("needs ") for r in kernels
                                                            if "skipped" in r)
    assert {"xla", "tiled", "dense_matmul"} <= {r["name"] for r in kernels if "seconds_median" in r}
    steps = read_runs(str(results / "generate-cpu.json"))[0]["results"][0]["step_times"]
    assert steps["decode"]["calls_recorded"] == steps["decode"]["steps"] > 0 and steps["run"]["replayed_s"] > 0
    assert len(json.loads((results / "gpu_check-cpu.json").read_text())["runs"]) == 1
    log = (out / "gpu_check-cpu.log").read_text()
    assert all(f"===== {s}:" in log for s in STEPS)
    summary = run["stdout"][run["stdout"].rindex("\nstep "):]
    assert all(s in summary for s in STEPS) and "every step finished" in summary


def test_a_partial_run_replaces_itself_and_the_complete_one_replaces_it(tmp_path):
    path = str(tmp_path / "kernels-cpu.json")
    write_runs(path, [{"benchmark": "kernels", "earlier": True}])
    results = ResultsFile(path)
    results.partial({"benchmark": "kernels", "results": [1]}, "gemm T=32 xla")
    results.partial({"benchmark": "kernels", "results": [1, 2]}, "gemm T=32 ragged_dot")
    earlier, now = read_runs(path)
    assert earlier == {"benchmark": "kernels", "earlier": True} and now["results"] == [1, 2] and now["partial"]
    assert now["progress"]["rows"] == 2 and now["progress"]["last"] == "gemm T=32 ragged_dot"
    assert results.complete({"benchmark": "kernels", "results": [1, 2, 3]}) == 2
    assert read_runs(path)[1] == {"benchmark": "kernels", "results": [1, 2, 3]}


@pytest.mark.slow
def test_a_benchmark_stopped_at_its_limit_leaves_its_rows_and_the_check_keeps_them(tmp_path):
    (tmp_path / "out").mkdir(), (tmp_path / "results").mkdir()
    check = gpu_check.Check(argparse.Namespace(out=str(tmp_path / "out"), results_dir=str(tmp_path / "results"),
                                               budget_s=60.0, only=None, cache_dir=None, dry_run=True, limits={}))
    check.tag = "cpu"  # as the environment step sets it
    step = check.step("bench_kernels")
    path = step.commands[0][-1]  # --out: the benchmark writes into the check's --out as it goes
    assert path == str(tmp_path / "out" / "kernels-cpu.json")
    slow = (f"import sys, time; sys.path.insert(0, {ROOT!r}); from launch.bench.results import ResultsFile\n"
            f"r = ResultsFile({path!r})\n"
            "r.partial({'benchmark': 'kernels', 'results': [1]}, 'gemm T=32 dense_matmul')\n"
            "r.partial({'benchmark': 'kernels', 'results': [1, 2]}, 'gemm T=32 xla')\n"
            "time.sleep(60)\n")
    [result] = run_steps([dataclasses.replace(step, commands=[[sys.executable, "-c", slow]], timeout_s=2)],
                         check.log, budget_s=60, echo=lambda line: None)
    assert result.status == "timeout" and result.seconds < 20
    assert result.detail.endswith("partial results (2 rows, the last gemm T=32 xla) in kernels-cpu.json")
    [kept] = read_runs(str(tmp_path / "results" / "kernels-cpu.json"))
    assert kept["partial"] and kept["results"] == [1, 2] and read_runs(path) == [kept]


@pytest.mark.slow
def test_only_runs_the_chosen_steps_and_says_how_to_run_what_did_not_finish(tmp_path, monkeypatch, capsys):
    """Fake steps: install and environment run first though not chosen; bench_kernels runs past its --limit;
    bench_plans then has under MIN_START_S of the 16 s budget left and is not started."""
    made = []

    def step(self, name):
        made.append(name)
        if name == "environment":
            return Step(name, "names the device", [], 30, read=lambda: setattr(self, "tag", "cpu") or "cpu")
        if name == "bench_kernels":
            return Step(name, "too slow", [[sys.executable, "-c", "import time; time.sleep(60)"]], self.limit(name))
        return Step(name, "passes", [], 30)
    monkeypatch.setattr(gpu_check.Check, "step", step)
    monkeypatch.chdir(ROOT)
    out = tmp_path / "out"
    code = gpu_check.main(["--dry-run", "--out", str(out), "--results-dir", str(tmp_path / "results"),
                           "--budget-s", "16", "--only", "bench_plans,bench_kernels", "--limit", "bench_kernels=1"])
    assert code == 1 and made == ["install", "environment", "bench_kernels", "bench_plans"]
    record = json.loads((out / "gpu_check-cpu.json").read_text())
    assert [(s["name"], s["status"]) for s in record["steps"]] == [
        ("install", "passed"), ("environment", "passed"), ("bench_kernels", "timeout"), ("bench_plans", "skipped")]
    assert record["only"] == ["bench_plans", "bench_kernels"] and "partial" not in record
    assert sorted(os.listdir(out)) == ["gpu_check-cpu.json", "gpu_check-cpu.log"]
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("not finished: bench_kernels, bench_plans; to run them: ")
    assert last.endswith(f"--out {out} --results-dir {tmp_path / 'results'} --budget-s 16 --dry-run --limit "
                         "bench_kernels=1 --only bench_kernels,bench_plans")
    with pytest.raises(SystemExit):
        gpu_check.main(["--out", str(out), "--only", "bench_kernel"])  # a misspelt step is an error, not a no-op


@pytest.mark.slow
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



@pytest.mark.slow
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
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    "-p", "launch.bench.pytest_outcomes",
                    str(tmp_path / "test_sample.py"), "--outcomes", str(out), "--rootdir", str(tmp_path)],
                   cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                   capture_output=True, timeout=120)
    lines = {json.loads(x)["test"].split("::")[-1]: json.loads(x) for x in out.read_text().splitlines()}
    assert {k: v["outcome"] for k, v in lines.items()} == {
        "test_ok": "passed", "test_bad": "failed", "test_skipped": "skipped", "test_known": "xfailed",
        "test_setup_error": "error"}
    assert "one is not two" in lines["test_bad"]["message"] and "fixture broke" in lines["test_setup_error"]["message"]
    assert lines["test_skipped"]["message"] == "Skipped: not here"


@pytest.mark.slow
def test_offload_decode_set_runs_every_placement_at_one_budget(tmp_path):
    """`--only offload_decode` (not in the full set): install, environment, then every decode placement side by side
    at tiny sizes, its JSON in --out and --results-dir. Exact placements give the resident tokens; the look-ahead
    oracle serves every pass it predicts and hits at least as often as LRU alone."""
    out, results = tmp_path / "out", tmp_path / "results"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XDG_CACHE_HOME=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-m", "launch.gpu_check", "--dry-run", "--only", "offload_decode", "--out",
                           str(out), "--results-dir", str(results)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    record = json.loads((out / "gpu_check-cpu.json").read_text())
    assert [(s["name"], s["status"]) for s in record["steps"]] == [
        ("install", "passed"), ("environment", "passed"), ("offload_decode", "passed")]
    run = read_runs(str(out / "offload_decode-cpu.json"))[-1]
    assert read_runs(str(results / "offload_decode-cpu.json")) == [run] and "partial" not in run
    decode = run["decode"]
    placements = gpu_check.OFFLOAD_DECODE_PLACEMENTS.split(",")
    assert decode["placements"] == placements
    rows = {(r["placement"], r["batch"], r["prompt_len"]): r for r in decode["rows"]}
    assert {p for p, _, _ in rows} == set(placements)
    work = [(w["batch"], w["prompt_len"]) for w in decode["workloads"]]
    for (name, b, t), r in rows.items():
        if "error" in r:  # only lightning may be refused at the 40%-like budget (its three layers of experts)
            assert name == "lightning" and r["error"].startswith("refused"), r
            continue
        assert r["tokens_per_s"] > 0 and r["tpot_s"] > 0 and r["ttft_s"] > 0 and 1 <= r["largest_batch"] <= b
        if name != "resident":
            assert r["tokens_equal_resident"], name  # every one here runs the true router's experts
            assert r["split"]["compute_s"] == rows[("resident", b, t)]["tpot_s"]
    for b, t in work:
        lru, oracle = rows[("cached-lru", b, t)], rows[("cached-oracle", b, t)]
        assert oracle["oracle"]["unmatched"] == 0 and oracle["oracle"]["served"] > 0
        assert oracle["hit_rate"] >= lru["hit_rate"]
    claim = decode["lightning_claim"]
    got = {r["placement"]: r for r in claim["rows"]}
    assert set(got) == {"lightning", "streamed", "cached-lru"} and "error" not in got["lightning"]
    assert got["lightning"]["largest_batch"] > got["streamed"]["largest_batch"]  # its KV lives in host memory
    assert claim["ratio_vs"]["streamed"] > 0 and got["lightning"]["hrm"]["measured_ms_per_layer"] > 0
    assert claim["host_attention"]["gb_per_s"] > 0 and claim["host_attention"]["read_gb_per_s"] > 0
