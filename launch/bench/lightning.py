"""`python -m launch.bench lightning`: generation throughput of placement lightning (MoE-Lightning's CGOPipe: the
KV cache in host memory, attention on the host, experts paged in with a resident share) against streamed and cached
at the same device memory budget, side by side in one process.

Every placement runs the same requests (random prompts of --prompt-len tokens, --new-tokens each, greedy, no stop
token) through the continuous-batching scheduler, as launch.serve does: the KV pool where the placement keeps it
(streamed and cached: in what the device budget leaves beside their weights; lightning: in host memory), the decode
batch as large as that pool and --max-rows allow (lightning: its policy's N). One untimed run compiles; the timed
run's output tokens/s, the largest batch a decode step carried, and whether its tokens equal the first placement's
are reported. For lightning, one probed decode call at its N and the average context
(moejax.measure.lightning_probe) gives the share of the time each resource was busy, and with a hardware profile
the HRM's predicted per-layer time.

Two more rows run the other policies of MoE-Lightning's search (§4.2) with lightning's N, μ and r_w:
`lightning-host-ffn` (F_g = 0: the experts past r_w in host memory, the host runs them; CGOPipe's attention on the
host) and `lightning-swapped-kv` (A_g = 1: attention on the device, the KV of the layers past --swap-kv-share on the
host and swapped in a layer at a time, FlexGen's S4). A policy the budget cannot hold is recorded as refused, with
the reason.

The default budget fits the non-expert weights, three layers of experts (a streamed window of 2, lightning's
double-buffered pages) and the KV of --device-rows sequences: streamed and cached can batch
only that many, lightning as many as its policy's N. On a CPU the accelerator and the host are the same cores and
memory: the numbers show the pipeline's overhead and how far its tasks overlap, not what a GPU gains (MoE-Lightning
reports 3.5-10.3x over FlexGen-style layer streaming at the same budget; our streamed is that baseline)."""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

import moejax
from launch.bench.results import no_file
from moejax.engine import Engine
from moejax.measure.lightning_probe import explain_engine
from moejax.sched.continuous import GenRequest, Scheduler, Stats
from moejax.sched.pool_size import pool_size

CPU_MODEL = "pycode-moe"
NOTE = ("On this CPU the accelerator and the host share the cores and the memory: lightning's host attention and "
        "its copies compete with the 'device' work, so these ratios show overhead and overlap only, not a GPU's gain")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = sub.add_parser("lightning", help="lightning vs streamed and cached generation at one device budget")
    p.add_argument("--model", default=CPU_MODEL, help="preset or checkpoint directory (default the embedded model)")
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--requests", type=int, default=32, help="requests generated in each run")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--device-rows", type=int, default=4,
                   help="sequences whose KV the default budget leaves room for beside the weights")
    p.add_argument("--budget-gb", type=float, default=None, help="device memory budget (default: see above)")
    p.add_argument("--batch-size", type=int, default=None, help="lightning's N (default --requests)")
    p.add_argument("--micro-batch", type=int, default=None, help="lightning's μ (default N / 4)")
    p.add_argument("--resident-share", type=float, default=0.0, help="lightning's r_w")
    p.add_argument("--max-rows", type=int, default=64, help="streamed and cached: most rows of a decode step")
    p.add_argument("--swap-kv-share", type=float, default=0.0,
                   help="lightning-swapped-kv's r_c: the share of the layers whose KV stays on the device")
    p.add_argument("--placements", default="lightning,streamed,cached",
                   help=f"comma-separated rows: streamed, cached, {', '.join(LIGHTNING_MODES)}")
    p.add_argument("--profile", default=None, help="hardware profile for the HRM's prediction (default: the device's)")
    p.add_argument("--quick", action="store_true", help="8 requests of 16 + 8 tokens: a smoke run")
    p.add_argument("--out", default=None, help="JSON file (default bench/results/lightning-<device>.json)")
    return p


LIGHTNING_MODES = ("lightning", "lightning-host-ffn", "lightning-swapped-kv")


def _lightning_options(mode: str, args: argparse.Namespace, N: int, mu: int) -> dict:
    """The lightning options of a row: CGOPipe's policy, or one field of it changed (module docstring)."""
    options = dict(decode_batch=N, micro_batch=mu, resident_share=args.resident_share, kv_device_share=0.0,
                   attention_on="host", ffn_on="device", plan_seq_len=args.prompt_len, plan_gen_len=args.new_tokens)
    if mode == "lightning-host-ffn":
        options.update(ffn_on="host")
    elif mode == "lightning-swapped-kv":
        options.update(attention_on="device", kv_device_share=args.swap_kv_share)
    return options


def _requests(args: argparse.Namespace, vocab: int) -> list[GenRequest]:
    rng = np.random.default_rng(0)
    key = np.asarray(jax.random.key_data(jax.random.key(0)))
    return [GenRequest(rng.integers(1, vocab, args.prompt_len).tolist(), args.new_tokens, key, tag=i)
            for i in range(args.requests)]


def _budget_gb(args: argparse.Namespace) -> float:
    """Non-expert weights, three layers of experts and the KV of --device-rows sequences, over 0.9 (the reserve)."""
    probe = moejax.load(args.model, dtype=args.dtype, num_layers=args.num_layers, compilation_cache=False)
    b = probe.memory_budget
    kv = probe.kv_bytes_per_token() * args.device_rows * (args.prompt_len + args.new_tokens + 16)
    return (b.resident_bytes + 3 * b.layer_expert_bytes + kv) / 0.9 / 2**30


def _run(engine: Engine, requests: list[GenRequest], max_rows: int) -> tuple[dict, list]:
    sequences = [(len(r.prompt), r.max_tokens) for r in requests]
    size = pool_size(engine, sequences)
    options = {"max_rows": max_rows, **engine.placement.scheduler_defaults()}
    out: dict = {}
    failed: list[str] = []

    def go() -> Stats:
        out.clear()
        sched = Scheduler(engine, size.blocks, **options)
        stats = sched.run(requests, lambda g, t, c: out.__setitem__(g.tag, list(t)), lambda g, m: failed.append(m))
        return stats

    t0 = time.perf_counter()
    go()  # compiles
    first = time.perf_counter() - t0
    engine.reset_stats()
    t0 = time.perf_counter()
    stats = go()
    seconds = time.perf_counter() - t0
    tokens = [out.get(i, []) for i in range(len(requests))]
    generated = sum(map(len, tokens))
    row = dict(placement=engine.placement.name, seconds=seconds, first_run_s=first, generated_tokens=generated,
               tokens_per_s=generated / seconds, peak_rows=stats.peak_rows, kv_pool=size.describe(),
               decode_steps=stats.decode_steps, failed=failed[:3], engine_stats=_summary(engine.stats()))
    return row, tokens


def _summary(stats: dict) -> dict:
    """Totals only (per-layer counters make the record long)."""
    return {k: v for k, v in stats.items() if k != "layers"}


def lightning(args: argparse.Namespace, env: dict, partial: Callable[[dict, str], None] = no_file) -> dict:
    if args.quick:
        args.requests, args.prompt_len, args.new_tokens = 8, 16, 8
    budget = args.budget_gb or _budget_gb(args)
    N = args.batch_size or args.requests
    mu = args.micro_batch or max(N // 4, 1)
    requests = None
    record = dict(env, benchmark="lightning", note=NOTE, model=args.model, num_layers=args.num_layers,
                  dtype=args.dtype, budget_gb=budget, requests=args.requests, prompt_len=args.prompt_len,
                  new_tokens=args.new_tokens, policy=dict(N=N, mu=mu, r_w=args.resident_share, r_c=0.0, A_g=0, F_g=1),
                  runs=[])
    first_tokens = None
    for name in args.placements.split(","):
        lightning_mode = name in LIGHTNING_MODES
        options: dict[str, Any] = dict(placement="lightning" if lightning_mode else name, device_memory_gb=budget)
        if lightning_mode:
            options.update(_lightning_options(name, args, N, mu))
        try:
            engine = moejax.load(args.model, dtype=args.dtype, num_layers=args.num_layers, compilation_cache=False,
                                 **options)
        except ValueError as e:  # a policy the budget cannot hold: said, and the other rows still run
            record["runs"].append(dict(placement=options["placement"], mode=name, refused=str(e)))
            print(f"  {name}: refused: {e}", flush=True)
            continue
        requests = requests or _requests(args, engine.config.vocab_size)
        row, tokens = _run(engine, requests, args.max_rows)
        row["mode"] = name
        first_tokens = first_tokens if first_tokens is not None else tokens
        row["same_tokens_as_first"] = tokens == first_tokens
        if lightning_mode:
            row["policy"] = engine.memory_budget.lightning.describe()
        if name == "lightning":
            row.update(_probe(engine, args))
        record["runs"].append(row)
        print(f"  {name:9s}: {row['tokens_per_s']:8.1f} tok/s, peak batch {row['peak_rows']:3d} rows, "
              f"same tokens {row['same_tokens_as_first']} ({row['kv_pool']})", flush=True)
        partial(record, name)
        del engine
    base = {r["mode"]: r["tokens_per_s"] for r in record["runs"] if "refused" not in r}
    if "lightning" in base:
        record["lightning_vs"] = {k: base["lightning"] / v for k, v in base.items() if k != "lightning"}
        print("  lightning / " + ", ".join(f"{k}: {v:.2f}x" for k, v in record["lightning_vs"].items()))
    return record


def _probe(engine: Engine, args: argparse.Namespace) -> dict:
    """The probed decode at the policy's N (the engine was loaded with this run's prompt and generation lengths as
    its plan's), against the HRM's prediction where a hardware profile exists."""
    lines, probe, predicted = explain_engine(engine, args.profile)
    print("\n".join("    " + line for line in lines))
    out = dict(probe=probe.as_dict(), probe_text=lines)
    if predicted is not None:
        out["predicted"] = dict(profile=predicted.hardware, layer_s=predicted.decode.total_s,
                                tokens_per_s=predicted.decode_tokens_per_s, bound=predicted.bound)
    return out
