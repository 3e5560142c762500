import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
FIXTURE_NAMES = sorted(d for d in os.listdir(FIXTURES) if os.path.isfile(os.path.join(FIXTURES, d, "config.json")))


def fixture_dir(name: str) -> str:
    return os.path.join(FIXTURES, name)


# The fast tier (`-m "not slow"`) runs a test over model families on the ones FAST_FAMILIES names (GQA and MLA);
# the full suite, CI's, runs every family.
FAST_FAMILIES = ("qwen3_moe", "deepseek_v3")


def fast_tier(params, fast=lambda p: p in FAST_FAMILIES) -> list:
    """A parametrization's values, those for which fast(value) is false marked slow: they run in the full suite only.
    A tuple is one test's several arguments."""
    return [p if fast(p) else pytest.param(*(p if isinstance(p, tuple) else (p,)), marks=pytest.mark.slow)
            for p in params]


def reference(name: str) -> dict:
    with np.load(os.path.join(FIXTURES, name, "reference.npz")) as z:
        return {k: z[k] for k in z.files}


@pytest.fixture(scope="session")
def qwen3_engine():
    """The qwen3_moe fixture (a tokenizer and a chat template) in float32, shared so its compiled steps are too."""
    import moejax
    return moejax.load(fixture_dir("qwen3_moe"), dtype="float32")


def _gpu_plugin_installed() -> bool:
    """A JAX GPU plugin (the cuda extra) is importable: JAX may run the tests on a GPU."""
    import importlib.metadata
    import pkgutil
    try:
        import jax_plugins  # the namespace package JAX's PJRT plugins install into
        if any(True for _ in pkgutil.iter_modules(jax_plugins.__path__)):
            return True
    except ImportError:
        pass
    return bool(importlib.metadata.entry_points(group="jax_plugins"))


_run_cache: list[str] = []


def pytest_configure(config):
    """Once per run, before anything imports JAX, in the process that starts the others (pytest -n: the
    controller, whose environment every worker and every process a test starts inherits):
    - one persistent compilation cache for the whole run, inside it, not in the user's home: a program that one
      worker (or a CLI a test starts) compiled is read back by every other process, whatever its size (min
      compile time 0; moejax.load keeps a cache directory that is already set);
    - on CPU, JAX's jax_disable_most_optimizations (XLA's backend at optimization level 0): most of a test is
      XLA compiling tiny models, which takes about half the time, for the same float32 results within the
      tests' tolerances. Not where JAX may run on a GPU (the GPU check runs these tests there). Set
      JAX_DISABLE_MOST_OPTIMIZATIONS=0 to test the fully optimized programs.
    Every variable the caller set is left as it is."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return  # set by the controller already
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: hand out files in LONGEST_FIRST's order, not
        config.option.loadscopereorder = False  # by their number of tests
    if not (os.environ.get("XDG_CACHE_HOME") and os.environ.get("JAX_COMPILATION_CACHE_DIR")):
        _run_cache.append(tempfile.mkdtemp(prefix="moejax-tests-"))
        os.environ.setdefault("XDG_CACHE_HOME", _run_cache[0])
        os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(_run_cache[0], "jax-compile"))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    platforms = os.environ.get("JAX_PLATFORMS")
    if (platforms == "cpu") if platforms else not _gpu_plugin_installed():
        os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")


def pytest_unconfigure(config):
    for path in _run_cache:
        shutil.rmtree(path, ignore_errors=True)


# The files that take longest, longest first (CPU time of a whole run on 2 cores). pytest -n --dist loadfile
# hands out whole files in collection order, a new one to a worker as it runs out: the long ones start first
# and the short ones fill in at the end, so no worker is left with a long file when the others are done.
# Files not named here follow, in their usual order.
LONGEST_FIRST = ["test_sharding.py", "test_parity.py", "test_offload.py", "test_scoring.py", "test_serve.py",
                 "test_continuous.py", "test_request_edges.py", "test_lm_eval_model.py", "test_predictors.py",
                 "test_multihost.py", "test_comm_accounting.py", "test_attention_kernels.py", "test_engine.py",
                 "test_formats.py", "test_serve_offload.py", "test_train.py", "test_grouped_matmul.py",
                 "test_expert_ffn.py", "test_gpu_check.py", "test_openai_models.py", "test_logprob_tokens.py"]


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order


GPU_CHECK_DRY_RUN = "tests/launch/test_gpu_check.py::test_dry_run_runs_every_step_and_writes_every_output"
# the full-depth group's dry run (`--only full_depth`, a deep micro model): its own process, beside the other
FULL_DEPTH_DRY_RUN = "tests/launch/test_gpu_check_full_depth.py::test_full_depth_dry_run_runs_its_steps_in_order"
DRY_RUNS = {GPU_CHECK_DRY_RUN: (), FULL_DEPTH_DRY_RUN: ("--only", "full_depth")}
_dry_runs: dict = {}


def _one_core():
    """Pin the dry run (and the processes it starts) to one core: XLA sizes its thread pools by the cores a process
    may use, so it cannot crowd the test session off both."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) > 1:
        os.sched_setaffinity(0, {cores[-1]})


def _start_gpu_check_dry_run(extra: tuple = ()) -> dict:
    work = tempfile.mkdtemp(prefix="moejax-gpu-check-dry-run-")
    paths = {name: os.path.join(work, name) for name in ("out", "results", "stdout", "stderr")}
    env = dict(os.environ, JAX_PLATFORMS="cpu", XDG_CACHE_HOME=os.path.join(work, "cache"))
    with open(paths["stdout"], "w") as stdout, open(paths["stderr"], "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "launch.gpu_check", "--dry-run", "--out", paths["out"],
                                 "--results-dir", paths["results"], *extra], cwd=os.path.dirname(os.path.dirname(
                                     os.path.abspath(__file__))), stdout=stdout, stderr=stderr, env=env,
                                preexec_fn=_one_core)
    return dict(proc=proc, work=work, **paths)


def pytest_collection_finish(session):
    """A GPU check's dry run is a chain of processes (about 100 s, mostly one core; the full-depth group's a few
    minutes): start each as soon as the session knows its test will run, so that it runs beside the other tests on
    the second core."""
    if os.environ.get("PYTEST_XDIST_WORKER"):  # pytest -n: every worker collects every test; the one that runs it
        return  # starts the dry run then (waiting for it, that worker leaves the cores to the other workers)
    if session.config.option.collectonly:  # nothing runs
        return
    # session.items is what -m and -k left (the tests are marked slow: -m "not slow" deselects them, so none starts)
    chosen = {item.nodeid for item in session.items}
    for nodeid, extra in DRY_RUNS.items():
        if nodeid in chosen:
            _dry_runs[nodeid] = _start_gpu_check_dry_run(extra)


def pytest_sessionfinish(session):
    for run in _dry_runs.values():
        if run["proc"].poll() is None:  # its test never ran (interrupted, -x): do not leave it behind
            run["proc"].kill()


def _finished(nodeid: str):
    """The finished dry run of the test `nodeid`: returncode, stdout, stderr and its --out and --results-dir."""
    run = _dry_runs.get(nodeid) or _start_gpu_check_dry_run(DRY_RUNS[nodeid])
    run["proc"].wait(timeout=1500)
    yield dict(returncode=run["proc"].returncode, out=run["out"], results=run["results"],
               stdout=open(run["stdout"]).read(), stderr=open(run["stderr"]).read())
    shutil.rmtree(run["work"], ignore_errors=True)


@pytest.fixture(scope="session")
def gpu_check_dry_run():
    """The finished dry run: returncode, stdout, stderr and its --out and --results-dir folders."""
    yield from _finished(GPU_CHECK_DRY_RUN)


@pytest.fixture(scope="session")
def gpu_check_full_depth_dry_run():
    """The finished dry run of `--only full_depth`, as gpu_check_dry_run's."""
    yield from _finished(FULL_DEPTH_DRY_RUN)


def kill_when_journal_has(child, journal: str, lines: int, *, timeout: float, poll: float = 0.01) -> None:
    """SIGKILL `child` (a Popen) once `journal` holds at least `lines` lines; fails if it exits first."""
    import signal
    import time
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if os.path.exists(journal):
                with open(journal, encoding="utf-8") as f:
                    if f.read().count("\n") >= lines:
                        break
            assert child.poll() is None, "the process exited before it could be killed"
            time.sleep(poll)
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait()


def serve_stopped(capsys, argv) -> tuple[int, str]:
    """launch.serve's main(argv), which must stop before serving -> (exit status, its message: the line a refusal
    wrote on stderr, or the text it exited with)."""
    from launch import serve
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        serve.main(argv)
    code = exc.value.code
    return (1, code) if isinstance(code, str) else (code, capsys.readouterr().err.strip())
