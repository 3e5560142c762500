"""`python -m launch.bench frontend --real`: engine replicas on this machine (Ray actors, moejax.replicas.run)
under each routing, side by side with one engine in this process, on one shared-prefix scoring file.

Workload: P prefixes of random token ids (Zipf popularity), each request a prefix, a unique suffix and two label
tokens, as SGLang /v1/score lines in token ids. Each routing gets fresh replicas (empty caches), warmed first on a
file of the same shapes with other prefixes; one engine is warmed the same way. Measured: wall time, the time
without compiling (the busiest replica's busy time less its compiles: new batch shapes are compiled as they come,
and on a small CPU run they dominate), prompt tokens/s, the prefix-cache hit rate (prompt tokens read from a cache
across batches), the share of prompt tokens not computed (`shared`: cache hits and sharing inside a batch, the
simulation's hit rate), the tokens computed, each replica's requests and FLOPs load (busiest / mean). On a CPU the
replicas and the driver share the cores: compare the routings with each other, not with the one engine's speed."""
from __future__ import annotations

import argparse
import functools
import json
import tempfile
import time
from collections.abc import Callable

import numpy as np

import moejax
from moejax.compiles import counting
from moejax.loading import read_model
from moejax.replicas.run import ReplicaPlan, ReplicaRun
from moejax.sched.batch import engine_settings, serve_lines
from moejax.sched.serving_options import ServingOptions

NOTE = ("Real replicas (Ray actors) on this machine against one engine; on a CPU the replicas share its cores, so "
        "compare the routings with each other (launch/bench/frontend_real.py)")


def score_lines(prefixes: int, prefix_len: int, suffix_len: int, requests: int, vocab: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    heads = [rng.integers(3, vocab, prefix_len).tolist() for _ in range(prefixes)]
    weights = 1.0 / np.arange(1, prefixes + 1)
    picks = rng.choice(prefixes, size=requests, p=weights / weights.sum())
    out = []
    for k, p in enumerate(picks):
        suffix = rng.integers(3, vocab, suffix_len).tolist()
        labels = [int(t) for t in rng.integers(3, vocab, 2)]
        out.append(json.dumps({"custom_id": f"r{k}", "method": "POST", "url": "/v1/score",  # SGLang's, in token ids
                               "body": {"query": heads[p], "items": [suffix], "label_token_ids": labels}}))
    return out


def real_run(args: argparse.Namespace, env: dict, partial: Callable[[dict, str], None]) -> dict:
    make_engine = functools.partial(moejax.load, args.real_model, dtype="float32")
    options = ServingOptions(max_batch_tokens=args.real_batch_tokens)
    vocab = read_model(args.real_model)[0].vocab_size  # (the config alone: no weights loaded for it)
    shape = (args.real_prefixes, args.real_prefix_len, args.real_suffix_len, args.real_requests, vocab)
    lines, warm = score_lines(*shape, seed=args.seed), score_lines(*shape, seed=args.seed + 1)
    record = {**env, "kind": "frontend-real", "note": NOTE, "model": args.real_model, "replicas": 2,
              "workload": dict(zip(("prefixes", "prefix_len", "suffix_len", "requests"), shape[:4], strict=True)),
              "max_batch_tokens": args.real_batch_tokens, "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        engine = make_engine()
        serve_lines(engine, warm, f"{tmp}/warm.jsonl", options)
        start = time.perf_counter()
        with counting() as compiles:
            one = serve_lines(engine, lines, f"{tmp}/one.jsonl", options, settings=engine_settings(engine))
        wall = time.perf_counter() - start
        record["rows"].append(_row("one engine", one, wall, wall - sum(compiles.seconds.values())))
        del engine
        for routing in args.routings:
            run = ReplicaRun(make_engine, options, ReplicaPlan(replicas=2, routing=routing), model=args.real_model,
                             log_to_driver=False)
            try:
                infos = run.start()
                settings = run.settings(infos)[0]
                run.serve(warm, f"{tmp}/warm-{routing}.jsonl", settings, infos)  # (each run: fresh caches)
                summary = run.serve(lines, f"{tmp}/{routing}.jsonl", settings, infos)
            finally:
                run.stop()
            slowest = max(r["busy_s"] - r["compile_s"] for r in summary["replicas"])
            record["rows"].append(_row(routing, summary, summary["wall_s"], slowest))
            partial(record, routing)
    print("\n".join(table(record)))
    return record


def _row(name: str, s: dict, wall: float, compute_s: float) -> dict:
    """compute_s: the time without compiling (new batch shapes), of the busiest replica."""
    row = {"run": name, "wall_s": wall, "compute_s": compute_s, "tokens_per_s": s["prompt_tokens"] / wall,
           "prompt_tokens": s["prompt_tokens"],
           "cached_prompt_tokens": s["cached_prompt_tokens"], "computed_tokens": s["computed_tokens"],
           "prefix_cache_hit_rate": s["prefix_cache_hit_rate"], "requests_ok": s["requests_ok"],
           "shared": 1 - s["computed_tokens"] / s["prompt_tokens"] if s["prompt_tokens"] else 0.0}
    if "replicas" in s:
        row.update(flops_balance=s["flops_balance"], rerouted=s["rerouted"],
                   per_replica=[{k: r[k] for k in ("requests", "shares", "routed_flops", "prefix_cache_hit_rate",
                                                   "busy_s", "compile_s", "round_flops")} for r in s["replicas"]])
    return row


def table(record: dict) -> list[str]:
    out = [f"{record['model']}, 2 replicas, workload {record['workload']}:",
           f"  {'run':14s} {'wall s':>8s} {'compute s':>9s} {'tok/s':>8s} {'hit':>6s} {'shared':>6s} "
           f"{'computed':>9s} {'balance':>8s}  requests"]
    for r in record["rows"]:
        balance = r.get("flops_balance")
        split = "/".join(str(p["requests"]) for p in r.get("per_replica", []))
        out.append(f"  {r['run']:14s} {r['wall_s']:8.2f} {r['compute_s']:9.2f} {r['tokens_per_s']:8.0f} "
                   f"{r['prefix_cache_hit_rate']:6.3f} {r['shared']:6.3f} "
                   f"{r['computed_tokens']:9d} {'-' if balance is None else f'{balance:.3f}':>8s}  {split or '-'}")
    return out

