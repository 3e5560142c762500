"""`python -m launch.gpu_check --out DIR`: everything only a GPU can show, in one device call of under 9 minutes.

Run it from the repository root on the GPU machine (one H100 or H200, no network). It expects a python that
already has jax and jaxlib with a CUDA plugin and every dependency of moejax (flax, optax, orbax-checkpoint,
numpy, ml_dtypes, safetensors, tokenizers, jinja2, tqdm) plus pytest and hypothesis; torch with CUDA adds the
hardware ceilings measured with CUDA events. Steps, in order of what a short lease must not miss:

  install        pip install --no-deps --no-build-isolation --no-index -e . (nothing is fetched), then import
                 every dependency and check that `moejax` is this checkout
  environment    device, driver, versions; each Pallas kernel lowered for CUDA with every warning JAX raises
                 (launch/gpu_env.py)
  ceilings       bf16 matmul TFLOP/s, device stream GB/s, pinned host -> device GB/s (launch/gpu_ceilings.py)
  kernel_tests   what only a GPU runs: the compiled `pallas` and `cudnn` kernel tests (and the Mosaic GPU
                 kernel's file, when there is one) against their float64 oracles; the other backends are tested
                 on CPU in CI
  parity_tests   every model family against transformers' logits in bfloat16 (the kernels `auto` picks on a
                 GPU), float32 logits and greedy generation for two families (MLA; sinks and windows)
  bench_generate `python -m launch.bench generate` (continuous vs static batching on the embedded model, step
                 times and their overhead share)
  offload_tests  experts streamed and cached from pinned host memory against the resident model
  tune_gmm       the grouped GEMM tuning sweep (`python -m launch.tune_gmm`), where that module exists
  bench_kernels  `python -m launch.bench kernels` (every compiled grouped GEMM and FFN backend, one that would not
                 fit skipped), then bench_offload and bench_serve: `launch.bench offload | serve` at GPU sizes
  bench_plans    `python -m launch.bench plans` (the GPU's measured profile, the planners' run times)
  offload_decode only when --only names it (a set of its own, under 5 minutes): `launch.bench offload --sections
                 decode --placements ...`, every decode placement side by side at one device budget

Every step runs in its own process under a time limit (LIMITS: from the first H200 run's measured times) and
the whole run under --budget-s; a failing or slow step is recorded and the next one runs. Every step's process
shares one persistent JAX compilation cache (JAX_COMPILATION_CACHE_DIR, every program cached: a second call on
the same machine with --cache-dir reads what the first compiled). --only STEP,... runs chosen steps (install and
environment first: they name the device every file is named after); the summary ends with the command that runs
the steps that did not finish (failed, timed out or not started).

Writes into --out (at most 8 files, what the device tool brings back) as it goes, so that a call stopped at any
point keeps what ran: gpu_check.log (every step's output; gpu_check-<device>.log at the end),
gpu_check-<device>.json (the record: environment, ceilings, each test's outcome, deprecation warnings, every
step's status; rewritten after each step, `"partial": true` until the end), and <bench>-<device>.json for each
benchmark, which the benchmarks rewrite after each measured row (a stopped one keeps its rows, marked partial).
Each benchmark's run, and the check's record, are also appended to --results-dir (default bench/results). Prints
a summary table last. Exit status 0 only if every step passed.

`--only full_depth` runs a group of steps of its own instead, in under 6 minutes: the whole qwen3-30b-a3b (48 layers,
bf16) with correctness first, then the dispatch probe, full-depth decode and prefill, then the kernel rows (GROUPS).

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
import sys
import tempfile
import time

from launch.bench.provenance import COMMIT_VARIABLE, device_tag, git_commit
from launch.bench.results import read_runs, write_json, write_runs
from launch.bench.step_runner import UNFINISHED, Step, StepResult, run_steps, table

PY = sys.executable
DEPENDENCIES = ("jax", "jaxlib", "flax", "optax", "orbax.checkpoint", "numpy", "ml_dtypes", "safetensors",
                "tokenizers", "jinja2", "tqdm", "pytest", "hypothesis")
# What a short lease must not miss comes first: correctness (kernels, parity, the engine's generation and offload
# paths, where the third check found two defects after the benchmarks had spent its budget), then speed.
ORDER = ["install", "environment", "ceilings", "kernel_tests", "parity_tests", "bench_generate", "offload_tests",
         "tune_gmm", "bench_kernels", "bench_offload", "bench_serve", "bench_plans"]
NEEDED_FIRST = ("install", "environment")  # before any step: the device's name is in every file's
# Time limits on the GPU, seconds (doubled in the dry run). The first H200 run (2026-11-26, jax 0.11.2) measured:
# install 6 s, environment 7 s, ceilings 20 s; 36 kernel tests in 150 s, of which the compiled pallas ones took
# 34 s (the rest tested backends CI tests on CPU); 27 parity tests in 120 s (bf16 0.8-1.8 s each, float32 logits
# 1.2-3.8 s, float32 greedy generation 8-12 s); bench kernels 57 s up to its crash at T=32768; bench offload's
# Θ profile 23 s and 4 prefill sizes in 152 s (its decode section never started); bench generate (64 requests
# on pycode-moe) past 150 s. Steps that were cut get smaller workloads below; tune_gmm stops starting candidates at its
# --budget-s (TUNE_GMM).
LIMITS = dict(install=60, environment=60, ceilings=60, kernel_tests=120, tune_gmm=120, bench_kernels=120,
              bench_offload=130, bench_serve=120, parity_tests=90, bench_generate=120, offload_tests=90,
              bench_plans=90, offload_decode=270)
# The sweep on the GPU: the two classes the targets name (8K and 32K tokens), the first three candidates of each
# list (the first H200 sweep's best, the warp-specialized Mosaic body, the runners-up), about 80 s; the full sweep
# (`python -m launch.tune_gmm`, 160 s) is a call of its own (bench/README.md).
TUNE_GMM = (["--tokens", "8192,32768", "--configs", "3", "--no-anchor", "--budget-s", "75"], ["--dry-run"])
# moejax.kernels.grouped_matmul.ragged_cudnn.ON, spelled out here: this script starts where jax does not import
RAGGED_DOT_FUSION = "--xla_gpu_experimental_use_ragged_dot_fusion=true"
MOSAIC_TESTS = "tests/kernels/test_grouped_matmul_mosaic.py"  # the Mosaic GPU kernel's compiled tests
TEST_STEPS = {  # name: (what, files, -k on the GPU, -k in the dry run)
    "kernel_tests": ("compiled Pallas, cuDNN and Mosaic GPU kernels against float64 oracles",
                     # the Mosaic file first: its kernels ran on a GPU the least (the 2026-11-26 check was
                     # stopped before them)
                     [MOSAIC_TESTS, "tests/kernels/test_grouped_matmul.py", "tests/kernels/test_expert_ffn.py",
                      "tests/kernels/test_grouped_matmul_masked.py",
                      "tests/kernels/test_attention_kernels.py", "tests/kernels/test_paged_attention.py"],
                     # not: interpreted; lowering (CI lowers for CUDA on CPU); a CPU-only check that names cudnn;
                     # of the Mosaic file only the compiled tests (its layout and table tests are CI's)
                     "test_compiled or (pallas or cudnn) and not (interpret or lower or block_sizes or cpu_picks)",
                     "test_explicit_edges and pallas_interpret or test_pallas_kernels_lower_for_gpu or cudnn"),
    "parity_tests": ("every family against transformers in bfloat16; float32 for two", ["tests/models/test_parity.py"],
                     "bfloat16_logits or float32 and (deepseek_v3 or gpt_oss) and not nonorm",
                     "qwen3_moe and not nonorm and (float32_logits or bfloat16_logits)"),
    "offload_tests": ("expert offloading from pinned host memory (real on a GPU) against the resident model",
                      ["tests/offload/test_host_store.py", "tests/offload/test_offload.py"],
                      "test_host_store or exact_placements and (gpt_oss or deepseek_v3) or bfloat16_placements",
                      "test_offloaded_store_lives_in_host_memory"),
}
BENCHES = {  # launch.bench command: (arguments on the GPU, arguments in the dry run)
    "kernels": (["--shapes", "qwen3-30b-a3b", "--tokens", "1024,8192,32768", "--seqs", "4096,16384",
                 "--repeats", "10"],
                # 100 KiB free: ragged_dot and the all-experts baselines need more and are skipped, as on a GPU
                ["--shapes", "tiny", "--tokens", "32", "--seqs", "128", "--decode-batch", "2", "--repeats", "1",
                 "--free-gib", str(100 / 2**20)]),
    "offload": (["--num-layers", "4", "--tokens", "65536,131072", "--repeats", "2", "--new-tokens", "16"],
                ["--quick", "--num-layers", "2", "--tokens", "16", "--new-tokens", "2", "--prompt-len", "8"]),
    "serve": (["--model", "qwen3-30b-a3b", "--num-layers", "4", "--dtype", "bfloat16"],  # its GPU workload
              ["--requests", "4", "--prefix", "32", "--suffix", "8", "--candidates", "2", "--repeats", "1",
               "--max-batch-tokens", "256"]),
    "generate": (["--model", "pycode-moe", "--stop-ids", "588", "--requests", "32", "--max-new", "256",
                  "--no-transformers", "--no-mixed"],
                 ["--model", "tiny-qwen3-moe", "--requests", "3", "--max-prompt", "40", "--max-new", "12",
                  "--no-transformers", "--no-mixed"]),
    "plans": (["--model", "qwen3-30b-a3b", "--dtype", "bfloat16", "--solver-repeats", "5"],
              ["--quick", "--solver-repeats", "1", "--repeats", "1"]),
}


# `--only full_depth`: a call of its own for the whole real-shaped model (qwen3-30b-a3b, all 48 layers, bf16, its
# weights drawn on the device): correctness first, then the dispatch probe, full-depth decode and prefill, then the
# kernel rows; under 6 minutes on an H200 with compiles (FULL_DEPTH_BUDGET_S; limits below), so that it and another
# call of under 5 minutes fit one lease with the machine's start. The dry run runs the same steps on a deep micro
# model (DEEP_TINY) with the kernels interpreted.
GROUPS = {"full_depth": ["install", "environment", "ceilings", "depth_tests", "dispatch_probe", "bench_decode_full",
                         "bench_prefill_full", "bench_kernels"],
          "offload_decode": ["install", "environment", "offload_decode"]}
FULL_DEPTH_BUDGET_S = 345.0
OFFLOAD_DECODE_BUDGET_S = 290.0
GROUP_BUDGETS = {"full_depth": FULL_DEPTH_BUDGET_S, "offload_decode": OFFLOAD_DECODE_BUDGET_S}
FULL = ["--model", "qwen3-30b-a3b", "--dtype", "bfloat16"]
DEEP_TINY = ["--model", "micro-qwen3-moe-deep", "--dtype", "float32"]
FULL_DEPTH_BENCHES = {  # the group's kernel rows: the two token counts the expert FFN's targets name
    "kernels": (["--shapes", "qwen3-30b-a3b", "--tokens", "8192,32768", "--seqs", "4096", "--repeats", "5"],
                BENCHES["kernels"][1]),
}
# Sized, with no GPU at hand, from the fifth check's 4-layer slice (the batch runner at 637K tok/s: about 53K at 48
# layers) and the HBM bound of a decode iteration (61 GB of weights plus the KV): batch 1024's three runs about 80 s,
# the smaller batches about 50 s together, the prefill's two passes over 1M tokens about 45 s, compiles apart. The
# kernel rows come last and get what is left of FULL_DEPTH_BUDGET_S (none if the others take their limits).
GROUP_LIMITS = dict(depth_tests=45, dispatch_probe=60, bench_decode_full=150, bench_prefill_full=60)
GROUP_TESTS = {  # name: (what, files, -k on the GPU, -k in the dry run)
    "depth_tests": ("the model against transformers (bf16), deep fixtures where there are; decode steps read one "
                    "behind their dispatch", ["tests/models/test_parity.py", "tests/sched/test_continuous.py"],
                    "qwen3_moe and bfloat16_logits or deep and bfloat16 or read_after_the_next",
                    "qwen3_moe and bfloat16_logits and not nonorm"),
}
GROUP_RUNS = {  # name: (file stem, what, module, arguments on the GPU, in the dry run); the check adds the ceilings
    "dispatch_probe": ("dispatch_probe", "decode dispatch under command buffers at batch 64 (launch.dispatch_probe)",
                       "launch.dispatch_probe",
                       FULL + ["--batch", "64", "--prompt-len", "64", "--max-new", "32", "--command-buffers"],
                       DEEP_TINY + ["--batch", "2", "--prompt-len", "16", "--max-new", "8", "--command-buffers"]),
    "bench_decode_full": ("generate-decode", "full-depth decode: continuous batching at batch 1, 64, 256, 1024 "
                          "(prompt 512, output 128): tok/s, TPOT, MBU", "launch.bench.decode",
                          ["generate"] + FULL + ["--decode-batches", "1,64,256,1024", "--mem-fraction", "0.95",
                                                 "--command-buffers"],
                          ["generate"] + DEEP_TINY + ["--decode-batches", "1,4", "--prompt-len", "24", "--output-len",
                                                      "17", "--decode-steps", "4", "--chunk-tokens", "64",
                                                      "--row-tokens", "32", "--command-buffers"]),
    "bench_prefill_full": ("serve-full", "full-depth prefill: the batch runner on 2,048 x 512-token scoring rows, "
                           "MFU", "launch.bench.serve",
                           ["serve"] + FULL + ["--workloads", "distinct", "--kv-modes", "off", "--requests", "2048",
                                               "--prefix", "480", "--suffix", "32", "--repeats", "1", "--no-resident"],
                           ["serve"] + DEEP_TINY + ["--workloads", "distinct", "--kv-modes", "off", "--requests", "8",
                                                    "--prefix", "24", "--suffix", "8", "--repeats", "1",
                                                    "--no-resident"]),
}
# The decode placements side by side at one budget (launch/bench/decode_placements.py), a set of its own under 5
# minutes with install and environment: qwen3-30b-a3b's first 8 layers, random weights, 40% of their bytes as the
# device budget; batch 1 and 64 at a 512-token prompt, then one 4K-token prompt; 32 output tokens (64 outgrow the
# limit: a streamed step copies every expert, ~0.2 s on an H200's link). The predictors' calibration is read from
# OFFLOAD_DECODE_CALIBRATION when it exists (made on CPU beforehand: bench/README.md), else made on the GPU.
OFFLOAD_DECODE_PLACEMENTS = "resident,streamed,cached-lru,cached-oracle,lightning,cached-router,cached-expert_map"
OFFLOAD_DECODE_CALIBRATION = os.path.join("bench", "calibration", "qwen3-30b-a3b-l8")
OFFLOAD_DECODE = (["--sections", "decode", "--placements", OFFLOAD_DECODE_PLACEMENTS, "--num-layers", "8",
                   "--batches", "1,64", "--long-prompt", "4096", "--new-tokens", "32", "--h2d-mib", "256"],
                  ["--sections", "decode", "--placements", OFFLOAD_DECODE_PLACEMENTS, "--quick", "--batches", "4",
                   "--long-prompt", "0", "--new-tokens", "2", "--budget-fraction", "0.8", "--device-rows", "1",
                   "--calibration-prompts", "2", "--calibration-tokens", "16"])


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


def _kept(record: dict, name: str) -> str:
    """What a (possibly stopped) benchmark left: its rows so far when it is marked partial."""
    if not record.get("partial"):
        return f"results in {name}"
    progress = record.get("progress") or {}
    how_far = f"{progress['rows']} rows, the last {progress['last']}" if "rows" in progress else "unfinished"
    return f"partial results ({how_far}) in {name}"


class Check:
    """The steps of one run and the record they fill."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.dry = args, args.dry_run
        self.work = tempfile.mkdtemp(prefix="moejax-gpu-check-")
        self.log = os.path.join(args.out, "gpu_check.log")
        open(self.log, "w").close()
        # a cache the caller names (--cache-dir, or JAX's own variable) outlives the run; else it is the run's own
        self.cache = args.cache_dir or os.environ.get("JAX_COMPILATION_CACHE_DIR") or os.path.join(self.work, "jax")
        started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        self.record: dict = dict(mode="dry-run" if self.dry else "gpu", started=started, budget_s=args.budget_s,
                                 command=shlex.join([PY, "-m", "launch.gpu_check", *sys.argv[1:]]), git=_git(),
                                 only=args.only, compilation_cache=self.cache, environment=None, ceilings=None,
                                 tests={}, benchmarks={}, deprecations=[])
        self.tag = "unknown-device"

    def limit(self, name: str) -> float:
        """A step's time limit: --limit's, else the GPU's, doubled in the dry run (a CPU, maybe shared)."""
        if name in self.args.limits:
            return self.args.limits[name]
        return (LIMITS.get(name) or GROUP_LIMITS[name]) * (2 if self.dry else 1)

    def step(self, name: str) -> Step:
        """The step `name`, built when its turn comes: the steps after environment know the device."""
        if name in TEST_STEPS or name in GROUP_TESTS:
            return self._test_step(name, *(TEST_STEPS.get(name) or GROUP_TESTS[name]))
        if name in GROUP_RUNS:
            return self._group_run_step(name, *GROUP_RUNS[name])
        if name == "offload_decode":
            gpu, dry = OFFLOAD_DECODE
            calibration = ["--calibration", OFFLOAD_DECODE_CALIBRATION] if os.path.isdir(
                OFFLOAD_DECODE_CALIBRATION) and not self.dry else []
            return self._results_step(name, name, "decode placements side by side at one device budget",
                                      "launch.bench.decode_placements",
                                      [PY, "-m", "launch.bench", "offload", *(dry if self.dry else gpu + calibration)])
        if name.startswith("bench_"):
            return self._bench_step(name.removeprefix("bench_"), *BENCHES[name.removeprefix("bench_")])
        return getattr(self, f"_{name}_step")()

    def _install_step(self) -> Step:
        pip = [PY, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-e", "."]
        return Step("install", "pip install --no-deps (nothing fetched); every dependency imports",
                    [pip + (["--dry-run"] if self.dry else []), [PY, "-c", _install_check()]], self.limit("install"))

    def _environment_step(self) -> Step:
        path = os.path.join(self.work, "env.json")
        return Step("environment", "device, driver, versions; the Pallas kernels lowered for CUDA, warnings recorded",
                    [[PY, "-m", "launch.gpu_env", "--out", path]], self.limit("environment"),
                    read=lambda: self._read_env(path))

    def _ceilings_step(self) -> Step:
        path = os.path.join(self.work, "ceilings.json")
        return Step("ceilings", "bf16 matmul, device stream and pinned H2D ceilings",
                    [[PY, "-m", "launch.gpu_ceilings", "--out", path] + (["--small"] if self.dry else [])],
                    self.limit("ceilings"), read=lambda: self._read_ceilings(path))

    def _group_run_step(self, name: str, stem: str, what: str, module: str, gpu_args: list[str],
                        dry_args: list[str]) -> Step:
        """A full-depth step: the ceilings step's measurements (when it ran) are the utilisation figures' ceilings."""
        argv = [PY, "-m", "launch.bench" if module.startswith("launch.bench") else module,
                *(dry_args if self.dry else gpu_args)]
        best = self._ceiling_values()
        if name == "bench_decode_full" and "device_stream" in best:
            argv += ["--copy-gbps", f"{best['device_stream']:.6g}"]
        if name == "bench_prefill_full":
            argv += ["--peak-tflops", f"{best['matmul_bf16']:.6g}"] if "matmul_bf16" in best else ["--measure-peak"]
        return self._results_step(name, stem, what, module, argv)

    def _ceiling_values(self) -> dict[str, float]:
        """The ceilings step's values through JAX (what moejax's programs can reach), by name; {} before it ran."""
        c = self.record.get("ceilings") or {}
        return {name: r["value"] for name, r in (c.get("jax") or {}).items()}

    def _tune_gmm_step(self) -> Step:
        return self._results_step("tune_gmm", "tune_gmm", "grouped GEMM tuning sweep: the best tiles per shape class",
                                  "launch.tune_gmm", [PY, "-m", "launch.tune_gmm", *TUNE_GMM[1 if self.dry else 0]])

    def _test_step(self, name: str, what: str, files: list[str], k_gpu: str, k_dry: str) -> Step:
        out = os.path.join(self.work, f"{name}.jsonl")
        pytest = [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "launch.bench.pytest_outcomes",
                  *[f for f in files if os.path.exists(f)], "-k", k_dry if self.dry else k_gpu,
                  "-W", "always::DeprecationWarning", "--outcomes", out]
        return Step(name, what, [pytest], self.limit(name), read=lambda: self._read_tests(name, out))

    def _bench_step(self, cmd: str, gpu_args: list[str], dry_args: list[str]) -> Step:
        if getattr(self.args, "group", None) == "full_depth" and cmd in FULL_DEPTH_BENCHES:
            gpu_args, dry_args = FULL_DEPTH_BENCHES[cmd]
        return self._results_step(f"bench_{cmd}", cmd, f"python -m launch.bench {cmd}", f"launch.bench.{cmd}",
                                  [PY, "-m", "launch.bench", cmd, *(dry_args if self.dry else gpu_args)])

    def _results_step(self, name: str, cmd: str, what: str, module: str, argv: list[str]) -> Step:
        """A step whose command writes a results file into --out (there as it grows: a stopped call keeps it); its
        new runs are read back and appended to --results-dir. Absent where `module` is not there yet."""
        path = os.path.join(self.args.out, f"{cmd}-{self.tag}.json")
        before = len(read_runs(path))
        return Step(name, what, [argv + ["--out", path]], self.limit(name),
                    read=lambda: self._read_bench(cmd, path, before),
                    absent=None if importlib.util.find_spec(module) else f"no {module} yet")

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

    def _read_bench(self, cmd: str, path: str, before: int) -> str:
        """This run's record of the benchmark (partial where it was stopped), appended to --results-dir too."""
        runs = read_runs(path)
        if len(runs) <= before:
            return "wrote no results"
        name = os.path.basename(path)
        history = os.path.join(self.args.results_dir, name)
        write_runs(history, read_runs(history) + runs[before:])
        self.record["benchmarks"][cmd] = name
        return _kept(runs[-1], name)

    def run(self) -> int:
        t0 = time.monotonic()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.setdefault("JAX_COMPILATION_CACHE_DIR", self.cache)
        env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")  # every program: a rerun compiles less
        # XLA's cuDNN ragged-dot fusion, read once at start-up, for every step: the ragged_dot_cudnn backend's tests
        # and benchmark rows need it, and it changes no program but ragged_dot's (which auto never picks)
        flags = env.get("XLA_FLAGS", "")
        if RAGGED_DOT_FUSION.split("=")[0] not in flags:
            env["XLA_FLAGS"] = f"{flags} {RAGGED_DOT_FUSION}".strip()
        if self.dry:
            env.setdefault("JAX_PLATFORMS", "cpu")
        chosen = _order(self.args.only)
        if self.args.only is not None:
            print(f"only {', '.join(self.args.only)}; install and environment run first: every file carries the "
                  "device's name, which environment reads", flush=True)
        try:
            results = run_steps((self.step(n) for n in chosen), self.log, self.args.budget_s, env,
                                after=lambda done: self._write_record(done, time.monotonic() - t0, partial=True))
            return self._finish(results, time.monotonic() - t0)
        finally:
            shutil.rmtree(self.work, ignore_errors=True)

    def _write_record(self, results: list[StepResult], seconds: float, partial: bool) -> str:
        """The record as it stands, in --out (a call stopped between steps keeps it)."""
        record = dict(self.record, seconds=seconds, steps=[r.__dict__ for r in results],
                      **({"partial": True} if partial else {}))
        path = os.path.join(self.args.out, f"gpu_check-{self.tag}.json")
        write_json(path, record)
        if self.tag != "unknown-device":  # a record written before the device was known is superseded
            stale = os.path.join(self.args.out, "gpu_check-unknown-device.json")
            if os.path.exists(stale):
                os.remove(stale)
        return path

    def _finish(self, results: list[StepResult], seconds: float) -> int:
        out, name = self.args.out, f"gpu_check-{self.tag}"
        self.record.update(seconds=seconds, steps=[r.__dict__ for r in results])
        self._write_record(results, seconds, partial=False)
        os.replace(self.log, os.path.join(out, f"{name}.log"))
        history = os.path.join(self.args.results_dir, f"{name}.json")
        write_runs(history, read_runs(history) + [self.record])
        print("\n" + table(results))
        for w in self.record["deprecations"]:
            print(f"deprecation while lowering the kernels: {w['category']}: {w['message']}")
        print(f"wrote {', '.join(sorted(os.listdir(out)))} in {out}; appended the run to {history}")
        again = [r.name for r in results if r.status in UNFINISHED and r.name not in NEEDED_FIRST]
        print(f"not finished: {', '.join(again)}; to run them: {self.rerun_command(again)}" if again
              else "every step finished")
        return 0 if all(r.ok() for r in results) else 1

    def rerun_command(self, names: list[str]) -> str:
        """This call's command with --only the given steps."""
        a = self.args
        argv = [PY, "-m", "launch.gpu_check", "--out", a.out, "--results-dir", a.results_dir, "--budget-s",
                f"{a.budget_s:g}"] + (["--dry-run"] if a.dry_run else []) + (
            ["--cache-dir", a.cache_dir] if a.cache_dir else []) + (
            ["--limit", ",".join(f"{k}={v:g}" for k, v in a.limits.items())] if a.limits else [])
        return shlex.join(argv + ["--only", ",".join(names)])


def _git() -> dict:
    commit, named = git_commit()
    if not commit:
        return {}
    return dict(commit=commit, named_by=COMMIT_VARIABLE) if named else dict(commit=commit)


def _steps(text: str, parser: argparse.ArgumentParser) -> tuple[list[str], str | None]:
    """--only's steps, and the group it names (a group goes alone)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if any(n in GROUPS for n in names):
        if len(names) > 1:
            parser.error(f"--only: a group ({', '.join(n for n in names if n in GROUPS)}) goes alone; got {text!r}")
        return GROUPS[names[0]], names[0]
    unknown = [n for n in names if n not in ORDER and not any(n in steps for steps in GROUPS.values())]
    if unknown or not names:
        parser.error(f"--only: unknown step(s) {', '.join(unknown) or '(none given)'}; steps: {', '.join(ORDER)}; "
                     f"groups: {', '.join(GROUPS)}")
    return names, None


def _order(only: list[str] | None) -> list[str]:
    """The steps to run, in order: install and environment first, then the chosen ones in their group's order
    (steps of a group's own, or a group's steps left by a stopped call) or the check's (ORDER)."""
    if only is None:
        return ORDER
    order = next((steps for steps in GROUPS.values() if set(only) <= set(steps) and not set(only) <= set(ORDER)),
                 ORDER)
    return [n for n in order if n in only or n in NEEDED_FIRST]


def _limits(text: str | None, parser: argparse.ArgumentParser) -> dict[str, float]:
    limits = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        name, _, value = part.partition("=")
        try:
            limits[name.strip()] = float(value)
        except ValueError:
            parser.error(f"--limit: {part!r} is not STEP=SECONDS")
        known = ORDER + [n for steps in GROUPS.values() for n in steps if n not in ORDER]
        if name.strip() not in known or limits[name.strip()] <= 0:
            parser.error(f"--limit: {part!r}: the step must be one of {', '.join(known)}, the seconds positive")
    return limits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.gpu_check", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[2:]))
    parser.add_argument("--out", required=True, help="directory for the files to bring back (made if missing)")
    parser.add_argument("--results-dir", default=os.path.join("bench", "results"),
                        help="where benchmark results and the run's record are kept (default bench/results)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="seconds for all steps (default 520, as the device tool allows 600 a call; dry run 1200)")
    parser.add_argument("--only", default=None, metavar="STEP,...",
                        help=f"run these steps (and install, environment first); steps: {', '.join(ORDER)}; or one "
                             "group of steps of its own: "
                             + ", ".join(f"{g} (--budget-s {b:g})" for g, b in GROUP_BUDGETS.items()))
    parser.add_argument("--limit", default=None, metavar="STEP=SECONDS,...",
                        help="a step's time limit instead of its default (dry run: used as given, not doubled)")
    parser.add_argument("--cache-dir", default=None,
                        help="the steps' persistent compilation cache (default: the run's own, removed at its end); "
                             "name one to keep it for a second call on the same machine")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, interpreted kernels, few tests")
    args = parser.parse_args(argv)
    if not os.path.exists("pyproject.toml") or not os.path.isdir("moejax"):
        parser.error("run it from the repository root (no pyproject.toml and moejax/ here)")
    args.only, args.group = (None, None) if args.only is None else _steps(args.only, parser)
    if args.budget_s is None:
        args.budget_s = 1200.0 if args.dry_run else GROUP_BUDGETS.get(args.group or "", 520.0)
    if args.budget_s <= 0:
        parser.error(f"--budget-s must be positive, got {args.budget_s}")
    args.limits = _limits(args.limit, parser)
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.results_dir, exist_ok=True)
    return Check(args).run()


if __name__ == "__main__":
    raise SystemExit(main())
