"""`python -m launch.gpu_check --out DIR`: everything only a GPU can show, in one device call of under 9 minutes.

Run it from the repository root on the GPU machine (one H100 or H200, no network). It expects a python that
already has jax and jaxlib with a CUDA plugin and every dependency of moejax (flax, optax, orbax-checkpoint,
numpy, ml_dtypes, safetensors, tokenizers, jinja2, tqdm) plus pytest and hypothesis; torch with CUDA adds the
hardware ceilings measured with CUDA events. Steps, in order of what a short lease must not miss:

  install       pip install --no-deps --no-build-isolation --no-index -e . (nothing is fetched), then import
                every dependency and check that `moejax` is this checkout
  environment   device, driver, versions; each Pallas kernel lowered for CUDA with every warning JAX raises
                (launch/gpu_env.py)
  ceilings      bf16 matmul TFLOP/s, device stream GB/s, pinned host -> device GB/s (launch/gpu_ceilings.py)
  kernel_tests  the Pallas kernel tests compiled, not interpreted (tests/test_{grouped_matmul,expert_ffn,
                attention_kernels}.py), against their float64 oracles
  parity_tests  every model family against transformers' logits, float32 and bfloat16 (tests/test_parity.py)
  bench_*       `python -m launch.bench kernels | offload | serve` at sizes that fit the budget
  offload_tests experts streamed and cached from pinned host memory against the resident model
                (tests/test_host_store.py, tests/test_offload.py: two families)
  bench_*       `python -m launch.bench generate` (continuous vs static batching on the embedded model, step
                times), and `plans` (the GPU's measured hardware profile for the planners, and the
                planners' run times)

Every step runs in its own process under a time limit; a failing or slow step is recorded and the next one
runs. Writes into --out (at most 8 files, what the device tool brings back): gpu_check-<device>.json (the
record: environment, ceilings, each test's outcome, deprecation warnings, every step's status),
gpu_check-<device>.log (every step's output) and <bench>-<device>.json for each benchmark; the benchmark files
and a run appended to gpu_check-<device>.json also land in --results-dir (default bench/results). Prints a
summary table last. Exit status 0 only if every step passed.

`--dry-run` runs the same steps on CPU at tiny sizes, the Pallas kernels interpreted and a few tests per test
step (a check that the script itself works; CI runs it).
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

from launch.bench_util import device_tag
from launch.step_runner import Step, run_steps, table

PY = sys.executable
DEPENDENCIES = ("jax", "jaxlib", "flax", "optax", "orbax.checkpoint", "numpy", "ml_dtypes", "safetensors",
                "tokenizers", "jinja2", "tqdm", "pytest", "hypothesis")
TEST_STEPS = {  # name: (what, files, -k on the GPU, -k in the dry run, GPU timeout s)
    "kernel_tests": ("Pallas kernels compiled for the GPU against float64 oracles",
                     ["tests/test_grouped_matmul.py", "tests/test_expert_ffn.py", "tests/test_attention_kernels.py"],
                     "not interpret",
                     "test_explicit_edges and pallas_interpret or test_pallas_kernels_lower_for_gpu or cudnn", 150),
    "parity_tests": ("every model family against transformers, float32 and bfloat16", ["tests/test_parity.py"],
                     "not interpret", "qwen3_moe and not nonorm and (float32_logits or bfloat16_logits)", 120),
    "offload_tests": ("expert offloading from pinned host memory (real on a GPU) against the resident model",
                      ["tests/test_host_store.py", "tests/test_offload.py"],
                      "test_host_store or exact_placements and (gpt_oss or deepseek_v3) or bfloat16_placements",
                      "test_offloaded_store_lives_in_host_memory", 120),
}
# What a short lease must not miss comes first: the compiled kernels and parity, then the benchmarks.
ORDER = ["kernel_tests", "parity_tests", "bench_kernels", "bench_offload", "bench_serve", "offload_tests",
         "bench_generate", "bench_plans"]
BENCHES = {  # launch.bench command: (arguments on the GPU, arguments in the dry run, GPU timeout s)
    "kernels": (["--tokens", "1024,8192,32768", "--seqs", "4096,16384", "--repeats", "10"],
                ["--shapes", "tiny", "--tokens", "32", "--seqs", "128", "--decode-batch", "2", "--repeats", "1"], 150),
    "offload": (["--num-layers", "4", "--repeats", "3", "--new-tokens", "32"],
                ["--quick", "--num-layers", "2", "--tokens", "16", "--new-tokens", "2", "--prompt-len", "8"], 150),
    "serve": (["--model", "qwen3-30b-a3b", "--num-layers", "4", "--dtype", "bfloat16", "--requests", "64"],
              ["--requests", "4", "--prefix", "32", "--suffix", "8", "--candidates", "2", "--repeats", "1",
               "--max-batch-tokens", "256"], 90),
    "generate": (["--model", "pycode-moe", "--stop-ids", "588", "--requests", "64", "--no-transformers", "--no-mixed"],
                 ["--model", "tiny-qwen3-moe", "--requests", "3", "--max-prompt", "40", "--max-new", "12",
                  "--no-transformers", "--no-mixed"], 150),
    "plans": (["--model", "qwen3-30b-a3b", "--dtype", "bfloat16", "--solver-repeats", "5"],
              ["--quick", "--solver-repeats", "1", "--repeats", "1"], 120),
}


def _install_check() -> str:
    return (f"import importlib, os, moejax\n"
            f"for name in {DEPENDENCIES!r}:\n"
            f"    m = importlib.import_module(name)\n"
            f"    print(name, getattr(m, '__version__', ''))\n"
            f"here = os.path.realpath(os.getcwd())\n"
            f"assert os.path.realpath(moejax.__file__).startswith(here), (moejax.__file__, here)\n"
            f"print('moejax', moejax.__version__, 'from', os.path.dirname(moejax.__file__))\n")


def _read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _outcomes(path: str) -> dict:
    tests = []
    if os.path.exists(path):
        with open(path) as f:
            tests = [json.loads(line) for line in f if line.strip()]
    counts: dict = {}
    for t in tests:
        counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
    return dict(counts=counts, tests=tests)


class Check:
    """The steps of one run and the record they fill."""

    def __init__(self, args):
        self.args, self.dry = args, args.dry_run
        self.work = tempfile.mkdtemp(prefix="moejax-gpu-check-")
        self.log = os.path.join(self.work, "gpu_check.log")
        started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        self.record: dict = dict(mode="dry-run" if self.dry else "gpu", started=started, budget_s=args.budget_s,
                                 command=shlex.join([PY, "-m", "launch.gpu_check", *sys.argv[1:]]), git=_git(),
                                 environment=None, ceilings=None, tests={}, benchmarks={}, deprecations=[])
        self.tag = "unknown-device"

    def limit(self, gpu_seconds: float) -> float:
        """A step's time limit: the GPU's, doubled in the dry run (a CPU, maybe shared with a test session)."""
        return gpu_seconds * (2 if self.dry else 1)

    def first_steps(self) -> list[Step]:
        pip = [PY, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-e", "."]
        env_json, ceilings_json = os.path.join(self.work, "env.json"), os.path.join(self.work, "ceilings.json")
        return [
            Step("install", "pip install --no-deps (nothing fetched); every dependency imports",
                 [pip + (["--dry-run"] if self.dry else []), [PY, "-c", _install_check()]], self.limit(120)),
            Step("environment", "device, driver, versions; the Pallas kernels lowered for CUDA, warnings recorded",
                 [[PY, "-m", "launch.gpu_env", "--out", env_json]], self.limit(90),
                 read=lambda: self._read_env(env_json)),
            Step("ceilings", "bf16 matmul, device stream and pinned H2D ceilings",
                 [[PY, "-m", "launch.gpu_ceilings", "--out", ceilings_json] + (["--small"] if self.dry else [])],
                 self.limit(120), read=lambda: self._read_ceilings(ceilings_json)),
        ]

    def later_steps(self) -> list[Step]:
        steps = {}
        for name, (what, files, k_gpu, k_dry, timeout) in TEST_STEPS.items():
            out = os.path.join(self.work, f"{name}.jsonl")
            pytest = [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "launch.pytest_outcomes", *files,
                      "-k", k_dry if self.dry else k_gpu, "-W", "always::DeprecationWarning", "--outcomes", out]
            steps[name] = Step(name, what, [pytest], self.limit(timeout),
                               read=lambda name=name, out=out: self._read_tests(name, out))
        for cmd, (gpu_args, dry_args, timeout) in BENCHES.items():
            module = f"launch.bench_{cmd.replace('-', '_')}"
            absent = None if importlib.util.find_spec(module) else f"no {module} yet"
            path = os.path.join(self.args.results_dir, f"{cmd}-{self.tag}.json")
            steps[f"bench_{cmd}"] = Step(
                f"bench_{cmd}", f"python -m launch.bench {cmd}",
                [[PY, "-m", "launch.bench", cmd, *(dry_args if self.dry else gpu_args), "--out", path]],
                self.limit(timeout),
                read=lambda cmd=cmd, path=path: self._read_bench(cmd, path), absent=absent)
        return [steps[name] for name in ORDER]

    def _read_env(self, path: str) -> str:
        env = self.record["environment"] = _read_json(path)
        self.tag = device_tag(env["device"]["kind"])
        self.record["deprecations"] = [w for w in env["lowering"]["warnings"] if w["deprecation"]]
        v = env["versions"]
        return (f"{env['device']['kind']}, jax {v.get('jax')}, jaxlib {v.get('jaxlib')}, "
                f"{len(self.record['deprecations'])} deprecation warning(s) while lowering the kernels")

    def _read_ceilings(self, path: str) -> str:
        c = self.record["ceilings"] = _read_json(path)
        best = c["torch"] if isinstance(c["torch"], dict) else c["jax"]
        return ", ".join(f"{name} {r['value']:.3g} {r['unit']}" for name, r in best.items())

    def _read_tests(self, name: str, path: str) -> str:
        result = self.record["tests"][name] = _outcomes(path)
        failed = [t["test"] for t in result["tests"] if t["outcome"] in ("failed", "error")]
        counts = ", ".join(f"{n} {k}" for k, n in sorted(result["counts"].items())) or "no test reported"
        return counts + (f" (first failing: {failed[0]})" if failed else "")

    def _read_bench(self, cmd: str, path: str) -> str:
        if not os.path.exists(path):
            return "wrote no results"
        shutil.copy(path, os.path.join(self.args.out, os.path.basename(path)))
        self.record["benchmarks"][cmd] = os.path.basename(path)
        return f"results in {os.path.basename(path)}"

    def run(self) -> int:
        t0 = time.monotonic()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if self.dry:
            env.setdefault("JAX_PLATFORMS", "cpu")
        try:
            results = run_steps(self.first_steps(), self.log, self.args.budget_s, env)
            results += run_steps(self.later_steps(), self.log, self.args.budget_s - (time.monotonic() - t0), env)
            self.record.update(seconds=time.monotonic() - t0, steps=[r.__dict__ for r in results])
            return self._write(results)
        finally:
            shutil.rmtree(self.work, ignore_errors=True)

    def _write(self, results) -> int:
        out, name = self.args.out, f"gpu_check-{self.tag}"
        shutil.copy(self.log, os.path.join(out, f"{name}.log"))
        with open(os.path.join(out, f"{name}.json"), "w") as f:
            json.dump(self.record, f, indent=1)
        history = os.path.join(self.args.results_dir, f"{name}.json")
        runs = _read_json(history)["runs"] if os.path.exists(history) else []
        with open(history, "w") as f:
            json.dump({"runs": runs + [self.record]}, f, indent=1)
        print("\n" + table(results))
        for w in self.record["deprecations"]:
            print(f"deprecation while lowering the kernels: {w['category']}: {w['message']}")
        print(f"wrote {', '.join(sorted(os.listdir(out)))} in {out}; appended the run to {history}")
        return 0 if all(r.ok() for r in results) else 1


def _git() -> dict:
    try:
        run = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        return dict(commit=run.stdout.strip()) if run.returncode == 0 else {}
    except (OSError, subprocess.TimeoutExpired):
        return {}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.gpu_check", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[2:]))
    parser.add_argument("--out", required=True, help="directory for the files to bring back (made if missing)")
    parser.add_argument("--results-dir", default=os.path.join("bench", "results"),
                        help="where benchmark results and the run's record are kept (default bench/results)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="seconds for all steps (default 510, as the device tool allows 600 a call; dry run 1200)")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, interpreted kernels, few tests")
    args = parser.parse_args(argv)
    if not os.path.exists("pyproject.toml") or not os.path.isdir("moejax"):
        parser.error("run it from the repository root (no pyproject.toml and moejax/ here)")
    if args.budget_s is None:
        args.budget_s = 1200.0 if args.dry_run else 510.0
    if args.budget_s <= 0:
        parser.error(f"--budget-s must be positive, got {args.budget_s}")
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.results_dir, exist_ok=True)
    return Check(args).run()


if __name__ == "__main__":
    raise SystemExit(main())
