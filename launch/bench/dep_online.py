"""`python -m launch.bench dep-online`: FinDEP's online phase (moejax.plan.findep_online), the solver re-run for each
step shape.

1. Solver per step shape (no devices): for each --solver-models preset on --devices devices of the h100 datasheet,
   the DEP split and (r1, r2, order) FinDEP picks at load for the planned workload (--plan-tokens in sequences of
   --plan-seq), then per serving step shape (rows x tokens per row: chunked-prefill steps and decode steps of one
   token) the online solve on that split: its time (first solve; median of --repeats fresh solves), the time of a
   cache hit, the schedule chosen, and the predicted step time under it against the load's schedule at the same shape
   (the same cost model: what re-solving per shape is predicted to save).
2. On the devices present (2 or more; 8 simulated CPU devices with XLA_FLAGS=--xla_force_host_platform_device_count=8):
   --model loaded with layout attn=dp,experts=dep,r1=auto,r2=auto,order=auto (profile --profile), a long-tail
   generation workload under continuous batching (moejax.sched.continuous): the online log (per shape the schedule,
   its solve time and cache hits), the solver's seconds against the run's wall time, and whether the greedy tokens
   equal the one-device engine's. Simulated CPU devices share their cores: the wall time says nothing of DEP's
   overlap; the solver's share of it is the point."""
from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable

import jax
import numpy as np

import moejax
from launch.bench.results import no_file
from moejax.config import ModelConfig
from moejax.layout import Layout
from moejax.models.kv_pool import BLOCK
from moejax.plan.datasheets import load_profile
from moejax.plan.findep import solve_dep, solve_step
from moejax.plan.findep_online import ONLINE_FIELDS, OnlineDep, even_micro_batches
from moejax.presets import preset_config
from moejax.sched.continuous import GenRequest, Scheduler

# (rows, tokens per row): chunked-prefill steps (rows of up to 512 tokens) and decode steps (one token per row)
SHAPES = ((8, 512), (16, 512), (32, 512), (64, 256), (8, 2048), (16, 1), (64, 1), (256, 1), (1024, 1))


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = sub.add_parser("dep-online", help="FinDEP's online phase: solver time per step shape, cache hits, schedules")
    p.add_argument("--solver-models", default="deepseek-v2-lite,qwen3-30b-a3b", help="presets for part 1")
    p.add_argument("--devices", type=int, default=8, help="devices DEP splits in part 1")
    p.add_argument("--plan-tokens", type=int, default=8192, help="the load's planned step (part 1)")
    p.add_argument("--plan-seq", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=20, help="fresh solves per shape, for the median")
    p.add_argument("--model", default="pycode-moe", help="embedded model or preset run in part 2")
    p.add_argument("--profile", default="h100", help="profile the engine's solver plans on (part 2)")
    p.add_argument("--requests", type=int, default=40, help="generation requests in part 2")
    p.add_argument("--max-rows", type=int, default=64, help="the scheduler's most rows per step (part 2)")
    p.add_argument("--max-tokens", type=int, default=24, help="most tokens generated per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON file (default bench/results/dep-online-<device>.json)")
    return p


def _seconds(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def solver_per_shape(name: str, devices: int, plan_tokens: int, plan_seq: int, repeats: int) -> dict:
    cfg = ModelConfig.from_hf(preset_config(name))
    h100 = load_profile("h100")
    load = solve_dep(cfg, h100, devices=devices, tokens=plan_tokens, seq_len=plan_seq)
    layout = dataclasses.replace(Layout.parse(load.layout_spec()).resolve(cfg.num_experts, devices),
                                 online=ONLINE_FIELDS)
    planner = OnlineDep(cfg, layout, lambda: h100)
    A, B = load.attn_devices, load.expert_devices
    print(f"  {name}: load plan {load.layout_spec()} ({plan_tokens} tokens in sequences of {plan_seq}, solved in "
          f"{load.solve_ms:.1f} ms)", flush=True)
    rows_out = []
    for rows, tokens in SHAPES:
        rows = -(-rows // A) * A  # the engine pads a step's rows to a multiple of the attention devices
        start = time.perf_counter()
        lay = planner.layout_for(rows, tokens)  # first time: solved
        first_s = time.perf_counter() - start
        hit_s = _seconds(lambda: planner.layout_for(rows, tokens), repeats)  # noqa: B023 (timed here)
        fresh_s = _seconds(lambda: OnlineDep(cfg, layout, lambda: h100).layout_for(rows, tokens), repeats)  # noqa: B023 (timed here)
        solved = planner.schedules[(rows, tokens)]
        static = solve_step(cfg, h100, attn_devices=A, expert_devices=B, rows=rows, tokens_per_row=tokens,
                            r1_choices=[load.r1], r2=load.r2, order=load.order)
        assert solved.predicted_s is not None, solved.why
        row = dict(rows=rows, tokens_per_row=tokens, r1=lay.r1, r2=lay.r2, order=lay.order,
                   first_solve_s=first_s, solve_s_median=fresh_s, cache_hit_s_median=hit_s,
                   r1_choices=len(even_micro_batches(rows, A)), predicted_s=solved.predicted_s,
                   load_schedule_predicted_s=static.predicted_s,
                   predicted_speedup_vs_load_schedule=static.predicted_s / solved.predicted_s)
        rows_out.append(row)
        print(f"    {rows:5d} rows x {tokens:5d}: r1={lay.r1:3d} r2={lay.r2:3d} {lay.order:5s} solve "
              f"{fresh_s * 1e3:6.2f} ms (first {first_s * 1e3:6.2f}), hit {hit_s * 1e6:5.1f} us; predicted "
              f"{row['predicted_speedup_vs_load_schedule']:.2f}x the load's schedule", flush=True)
    return dict(model=name, devices=devices, load_plan=load.layout_spec(), load_solve_ms=load.solve_ms,
                plan_tokens=plan_tokens, plan_seq=plan_seq, shapes=rows_out, hits=planner.as_dict()["hits"])


def _workload(vocab: int, requests: int, max_tokens: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """Long-tail prompt lengths (a few long, most short) and generation budgets."""
    rng = np.random.default_rng(seed)
    lengths = np.minimum(4 + rng.pareto(1.2, requests) * 12, 200).astype(int)
    budgets = rng.integers(max(2, max_tokens // 4), max_tokens + 1, requests)
    return [rng.integers(1, vocab, int(n)).tolist() for n in lengths], [int(b) for b in budgets]


def engine_run(args: argparse.Namespace) -> dict:
    spec = "attn=dp,experts=dep,r1=auto,r2=auto,order=auto"
    engine = moejax.load(args.model, dtype="float32", layout=spec, profile=args.profile, compilation_cache=False)
    prompts, budgets = _workload(engine.config.vocab_size, args.requests, args.max_tokens, args.seed)
    keys = [np.asarray(jax.random.key_data(jax.random.fold_in(jax.random.key(args.seed), i)))
            for i in range(len(prompts))]
    requests = [GenRequest(p, m, k, tag=i) for i, (p, m, k) in enumerate(zip(prompts, budgets, keys, strict=True))]
    blocks = sum(-(-(len(p) + m) // BLOCK) for p, m in zip(prompts, budgets, strict=True))
    out: dict = {}
    failed: dict = {}
    sched = Scheduler(engine, blocks, max_rows=args.max_rows, chunk_tokens=256, row_tokens=64, decode_steps=4)
    start = time.perf_counter()
    sched.run(requests, lambda r, tokens, cached: out.__setitem__(r.tag, tokens),
              lambda r, message: failed.__setitem__(r.tag, message))
    wall = time.perf_counter() - start
    if failed:
        raise RuntimeError(f"dep-online: requests failed: {failed}")
    log = engine.stats()["online"]
    reference = moejax.load(args.model, dtype="float32", compilation_cache=False).generate(prompts, max(budgets))
    same = all(out[i] == reference[i][:m] for i, m in enumerate(budgets))
    print(engine.placement.describe(engine.layered_steps), flush=True)
    print(f"  {len(prompts)} requests, {sum(len(t) for t in out.values())} tokens in {wall:.1f} s (compiling "
          f"included); the solver {log['solve_s_total'] * 1e3:.1f} ms of it ({log['solve_s_total'] / wall:.2%}); "
          f"tokens equal the one-device engine's: {same}", flush=True)
    assert engine.layout is not None, "loaded with --layout"
    return dict(model=args.model, layout=str(engine.layout), online_fields=list(engine.layout.online),
                profile=args.profile, decisions=engine.decisions, requests=len(prompts),
                prompt_lengths=[len(p) for p in prompts], max_tokens=budgets,
                generated_tokens=sum(len(t) for t in out.values()), wall_s=wall,
                solver_share_of_wall=log["solve_s_total"] / wall, online=log,
                chunk_steps=sched.stats.chunk_steps, tokens_equal_one_device=same)


def dep_online(args: argparse.Namespace, environment: dict, partial: Callable[[dict, str], None] = no_file) -> dict:
    record = dict(**environment, benchmark="dep-online",
                  config=dict(solver_models=args.solver_models, devices=args.devices, plan_tokens=args.plan_tokens,
                              plan_seq=args.plan_seq, repeats=args.repeats, model=args.model, profile=args.profile,
                              requests=args.requests, max_rows=args.max_rows, max_tokens=args.max_tokens,
                              seed=args.seed),
                  solver=[])
    print("online FinDEP solves per step shape (h100 datasheet):", flush=True)
    for name in args.solver_models.split(","):
        record["solver"].append(solver_per_shape(name, args.devices, args.plan_tokens, args.plan_seq, args.repeats))
        partial(record, f"solver {name}")
    if jax.device_count() >= 2:
        print(f"{args.model} under continuous batching on {jax.device_count()} x {jax.devices()[0].device_kind}:",
              flush=True)
        record["engine"] = engine_run(args)
    else:
        record["engine"] = None
        print("engine run skipped: one device (simulate 8 with XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    return record
