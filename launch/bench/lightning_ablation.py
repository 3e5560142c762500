"""`python -m launch.bench lightning-ablation`: MoE-Lightning's §6.1 ablation, its policy run under FlexGen's launch
order (per layer the weights, then each micro-batch's pre-attention, host attention and FFN one after another) against
CGOPipe's (the host's attention two micro-batches ahead of the device's work), in one engine: the same compiled
programs, only the order the host dispatches them in differs (moejax.lightning.schedule.ORDERS).

The requests are `launch.bench lightning`'s (random prompts, greedy, no stop token) through the continuous-batching
scheduler at the policy's N. One untimed run compiles; then --repeats rounds run each order once (which goes first
alternates round by round), and the median seconds of each give output tokens/s. Every run's tokens must equal the
first's (the order changes when work runs, never what it computes): `same_tokens` says so. The ratio is CGOPipe's
tokens/s over FlexGen's, what the paper's §6.1 ablation reports on its GPUs. On a CPU the device and the host are
the same cores: the ratio shows how far overlapping the tasks helps there, not a GPU's gain (the host's tasks run on
a second CPU device, set before JAX starts, so that they have a stream of their own)."""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np

import moejax
from launch.bench.lightning import CPU_MODEL, _budget_gb, _requests
from launch.bench.results import no_file
from launch.bench.util import second_cpu_device
from moejax.engine import Engine
from moejax.lightning.cgopipe_steps import LightningSteps
from moejax.lightning.schedule import ORDERS
from moejax.sched.continuous import GenRequest, Scheduler
from moejax.sched.pool_size import pool_size

NOTE = ("On a CPU the accelerator and the host are the same cores: CGOPipe's overlap can only hide the copies and "
        "the dispatch, so the ratio is a floor for what the order gains where the host and the device are apart")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = sub.add_parser("lightning-ablation", help="MoE-Lightning §6.1: its policy under FlexGen's launch order "
                                                  "against CGOPipe's, tokens/s")
    p.add_argument("--model", default=CPU_MODEL, help="preset or checkpoint directory (default the embedded model)")
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--requests", type=int, default=16, help="requests generated in each run")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--device-rows", type=int, default=4,
                   help="sequences whose KV the default budget leaves room for beside the weights")
    p.add_argument("--budget-gb", type=float, default=None, help="device memory budget (default: launch.bench "
                                                                 "lightning's)")
    p.add_argument("--batch-size", type=int, default=None, help="lightning's N (default --requests)")
    p.add_argument("--micro-batch", type=int, default=None, help="lightning's μ (default N / 4)")
    p.add_argument("--resident-share", type=float, default=0.0, help="lightning's r_w")
    p.add_argument("--repeats", type=int, default=6, help="timed rounds, each order once per round")
    p.add_argument("--out", default=None, help="JSON file (default bench/results/lightning-ablation-<device>.json)")
    # on a CPU, the host's tasks on a second CPU device: its own stream, so that they can overlap the device's
    p.set_defaults(before_start=second_cpu_device)
    return p


def _run(engine: Engine, requests: list[GenRequest], blocks: int) -> tuple[float, list[list[int]], int]:
    """One scheduler run -> (seconds, each request's tokens, the largest batch a decode step carried)."""
    out: dict = {}
    failed: list[str] = []
    sched = Scheduler(engine, blocks, **engine.placement.scheduler_defaults())
    t0 = time.perf_counter()
    stats = sched.run(requests, lambda g, t, c: out.__setitem__(g.tag, list(t)), lambda g, m: failed.append(m))
    seconds = time.perf_counter() - t0
    if failed:
        raise RuntimeError(f"lightning-ablation: {len(failed)} requests failed, the first: {failed[0]}")
    return seconds, [out[i] for i in range(len(requests))], stats.peak_rows


def lightning_ablation(args: argparse.Namespace, env: dict, partial: Callable[[dict, str], None] = no_file) -> dict:
    if min(args.requests, args.prompt_len, args.new_tokens, args.repeats) < 1:
        raise ValueError("--requests, --prompt-len, --new-tokens and --repeats must be >= 1")
    budget = args.budget_gb or _budget_gb(args)
    N = args.batch_size or args.requests
    mu = args.micro_batch or max(N // 4, 1)
    engine = moejax.load(args.model, dtype=args.dtype, num_layers=args.num_layers, compilation_cache=False,
                         placement="lightning", device_memory_gb=budget, decode_batch=N, micro_batch=mu,
                         resident_share=args.resident_share, kv_device_share=0.0, attention_on="host",
                         plan_seq_len=args.prompt_len, plan_gen_len=args.new_tokens)
    steps = engine.steps
    assert isinstance(steps, LightningSteps)  # placement lightning's
    requests = _requests(args, engine.config.vocab_size)
    blocks = pool_size(engine, [(len(r.prompt), r.max_tokens) for r in requests]).blocks
    record = dict(env, benchmark="lightning-ablation", note=NOTE, model=args.model, num_layers=args.num_layers,
                  dtype=args.dtype, budget_gb=budget, requests=args.requests, prompt_len=args.prompt_len,
                  new_tokens=args.new_tokens, repeats=args.repeats,
                  policy=dict(N=N, mu=mu, micro_batches=-(-N // mu), r_w=args.resident_share, r_c=0.0, A_g=0, F_g=1),
                  host=str(steps.host), device=str(steps.device), runs=[])
    t0 = time.perf_counter()
    compile_s, first, _ = _run(engine, requests, blocks)  # compiles every shape both orders run
    seconds: dict[str, list[float]] = {name: [] for name in ORDERS}
    same, peak = True, 0
    for round_ in range(args.repeats):
        for name in list(ORDERS)[::-1 if round_ % 2 else 1]:  # ABBA: neither order always runs first
            steps.settings.schedule = name
            s, tokens, rows = _run(engine, requests, blocks)
            seconds[name].append(s)
            same, peak = same and tokens == first, max(peak, rows)
    steps.settings.schedule = "cgopipe"
    generated = sum(map(len, first))
    for name in ORDERS:
        median = float(np.median(seconds[name]))
        record["runs"].append(dict(schedule=name, seconds=median, seconds_each=seconds[name],
                                   generated_tokens=generated, tokens_per_s=generated / median))
        print(f"  {name:8s}: {generated / median:8.1f} tok/s (median of {args.repeats}: {median:.3f} s)", flush=True)
    rate = {r["schedule"]: r["tokens_per_s"] for r in record["runs"]}
    record.update(cgopipe_vs_flexgen=rate["cgopipe"] / rate["flexgen"], same_tokens=same, peak_rows=peak,
                  first_run_s=compile_s, total_s=time.perf_counter() - t0)
    print(f"  cgopipe / flexgen: {record['cgopipe_vs_flexgen']:.2f}x, same tokens {same}, peak batch {peak} rows")
    partial(record, "both orders")
    return record
