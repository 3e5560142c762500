"""`python -m launch.bench serve`: batch-runner throughput on synthetic scoring workloads, side by side in one
process: a high shared-prefix workload (one long prefix, short unique suffixes) and one with no sharing, each
served with the prefix KV cache on, off (KV-free) and auto. Every configuration is run once untimed (compiles)
and then `--repeats` times; tokens/s counts the prompt tokens of every request (what a naive engine computes)."""
from __future__ import annotations

import json
import os
import tempfile
import time

import numpy as np

import moejax
from moejax.sched.batch import serve_lines

MODES = ("on", "off", "auto")


def workload(kind: str, n: int, prefix: int, suffix: int, candidates: int, vocab: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    shared = rng.integers(1, vocab, prefix).tolist()
    lines = []
    for i in range(n):
        head = shared if kind == "shared" else rng.integers(1, vocab, prefix).tolist()
        body = {"prompt_token_ids": head + rng.integers(1, vocab, suffix).tolist(),
                "candidate_token_ids": [[int(t)] for t in rng.choice(vocab, candidates, replace=False)]}
        lines.append(json.dumps({"custom_id": f"{kind}-{i}", "url": "/v1/score", "body": body}))
    return lines


def _serve(engine, lines, mode: str, max_batch_tokens: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        summary = serve_lines(engine, lines, os.path.join(d, "out.jsonl"), max_batch_tokens=max_batch_tokens,
                              kv_cache=mode)
        summary["outer_wall_s"] = time.perf_counter() - t0
    return summary


def serve(args, environment: dict) -> dict:
    options = {} if args.num_layers is None else {"num_layers": args.num_layers}
    engine = moejax.load(args.model, dtype=args.dtype, **options)
    results = []
    for kind in ("shared", "distinct"):
        lines = workload(kind, args.requests, args.prefix, args.suffix, args.candidates, engine.config.vocab_size,
                         args.seed)
        for mode in MODES:
            _serve(engine, lines, mode, args.max_batch_tokens)  # compile every shape this plan uses
            runs = [_serve(engine, lines, mode, args.max_batch_tokens) for _ in range(args.repeats)]
            walls = [r["wall_s"] for r in runs]
            last = runs[-1]
            row = dict(workload=kind, kv_cache=mode, policy=last["kv_cache"], seconds=walls,
                       seconds_median=float(np.median(walls)), prompt_tokens=last["prompt_tokens"],
                       computed_tokens=last["computed_tokens"], cached_prompt_tokens=last["cached_prompt_tokens"],
                       padded_tokens=last["padded_tokens"], batches=last["batches"],
                       tokens_per_s=last["prompt_tokens"] / float(np.median(walls)))
            print(f"  {kind:8s} kv {mode:4s} {row['tokens_per_s']:9.1f} tok/s  median {row['seconds_median']:.2f}s  "
                  f"computed {row['computed_tokens']} of {row['prompt_tokens']} prompt tokens, "
                  f"{row['cached_prompt_tokens']} from cache, {row['batches']} batches", flush=True)
            results.append(row)
    rate = {(r["workload"], r["kv_cache"]): r["tokens_per_s"] for r in results}
    ratios = {"shared: prefix cache on / off": rate["shared", "on"] / rate["shared", "off"],
              "shared: auto / off": rate["shared", "auto"] / rate["shared", "off"],
              "distinct: KV-free (off) / KV (on)": rate["distinct", "off"] / rate["distinct", "on"],
              "distinct: auto / on": rate["distinct", "auto"] / rate["distinct", "on"]}
    for k, v in ratios.items():
        print(f"  {k}: {v:.2f}x")
    return dict(**environment, benchmark="serve",
                config=dict(model=args.model, num_layers=engine.config.num_layers, dtype=args.dtype,
                            requests=args.requests, prefix=args.prefix, suffix=args.suffix,
                            candidates=args.candidates, max_batch_tokens=args.max_batch_tokens,
                            repeats=args.repeats),
                results=results, ratios=ratios)


def add_parser(sub):
    p = sub.add_parser("serve", help="batch-runner tokens/s: prefix cache on/off, KV-free vs KV")
    p.add_argument("--model", default="tiny-qwen3-moe")
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prefix", type=int, default=512, help="prefix tokens (shared in the shared workload)")
    p.add_argument("--suffix", type=int, default=32, help="unique tokens after the prefix")
    p.add_argument("--candidates", type=int, default=4, help="single-token candidates per request")
    p.add_argument("--max-batch-tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON file (default bench/results/serve-<device>.json)")
    return p
