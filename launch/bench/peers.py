"""`python -m launch.bench peers`: moejax against the engines its users would pick instead, on the same machine,
the same random checkpoint and the same requests. Each engine runs in a process of its own
(launch/bench/peers_worker.py), warmed up on every workload, then timed interleaved (repetition by repetition,
workload by workload, engine by engine) so that drifts of the machine hit every engine alike; the minimum of
the repetitions is the figure.

Workloads (scoring reads the log-probability of 4 single-token candidates after the prompt):
  A  64 requests: a 480-token prefix shared by all + 32 unique tokens
  B  64 requests x 512 tokens, nothing shared
  C  32 prompts x 128 tokens, 64 greedy new tokens

The checkpoint is a random Qwen3-MoE (hidden 512, 8 layers, 32 experts top-4, vocab 4096) built with
transformers and saved to a temporary directory, so torch and transformers must import here. vLLM joins when
`--vllm-python` names a Python whose environment has vLLM's CPU build; how to set one up is in bench/README.md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers_worker.py")
BENCH_CONFIG = dict(model_type="qwen3_moe", vocab_size=4096, hidden_size=512, intermediate_size=1024,
                    moe_intermediate_size=256, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                    head_dim=64, num_experts=32, num_experts_per_tok=4, norm_topk_prob=True, decoder_sparse_step=1,
                    mlp_only_layers=[], rope_theta=10000.0, max_position_embeddings=2048, rms_norm_eps=1e-6,
                    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def workloads(n_score: int, n_gen: int, vocab: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    ids = lambda n: rng.integers(3, vocab, n).tolist()  # noqa: E731  (0-2: pad, bos, eos)
    cands = lambda: rng.choice(np.arange(3, vocab), 4, replace=False).tolist()  # noqa: E731
    shared = ids(480)
    return {
        "A": {"kind": "score", "requests": [{"prompt": shared + ids(32), "candidates": cands()}
                                            for _ in range(n_score)]},
        "B": {"kind": "score", "requests": [{"prompt": ids(512), "candidates": cands()} for _ in range(n_score)]},
        "C": {"kind": "generate", "prompts": [ids(128) for _ in range(n_gen)], "max_new": 64},
    }


def make_checkpoint(directory: str, seed: int) -> None:
    import torch  # optional: transformers' reference only
    import transformers  # optional: transformers' reference only
    fields = {k: v for k, v in BENCH_CONFIG.items() if k != "model_type"}
    config = transformers.AutoConfig.for_model(BENCH_CONFIG["model_type"], **fields)
    config.initializer_range = 0.02
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)


def vllm_environment(python: str) -> dict:
    """What vLLM's CPU build needs to compute on every core: tcmalloc and its own OpenMP runtime preloaded, a KV
    cache size, its OpenMP threads bound to all cores and none reserved, the engine in this process."""
    env = dict(os.environ)
    prefix = subprocess.run([python, "-c", "import sys; print(sys.prefix)"], capture_output=True, text=True,
                            check=True).stdout.strip()
    preload = [p for p in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                           os.path.join(prefix, "lib", "libiomp5.so")) if os.path.exists(p)]
    env.update(LD_PRELOAD=":".join(preload), VLLM_CPU_KVCACHE_SPACE="4",
               VLLM_CPU_OMP_THREADS_BIND=f"0-{(os.cpu_count() or 1) - 1}", VLLM_CPU_NUM_OF_RESERVED_CPU="0",
               VLLM_ENABLE_V1_MULTIPROCESSING="0")
    return env


class Worker:
    def __init__(self, name: str, python: str, model: str, workloads_file: str, dtype: str,
                 env: dict[str, str] | None = None) -> None:
        self.name = name
        t0 = time.perf_counter()
        self.proc = subprocess.Popen([python, WORKER, "--engine", name, "--model", model, "--workloads",
                                      workloads_file, "--dtype", dtype], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        assert self.proc.stdin is not None and self.proc.stdout is not None  # both piped
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        self._read()
        self.startup_s = time.perf_counter() - t0

    def _read(self) -> dict:
        for line in self.stdout:  # engines may print their own lines; ours are JSON objects
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError(f"{self.name} worker exited with {self.proc.wait()}")

    def run(self, workload: str) -> dict:
        self.stdin.write(json.dumps({"workload": workload}) + "\n")
        self.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.stdin.close()
        self.proc.wait(timeout=60)


def reference_engine(engines: list[str]) -> str:
    """What a workload's answers are compared with: transformers where it ran the workload, else the first engine
    that did (moejax-serve runs no generation workload)."""
    return "transformers" if "transformers" in engines else engines[0]


def agreement(results: dict, kind: str, reference: str) -> dict:
    """Per engine: the largest |logprob difference| from the reference engine (scoring), or the share of new
    tokens equal to its tokens (generation)."""
    ref = results[reference]
    out = {}
    for name, got in results.items():
        if kind == "score":
            out[name] = float(np.max(np.abs(np.asarray(got) - np.asarray(ref))))
        else:
            out[name] = float(np.mean([a == b for x, y in zip(got, ref, strict=True)
                                        for a, b in zip(x, y, strict=True)]))
    return out


def peers(args: argparse.Namespace, environment: dict) -> dict:
    engines = [e for e in args.engines.split(",") if e != "vllm" or args.vllm_python]
    names = args.workloads.split(",")
    with tempfile.TemporaryDirectory() as d:
        model = args.model or os.path.join(d, "model")
        if not args.model:
            make_checkpoint(model, args.seed)
        with open(os.path.join(model, "config.json")) as f:
            vocab = json.load(f)["vocab_size"]
        work_file = os.path.join(d, "workloads.json")
        with open(work_file, "w") as f:
            json.dump(workloads(args.requests, args.prompts, vocab, args.seed), f)
        workers = {}
        for e in engines:
            if e == "vllm":
                workers[e] = Worker(e, args.vllm_python, model, work_file, args.dtype,
                                    vllm_environment(args.vllm_python))
            else:
                workers[e] = Worker(e, sys.executable, model, work_file, args.dtype)
            print(f"  {e}: ready in {workers[e].startup_s:.1f}s", flush=True)
        try:
            kinds = {"A": "score", "B": "score", "C": "generate"}
            runnable = {w: [e for e in engines if not (kinds[w] == "generate" and e == "moejax-serve")] for w in names}
            first: dict[tuple[str, str], float] = {}
            outputs: dict[str, dict[str, list]] = {w: {} for w in names}
            for w in names:  # warm-up: compiles, caches, first-touch
                for e in runnable[w]:
                    r = workers[e].run(w)
                    first[w, e], outputs[w][e] = r["seconds"], r["result"]
            seconds: dict[tuple[str, str], list[float]] = {(w, e): [] for w in names for e in runnable[w]}
            for rep in range(args.repeats):
                for w in names:
                    for e in runnable[w]:
                        seconds[w, e].append(workers[e].run(w)["seconds"])
                print(f"  repetition {rep + 1}: " + ", ".join(f"{w}/{e} {seconds[w, e][-1]:.2f}s" for w in names
                                                             for e in runnable[w]), flush=True)
        finally:
            for wk in workers.values():
                wk.close()
    rows = []
    for w in names:
        reference = reference_engine(runnable[w])
        agree = agreement(outputs[w], kinds[w], reference)
        for e in runnable[w]:
            rows.append(dict(workload=w, engine=e, seconds=seconds[w, e], seconds_min=min(seconds[w, e]),
                             first_call_s=first[w, e], agreement_with=reference, agreement=agree[e],
                             startup_s=workers[e].startup_s))
    best = {(r["workload"], r["engine"]): r["seconds_min"] for r in rows}
    ratios = {}
    for w in names:
        moejax = best.get((w, "moejax-serve"), best.get((w, "moejax")))
        for peer in ("vllm", "transformers"):
            if moejax and (w, peer) in best:
                ratios[f"{w}: moejax speed / {peer}"] = best[w, peer] / moejax
    print(f"  {'workload':8s} " + " ".join(f"{e:>13s}" for e in engines))
    for w in names:
        print(f"  {w:8s} " + " ".join(f"{best[w, e]:12.2f}s" if (w, e) in best else f"{'-':>13s}" for e in engines))
    for k, v in ratios.items():
        print(f"  {k}: {v:.2f}x")
    versions = {}
    if "vllm" in engines:
        versions["vllm"] = subprocess.run([args.vllm_python, "-c", "import vllm; print(vllm.__version__)"],
                                          capture_output=True, text=True, env=vllm_environment(args.vllm_python)
                                          ).stdout.strip().splitlines()[-1:]
    return dict(**environment, benchmark="peers", peer_versions=versions,
                config=dict(model=args.model or BENCH_CONFIG, dtype=args.dtype, requests=args.requests,
                            prompts=args.prompts, repeats=args.repeats, engines=engines, workloads=names,
                            seed=args.seed),
                results=rows, ratios=ratios)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = sub.add_parser("peers", help="moejax vs transformers (and vLLM) on scoring and generation workloads")
    p.add_argument("--engines", default="moejax-serve,moejax,transformers,vllm",
                   help="comma-separated: moejax-serve, moejax, transformers, vllm (vllm only with --vllm-python)")
    p.add_argument("--workloads", default="A,B,C")
    p.add_argument("--vllm-python", default=None, help="a Python whose environment has vLLM (CPU build)")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the random benchmark model)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--requests", type=int, default=64, help="scoring requests per workload (A, B)")
    p.add_argument("--prompts", type=int, default=32, help="prompts of workload C")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON file (default bench/results/peers-<device>.json)")
    return p
