"""`python -m launch.bench invariant`: what batch_invariant=True costs (moejax.kernels.invariant). Two engines of
one model, the mode on and off, alternate round by round: prefill throughput (Engine.logits over --batch rows of
--prompt-len tokens: prompt tokens/s) and decode throughput (rows x new tokens / TPOT, TPOT the slope between two
generation lengths as in `launch.bench router-free`), medians over --repeats rounds. The cost is 1 - the mode's
throughput / the default's. Each round also checks the mode's promise on the timed batch: the first row's logits
alone equal its logits in the batch."""
from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import numpy as np

import moejax
from launch.bench.results import no_file
from launch.bench.util import cpu_seconds, decode_tpot
from moejax.presets import DEFAULT_MODEL

METHOD = ("prefill: tokens/s = batch x prompt_len / s of Engine.logits; decode: tokens/s = batch / TPOT, TPOT = "
          "(s of generate(prompts, 1 + n) - s of generate(prompts, 1 + n // 2)) / (n - n // 2); the two engines "
          "alternate within each round; medians over rounds; cost = 1 - tokens/s with the mode / without")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = sub.add_parser("invariant", help="batch_invariant's cost: prefill and decode throughput with the mode and "
                                         "without")
    p.add_argument("--model", default=DEFAULT_MODEL, help="preset, embedded model or checkpoint directory")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--batch", type=int, default=8, help="rows per step")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=16, help="the longer generation (>= 4)")
    p.add_argument("--repeats", type=int, default=5, help="rounds (each engine once per round, alternating)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON file (default bench/results/invariant-<device>.json)")
    return p


def _seconds(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def invariant(args: argparse.Namespace, env: dict, partial: Callable[[dict, str], None] = no_file) -> dict:
    if args.new_tokens < 4 or min(args.batch, args.prompt_len, args.repeats) < 1:
        raise ValueError("--new-tokens must be >= 4 and --batch, --prompt-len, --repeats >= 1")
    t0 = time.perf_counter()
    engines = {name: moejax.load(args.model, dtype=args.dtype, batch_invariant=on, compilation_cache=False)
               for name, on in (("default", False), ("invariant", True))}
    cfg = engines["default"].config
    rng = np.random.default_rng(args.seed)
    ids = rng.integers(0, cfg.vocab_size, (args.batch, args.prompt_len))
    prompts = ids[:, :args.prompt_len].tolist()
    for e in engines.values():  # compile every shape the rounds run
        e.logits(ids), e.logits(ids[:1])
        e.generate(prompts, 1 + args.new_tokens, temperature=0.0)
        e.generate(prompts, 1 + args.new_tokens // 2, temperature=0.0)
    promise = [bool(np.array_equal(e.logits(ids[:1])[0], e.logits(ids)[0])) for e in engines.values()]
    record = dict(**env, benchmark="invariant", method=METHOD, model=args.model, dtype=args.dtype, batch=args.batch,
                  prompt_len=args.prompt_len, new_tokens=args.new_tokens, repeats=args.repeats,
                  alone_equals_batched=dict(zip(engines, promise, strict=True)))
    prefill: dict[str, list[float]] = {name: [] for name in engines}
    decode: dict[str, list[float]] = {name: [] for name in engines}
    (all0, own0), wall0 = cpu_seconds(), time.perf_counter()
    for r in range(args.repeats):
        order = list(engines) if r % 2 == 0 else list(engines)[::-1]  # alternate which runs first
        for name in order:
            prefill[name].append(args.batch * args.prompt_len / _seconds(lambda: engines[name].logits(ids)))  # noqa: B023 (timed here)
            decode[name].append(args.batch / decode_tpot(engines[name], prompts, args.new_tokens))
    (all1, own1), wall = cpu_seconds(), time.perf_counter() - wall0
    other = max(0.0, (all1 - all0) - (own1 - own0)) / (wall * (os.cpu_count() or 1))
    med = {kind: {name: float(np.median(v)) for name, v in runs.items()}
           for kind, runs in (("prefill", prefill), ("decode", decode))}
    cost = {kind: 1 - m["invariant"] / m["default"] for kind, m in med.items()}
    record.update(tokens_per_s=med, tokens_per_s_runs=dict(prefill=prefill, decode=decode), cost=cost,
                  off_by_default=any(c >= 0.05 for c in cost.values()), other_processes_cpu_share=other,
                  wall_s=time.perf_counter() - t0)
    for kind in med:
        print(f"  {kind:7s}: {med[kind]['default']:9.1f} tok/s default, {med[kind]['invariant']:9.1f} tok/s "
              f"batch-invariant -> cost {cost[kind]:+.1%}", flush=True)
    print(f"  alone == batched logits: {record['alone_equals_batched']}; (other processes {other:.0%} CPU)")
    partial(record, "all")
    return record
