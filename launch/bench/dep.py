"""`python -m launch.bench dep-a2e`: DEP's two ways of getting a token chunk to its experts' owners, end to end on the
devices present (moejax.sharding.dep.Disaggregated.a2e): `straight` (FinDEP's A2E: each attention device sends its
rows to the expert devices directly, each runs its own experts' choices and sends weighted partial outputs back)
against `regroup` (rows land on the expert group split by rows and an all-to-all inside the group routes them).

Per DEP layout in --layouts (';'-separated): one engine, a warm-up call of each route (compilation), then --repeats
timed `engine.logits` calls of each route, interleaved round by round (a slow stretch of the machine hits both
alike); tokens/s, the ratio straight / regroup, the bytes between the groups per forward (`engine.stats()`) and each
route's logits against the one-device float32 model. Simulated CPU devices
(XLA_FLAGS=--xla_force_host_platform_device_count=8) share the same cores: the times measure work and dispatch
(copies, programs, padding), not links; the byte counts carry over to GPUs."""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

import moejax
from launch.bench.results import no_file
from moejax.sharding.dep import A2E_ROUTES

DEFAULT_LAYOUTS = ("attn=dp,experts=dep,attn_devices=4,expert_devices=4,r1=2,r2=2;"
                   "attn=dp,experts=dep,attn_devices=6,expert_devices=2,r1=2,r2=2;"
                   "attn=dp,experts=dep,attn_devices=2,expert_devices=4,r1=1,r2=1")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = sub.add_parser("dep-a2e", help="DEP: A2E straight to the experts' owners vs regrouped inside the expert group")
    p.add_argument("--model", default="tiny-qwen3-moe", help="preset or checkpoint directory")
    p.add_argument("--layouts", default=DEFAULT_LAYOUTS, help="';'-separated DEP layout specs")
    p.add_argument("--batch", type=int, default=16, help="sequences per measured forward")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per route and layout")
    p.add_argument("--out", default=None, help="JSON file (default bench/results/dep-a2e-<device>.json)")
    return p


def rel(out: np.ndarray, ref: np.ndarray) -> float:
    return float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))


def measure_layout(model: str, spec: str, ids: np.ndarray, ref: np.ndarray, repeats: int) -> dict:
    engine = moejax.load(model, dtype="float32", compilation_cache=False, layout=spec)
    placement: Any = engine.layered_steps.placement  # Disaggregated, whose route and counters the bench resets
    errors: dict[str, float] = {}
    stats: dict[str, dict] = {}
    seconds: dict[str, list[float]] = {route: [] for route in A2E_ROUTES}
    for route in A2E_ROUTES:  # warm-up: compile, check, count the bytes of one forward
        placement.a2e = route
        placement.stats.__init__()
        errors[route] = rel(engine.logits(ids), ref)
        stats[route] = engine.stats()["total"]
    for _ in range(repeats):
        for route in A2E_ROUTES:
            placement.a2e = route
            start = time.perf_counter()
            engine.logits(ids)
            seconds[route].append(time.perf_counter() - start)
    rows: dict[str, dict[str, Any]] = {}  # JSON rows
    for route in A2E_ROUTES:
        median = float(np.median(seconds[route]))
        rows[route] = dict(seconds=seconds[route], seconds_median=median, tokens_per_s=ids.size / median,
                           rel_logits_diff_vs_one_device=errors[route], bytes_per_forward=stats[route])
        print(f"  {route:8s} {ids.size / median:9.1f} tok/s  median {median * 1e3:7.1f} ms  rel diff "
              f"{errors[route]:.2g}  A->E {stats[route]['a2e_bytes']:,} B  E->A {stats[route]['e2a_bytes']:,} B",
              flush=True)
    ratio = rows["straight"]["tokens_per_s"] / rows["regroup"]["tokens_per_s"]
    print(f"  straight / regroup: {ratio:.3f}x", flush=True)
    return dict(layout=str(engine.layout), routes=rows, straight_over_regroup=ratio)


def dep_a2e(args: argparse.Namespace, environment: dict, partial: Callable[[dict, str], None] = no_file) -> dict:
    if jax.device_count() < 2:
        raise SystemExit("dep-a2e needs 2 or more devices; simulate 8 with "
                         "XLA_FLAGS=--xla_force_host_platform_device_count=8")
    ref_engine = moejax.load(args.model, dtype="float32", compilation_cache=False)
    ids = np.random.default_rng(0).integers(0, ref_engine.config.vocab_size, (args.batch, args.seq))
    ref = ref_engine.logits(ids)
    del ref_engine
    record = dict(**environment, benchmark="dep-a2e",
                  config=dict(model=args.model, batch=args.batch, seq=args.seq, repeats=args.repeats, dtype="float32"),
                  results=[])
    for spec in filter(None, (s.strip() for s in args.layouts.split(";"))):
        print(f"{spec} ({args.batch} x {args.seq} tokens):", flush=True)
        record["results"].append(measure_layout(args.model, spec, ids, ref, args.repeats))
        partial(record, spec)
    ratios = [r["straight_over_regroup"] for r in record["results"]]
    record["straight_faster_everywhere"] = all(r > 1 for r in ratios)
    record["geomean_straight_over_regroup"] = float(np.exp(np.mean(np.log(ratios))))
    print(f"geometric mean straight / regroup: {record['geomean_straight_over_regroup']:.3f}x")
    return record
