"""`python -m launch.bench router-free`: what skipping the true router saves in router-free speculative decoding
(Speculating Experts §6.4). Two cached engines of one model with every expert in a slot (no misses, so the
difference is the router): router-free as it runs (the router skipped where a prediction stands in for it) and
with --count-mispredictions (the router run anyway, and its choices compared with the prediction on the host,
per MoE layer). Batch sizes 1 (the case the saving is for) and --batch (more rows: the router's share shrinks).

Time per output token (TPOT) is the slope between two generation lengths, as in `launch.bench offload`; the two
engines alternate round by round, so they share the machine's state, and the medians over --repeats rounds are
compared. Nothing is asserted."""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable

import numpy as np

import moejax
from launch.bench.results import no_file
from launch.bench.util import cpu_seconds, decode_tpot
from moejax.offload.predict import calibrate
from moejax.presets import DEFAULT_MODEL

METHOD = ("TPOT = (s of generate(prompts, 1 + n) - s of generate(prompts, 1 + n // 2)) / (n - n // 2) per round; "
          "rounds alternate the two engines; medians over rounds; saved = 1 - TPOT_skipped / TPOT_counted")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = sub.add_parser("router-free", help="router-free speculation: decode step time with the router skipped "
                                           "against the router run for misprediction counts")
    p.add_argument("--model", default=DEFAULT_MODEL, help="preset, embedded model or checkpoint directory")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--batch", type=int, default=8, help="the larger batch (rows decoded together)")
    p.add_argument("--new-tokens", type=int, default=32, help="the longer generation (>= 4)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5, help="rounds (each engine once per round)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON file (default bench/results/router-free-<device>.json)")
    return p


def _engines(args: argparse.Namespace, vectors_path: str, slots: int) -> dict:
    common = dict(dtype=args.dtype, placement="cached", cache_slots=slots, predictor="router", prefetch_distance=1,
                  default_vectors=vectors_path, speculative=True, router_free=True, compilation_cache=False)
    return {name: moejax.load(args.model, count_mispredictions=count, **common)
            for name, count in (("router_skipped", False), ("router_counted", True))}


def router_free(args: argparse.Namespace, env: dict, partial: Callable[[dict, str], None] = no_file) -> dict:
    if args.new_tokens < 4:
        raise ValueError(f"--new-tokens must be >= 4 (TPOT is a slope between two lengths), got {args.new_tokens}")
    t0 = time.perf_counter()
    resident = moejax.load(args.model, dtype=args.dtype, compilation_cache=False)
    cfg = resident.config
    rng = np.random.default_rng(args.seed)
    vectors = calibrate(resident, rng.integers(0, cfg.vocab_size, (4, 128)).tolist())
    slots = cfg.num_experts * sum(cfg.is_moe(i) for i in range(cfg.num_layers))
    record = dict(**env, benchmark="router-free", method=METHOD, model=args.model, dtype=args.dtype,
                  cache_slots=slots, prompt_len=args.prompt_len, new_tokens=args.new_tokens, repeats=args.repeats,
                  rows=[])
    with tempfile.TemporaryDirectory(prefix="moejax-bench-vectors-") as tmp:
        engines = _engines(args, vectors.save(os.path.join(tmp, "vectors")), slots)
        for batch in sorted({1, args.batch}):
            prompts = rng.integers(0, cfg.vocab_size, (batch, args.prompt_len)).tolist()
            outs = {name: e.generate(prompts, 1 + args.new_tokens, temperature=0.0) for name, e in engines.items()}
            for e in engines.values():  # warm up the shorter length's shapes too
                e.generate(prompts, 1 + args.new_tokens // 2, temperature=0.0)
                e.reset_stats()  # the counters of this batch's timed rounds only
            runs: dict[str, list[float]] = {name: [] for name in engines}
            (all0, own0), wall0 = cpu_seconds(), time.perf_counter()
            for _ in range(args.repeats):
                for name, e in engines.items():
                    runs[name].append(decode_tpot(e, prompts, args.new_tokens))
            (all1, own1), wall = cpu_seconds(), time.perf_counter() - wall0
            other = max(0.0, (all1 - all0) - (own1 - own0)) / (wall * (os.cpu_count() or 1))
            med = {name: float(np.median(r)) for name, r in runs.items()}
            counted = engines["router_counted"].stats()["total"]
            row = dict(batch=batch, tpot_s=med, tpot_runs_s=runs,
                       saved=1 - med["router_skipped"] / med["router_counted"],
                       same_tokens=outs["router_skipped"] == outs["router_counted"],
                       mispredicted_token_share=counted["mispredicted_tokens"] / max(counted["checked_tokens"], 1),
                       other_processes_cpu_share=other)
            record["rows"].append(row)
            print(f"  batch {batch:3d}: TPOT router skipped {med['router_skipped'] * 1e3:8.3f} ms, counted "
                  f"{med['router_counted'] * 1e3:8.3f} ms -> saved {row['saved']:+.3f}; same tokens "
                  f"{row['same_tokens']}; (other processes {other:.0%} CPU)", flush=True)
            partial(dict(record, wall_s=time.perf_counter() - t0), f"batch {batch}")
    return dict(record, wall_s=time.perf_counter() - t0)
