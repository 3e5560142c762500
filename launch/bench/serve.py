"""`python -m launch.bench serve`: batch-runner throughput on synthetic scoring workloads, side by side in one
process: a high shared-prefix workload (one long prefix, short unique suffixes) and one with no sharing, each
served with the prefix KV cache on, off (KV-free) and auto. Every configuration is run once untimed (compiles)
and then `--repeats` times; tokens/s counts the prompt tokens of every request (what a naive engine computes).

Next to them, in the same run, the resident prefill rate over the same total tokens: the workload's prompts laid end
to end in rows of a power of two tokens (no padding), run through `engine.generate(rows, 1)` in calls as large as
the runner's scoring batches; each row reports its prompt tokens/s over that rate. MFU counts moejax.costs' FLOPs,
written out in the JSON, against `--peak-tflops` (a measured ceiling) or else the hardware profile's peak (a
datasheet on known GPUs) or `--measure-peak` (the bf16 matmul ceiling measured in the same process). Each
configuration's first (untimed) run records its compile seconds per program (moejax/compiles.py) and the weights'
materializing time is recorded apart; `--no-resident` skips the resident reference (a second pass over every
token: at full depth it would double the run).

Defaults depend on the platform: on a GPU, thousands of requests of 512 prompt tokens (rows of 512 hold one request
each, nothing padded), the distinct workload KV-free and auto and the shared one auto, the runner sizing its batches
from the device; elsewhere (CPUs) today's small workload, every mode, batches of 2048 tokens.

`--workloads` also takes MoE-Prefill's context regimes (launch/bench/serve_workloads.py): shared-prefix (a few shared
prefixes, short suffixes), long-context (few long prompts), multi-select (one context, several multi-token candidates)
and a mix of the three; the record says what each workload asked and holds (lengths, the prefix-sharing ratio). Each
row records the device's peak memory (XLA's memory stats; null on CPU, which has none) beside the memory budget's
estimate for the run (launch/bench/device_memory.py), and the scores of the first SAMPLE requests as served."""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any, TypedDict

import jax
import numpy as np

import moejax
from launch.bench import device_memory
from launch.bench.serve_workloads import KINDS, REGIMES, Sizes, asked, held, workload
from launch.bench.util import time_calls
from launch.gpu_ceilings import measured
from moejax import compiles
from moejax.config import ModelConfig
from moejax.costs import layer_flops_per_token, prefill_flops
from moejax.engine import Engine
from moejax.plan.resolve import profile_for
from moejax.sched.batch import serve_lines
from moejax.sched.batch_schedule import ORDERS
from moejax.sched.serving_options import ServingOptions

MODES = ("on", "off", "auto")
WORKLOADS = ("distinct", "shared")  # the default set; the others on request (--workloads)
ALL_WORKLOADS = KINDS
SAMPLE = 3  # requests (the first lines) whose scores each row keeps, to check against a reference
LONGEST_SHARE = 0.1  # "the longest requests" whose wait --orders reports: this share of them, by prompt length


class Defaults(TypedDict):
    requests: int
    prefix: int
    modes: dict[str, tuple[str, ...]]  # per workload
    other_modes: tuple[str, ...]  # of the workloads `modes` does not name
    max_batch_tokens: int | None


# platform -> defaults of the flags left out: (requests, prefix, modes per workload and of the rest, max batch tokens)
DEFAULTS = {"gpu": Defaults(requests=2048, prefix=480, modes={"distinct": ("off", "auto"), "shared": ("auto",)},
                            other_modes=("off", "auto"), max_batch_tokens=None),
            "cpu": Defaults(requests=64, prefix=512, modes={w: MODES for w in WORKLOADS}, other_modes=MODES,
                            max_batch_tokens=2048)}


def _serve(engine: Engine, lines: list[str], mode: str, max_batch_tokens: int | None, order: str = "longest"
           ) -> dict:
    done: dict[int, float] = {}
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        out = os.path.join(d, "out.jsonl")
        summary = serve_lines(engine, lines, out,
                              ServingOptions(max_batch_tokens=max_batch_tokens, kv_cache=mode, order=order),
                              done_s=done)
        summary["outer_wall_s"] = time.perf_counter() - t0
        with open(out) as f:
            summary["sample"] = [sampled(json.loads(line)) for line, _ in zip(f, range(SAMPLE), strict=False)]
    summary["done_s"] = done
    return summary


def sampled(result: dict) -> dict:
    """A result line as the record keeps it: its id and each context's candidate log-probabilities."""
    body = result["response"]["body"] if result.get("response") else None
    return dict(custom_id=result["custom_id"], error=result.get("error"),
                logprobs=[[c["logprob"] for c in r["candidates"]] for r in body["results"]] if body else None)


def longest_sequence(lines: list[str]) -> int:
    """Tokens of the longest scored sequence: a prompt and its longest candidate."""
    bodies = [json.loads(line)["body"] for line in lines]
    return max(len(b["prompt_token_ids"]) + max(map(len, b["candidate_token_ids"])) for b in bodies)


def waits(lines: list[str], done: dict[int, float]) -> dict:
    """Seconds from the run's start to each request's result (an offline file: every request arrived at the start),
    over all requests and over the LONGEST_SHARE longest prompts."""
    sizes = {n: len(json.loads(text)["body"]["prompt_token_ids"]) for n, text in enumerate(lines, start=1)}
    longest = sorted(sizes, key=lambda n: -sizes[n])[: max(1, int(len(sizes) * LONGEST_SHARE))]

    def stats(of: list[int]) -> dict:
        w = np.array([done[n] for n in of])
        return dict(requests=len(of), mean_s=float(w.mean()), p50_s=float(np.median(w)),
                    p90_s=float(np.quantile(w, 0.9)), max_s=float(w.max()))
    return dict(all=stats(sorted(done)), longest=stats(longest),
                longest_are=f"the {LONGEST_SHARE:.0%} longest prompts ({min(sizes[n] for n in longest)} tokens "
                            "and more)")


def matmul_flops(cfg: ModelConfig, tokens: int, head: float) -> dict:
    """moejax.costs' matmul FLOPs of `tokens` computed tokens and `head` FLOPs of lm_head (2·D·V per position whose
    next-token distribution is read): what the runner's metrics count, attention scores apart."""
    layers = layer_flops_per_token(cfg) * tokens
    return dict(decoder_matmuls=layers, lm_head=head, total=layers + head)


def peak(args: argparse.Namespace, engine: Engine) -> dict:
    """The FLOP/s MFU is taken against: --peak-tflops (measured), --measure-peak (the bf16 matmul ceiling measured
    now, launch/gpu_ceilings.py), else the hardware profile's, else none."""
    if args.peak_tflops:
        return dict(flops_per_s=args.peak_tflops * 1e12, source="--peak-tflops (measured ceiling)")
    if args.measure_peak:
        m = measured("matmul_bf16")
        return dict(flops_per_s=m["value"] * 1e12, source=f"measured now: bf16 matmul, {m['method']}", measured=m)
    try:
        profile = profile_for(jax.devices()[0].device_kind, len(jax.devices()))
    except ValueError as e:
        return dict(flops_per_s=None, source=f"none: {e}")
    if profile.source == "datasheet" and engine.dtype.itemsize != 2:
        return dict(flops_per_s=None, source=f"none: profile {profile.name}'s datasheet peak is for 16-bit math")
    return dict(flops_per_s=profile.device.flops, source=f"profile {profile.name} ({profile.source})")


def resident_prefill(engine: Engine, lines: list[str], batch_tokens: int, repeats: int, peak_flops: float | None
                     ) -> dict:
    """engine.generate(rows, 1) over the workload's prompt tokens laid end to end in rows of the largest power of two
    not longer than a prompt (the rest of the tokens, fewer than a row, is left out), `batch_tokens` per call."""
    prompts = [json.loads(line)["body"]["prompt_token_ids"] for line in lines]
    row = 1 << (min(map(len, prompts)).bit_length() - 1)
    stream = np.concatenate([np.asarray(p, np.int32) for p in prompts])
    rows = stream[: len(stream) // row * row].reshape(-1, row)
    per_call = min(len(rows), 1 << max(batch_tokens // row, 1).bit_length() - 1)
    calls = [rows[i: i + per_call].tolist() for i in range(0, len(rows), per_call)]
    first, runs, other = time_calls(lambda: [engine.generate(c, 1) for c in calls], repeats)
    median = float(np.median(runs))
    tokens = rows.size
    cfg = engine.config
    flops = matmul_flops(cfg, tokens, 2.0 * cfg.vocab_size * cfg.hidden_size * len(rows))
    flops["attention_scores"] = prefill_flops(cfg, len(rows), row, all_logits=False).attn_scores
    return dict(call="engine.generate(rows, 1)", tokens=tokens, row_tokens=row, rows=len(rows), rows_per_call=per_call,
                calls=len(calls), seconds=runs, seconds_median=median, first_call_s=first,
                other_processes_cpu_share=other, tokens_per_s=tokens / median, flops=flops,
                mfu=flops["total"] / median / peak_flops if peak_flops else None)


# flag -> the smallest value it takes
LEAST = {"requests": 1, "prefix": 0, "suffix": 0, "candidates": 1, "max_batch_tokens": 16, "repeats": 1,
         "prefixes": 1, "context": 1, "long_requests": 1, "choice_tokens": 1}


def check_flags(args: argparse.Namespace) -> None:
    """SystemExit naming the first flag out of range."""
    for name, least in LEAST.items():
        value = getattr(args, name)
        if value is not None and value < least:
            raise SystemExit(f"bench serve: --{name.replace('_', '-')} must be >= {least}; got {value}")
    if args.peak_tflops is not None and not args.peak_tflops > 0:
        raise SystemExit(f"bench serve: --peak-tflops must be > 0; got {args.peak_tflops}")
    if args.prefix == 0 and args.suffix == 0:
        raise SystemExit("bench serve: --prefix and --suffix are both 0: a prompt needs a token")


def check_lengths(lines: list[str], kind: str, limit: int) -> None:
    """SystemExit when the workload's longest scored sequence exceeds the model's context (every such request would
    only be answered 400)."""
    longest = longest_sequence(lines)
    if longest > limit:
        flags = {"long-context": "--context", "multi-select": "--prefix, --suffix or --choice-tokens",
                 "mix": "--context, --prefix, --suffix or --choice-tokens"}.get(kind, "--prefix or --suffix")
        raise SystemExit(f"bench serve: workload {kind}: a prompt and its candidate take {longest} tokens, more than "
                         f"the model's {limit} positions; lower {flags}")


def serve(args: argparse.Namespace, environment: dict, partial: Callable[[dict, str], None] | None = None) -> dict:
    """partial(record so far, row name), when given, after each measured row."""
    check_flags(args)
    platform = jax.devices()[0].platform
    defaults = DEFAULTS["gpu" if platform == "gpu" else "cpu"]
    requests = args.requests or defaults["requests"]
    prefix = args.prefix if args.prefix is not None else defaults["prefix"]
    batch_tokens = args.max_batch_tokens if args.max_batch_tokens is not None else defaults["max_batch_tokens"]
    wanted_modes = tuple(args.kv_modes.split(",")) if args.kv_modes else None
    bad = [m for m in wanted_modes or () if m not in MODES]
    bad += [w for w in args.workloads.split(",") if w not in ALL_WORKLOADS]
    if bad:
        raise SystemExit(f"bench serve: unknown workload or kv mode {', '.join(bad)} (workloads: "
                         f"{', '.join(ALL_WORKLOADS)}; kv modes: {', '.join(MODES)})")
    orders = args.orders.split(",")
    if any(o not in ORDERS for o in orders):
        raise SystemExit(f"bench serve: --orders {args.orders}: each must be one of {', '.join(ORDERS)}")
    options: dict = {} if args.num_layers is None else {"num_layers": args.num_layers}
    if args.placement is not None:
        options["placement"] = args.placement
    if args.profile is not None:
        options["profile"] = args.profile
    engine = moejax.load(args.model, dtype=args.dtype, **options)
    if args.candidates >= engine.config.vocab_size:  # single-token candidates are drawn without repeats
        raise SystemExit(f"bench serve: --candidates {args.candidates}: the vocabulary has "
                         f"{engine.config.vocab_size} tokens")
    # long-context: 4x the other prompts by default, within the model's positions (a single-token candidate after it)
    context = args.context or min(4 * (prefix + args.suffix), engine.config.max_position_embeddings - 1)
    sizes = Sizes(requests=requests, prefix=prefix, suffix=args.suffix, candidates=args.candidates,
                  prefixes=args.prefixes, context=context, long_requests=args.long_requests or max(1, requests // 16),
                  choice_tokens=args.choice_tokens)
    made = {kind: workload(kind, sizes, engine.config.vocab_size, args.seed) for kind in args.workloads.split(",")}
    for kind, lines in made.items():  # before the weights are made
        check_lengths(lines, kind, engine.config.max_position_embeddings)
    t0 = time.perf_counter()
    jax.block_until_ready(engine.params)  # a preset's weights are drawn on the device: timed apart
    weights = dict(source="checkpoint" if os.path.isdir(args.model) else "preset, drawn on the device",
                   materialize_s=time.perf_counter() - t0, bytes=engine.param_bytes())
    top = peak(args, engine)
    results: list[dict] = []
    reference: dict | None = None
    workloads: dict[str, dict] = {}

    def record() -> dict:
        rate = {(r["workload"], r["kv_cache"]): r["tokens_per_s"] for r in results if r["order"] == orders[0]}
        ratios = {name: rate[a] / rate[b] for name, a, b in (
            ("shared: prefix cache on / off", ("shared", "on"), ("shared", "off")),
            ("shared: auto / off", ("shared", "auto"), ("shared", "off")),
            ("distinct: KV-free (off) / KV (on)", ("distinct", "off"), ("distinct", "on")),
            ("distinct: auto / on", ("distinct", "auto"), ("distinct", "on"))) if a in rate and b in rate}
        return dict(**environment, benchmark="serve",
                    config=dict(model=args.model, num_layers=engine.config.num_layers, dtype=args.dtype,
                                requests=requests, prefix=prefix, suffix=args.suffix, candidates=args.candidates,
                                prefixes=sizes.prefixes, context=sizes.context, long_requests=sizes.long_requests,
                                choice_tokens=sizes.choice_tokens, seed=args.seed,
                                max_batch_tokens=batch_tokens, repeats=args.repeats, platform=platform,
                                weights=weights, resident_prefill=not args.no_resident, orders=orders,
                                placement=engine.memory_budget.placement if engine.memory_budget else None,
                                theta_flops=engine.saturation.theta_flops if engine.saturation else None,
                                theta_tokens=engine.saturation.theta_tokens if engine.saturation else None,
                                theta_source=engine.saturation.source if engine.saturation else None,
                                profile=args.profile),
                    peak=top, flops_counted="moejax.costs: layer_flops_per_token (2 x the active parameters of the "
                    "decoder layers) per computed token + lm_head 2·D·V per read position; attention scores apart",
                    resident_prefill=reference, workloads=workloads, results=results, ratios=ratios)

    for kind, lines in made.items():
        workloads[kind] = dict(asked=asked(kind, sizes), held=held(lines))
        longest = longest_sequence(lines)
        modes = wanted_modes or defaults["modes"].get(kind, defaults["other_modes"])
        for mode, order in ((m, o) for m in modes for o in orders):
            with compiles.counting() as first:  # compile every shape this plan uses
                first_s = _serve(engine, lines, mode, batch_tokens, order)["outer_wall_s"]
            runs = [_serve(engine, lines, mode, batch_tokens, order) for _ in range(args.repeats)]
            walls = [r["wall_s"] for r in runs]
            last, median = runs[-1], float(np.median(walls))
            if reference is None and not args.no_resident:  # the same total tokens, resident prefill, in calls as
                # large as the runner's
                sized = last["score_batch"]["tokens"]
                reference = resident_prefill(engine, lines, sized, args.repeats, top["flops_per_s"])
                print(f"  resident prefill {reference['tokens_per_s']:9.1f} tok/s  ({reference['rows']} rows of "
                      f"{reference['row_tokens']} tokens, {reference['rows_per_call']} a call)", flush=True)
            computed = last["computed_tokens"]  # the runner's metrics count its lm_head FLOPs per read position
            head = last["flops"] - layer_flops_per_token(engine.config) * computed
            flops = matmul_flops(engine.config, computed, head)
            row = dict(workload=kind, kv_cache=mode, order=order, wait=waits(lines, last["done_s"]),
                       policy=last["kv_cache"], seconds=walls, seconds_median=median,
                       outer_seconds=[r["outer_wall_s"] for r in runs], prompt_tokens=last["prompt_tokens"],
                       computed_tokens=last["computed_tokens"], cached_prompt_tokens=last["cached_prompt_tokens"],
                       padded_tokens=last["padded_tokens"], batches=last["batches"],
                       score_batch=last["score_batch"], tokens_per_s=last["prompt_tokens"] / median,
                       flops=flops, mfu=flops["total"] / median / top["flops_per_s"] if top["flops_per_s"] else None,
                       first_run_s=first_s, first_run_compiles=first.as_dict(), sample=last["sample"],
                       memory=dict(**device_memory.peak(), estimate=device_memory.estimate(
                           engine, pool_blocks=last["pool_blocks"], batch_tokens=last["score_batch"]["tokens"],
                           longest=longest)))
            row["prompt_rate_over_resident_prefill"] = (row["tokens_per_s"] / reference["tokens_per_s"]
                                                        if reference else None)
            print(f"  {kind:8s} kv {mode:4s} {order:7s} {row['tokens_per_s']:9.1f} tok/s  median {median:.2f}s  "
                  f"wait of the longest {row['wait']['longest']['mean_s']:.2f}s (max "
                  f"{row['wait']['longest']['max_s']:.2f}s), of all {row['wait']['all']['mean_s']:.2f}s  "
                  f"computed {row['computed_tokens']} of {row['prompt_tokens']} prompt tokens "
                  f"({row['padded_tokens']} slots), {row['cached_prompt_tokens']} from cache, {row['batches']} "
                  f"batches of up to {row['score_batch']['tokens']} tokens"
                  + (f"; {row['prompt_rate_over_resident_prefill']:.2f}x resident prefill" if reference else "")
                  + (f", MFU {row['mfu']:.1%}" if row["mfu"] is not None else "")
                  + f"; first run {first_s:.1f} s, {row['first_run_compiles']['programs']} programs compiled in "
                  f"{row['first_run_compiles']['compile_s']:.1f} s", flush=True)
            results.append(row)
            if partial is not None:
                partial(record(), f"{kind} kv {mode} {order}")
    out = record()
    for k, v in out["ratios"].items():
        print(f"  {k}: {v:.2f}x")
    return out


# MoE-Prefill's context regimes at a size 2 CPU cores serve in about a minute on the tiny preset (launch.bench paper)
REGIMES_ON_CPU = dict(workloads=",".join(REGIMES), requests=24, prefix=128, suffix=16, prefixes=4, long_requests=2,
                      kv_modes="on,off", max_batch_tokens=2048, repeats=1, no_resident=True)


def namespace(**overrides: Any) -> argparse.Namespace:
    """serve()'s arguments: the flags' defaults, `overrides` (by their attribute names) in their place, for callers
    that run the benchmark in-process, e.g. serve(namespace(**REGIMES_ON_CPU), environment)."""
    parser = argparse.ArgumentParser()
    args = vars(add_parser(parser.add_subparsers()).parse_args([]))
    unknown = sorted(set(overrides) - set(args))
    if unknown:
        raise TypeError(f"bench serve: no flag {', '.join(unknown)}")
    return argparse.Namespace(**{**args, **overrides})


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="batch-runner tokens/s: prefix cache on/off, KV-free vs KV, against resident "
                                     "prefill")
    p.add_argument("--model", default="tiny-qwen3-moe")
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--requests", type=int, default=None,
                   help=f"requests per workload (default: GPU {DEFAULTS['gpu']['requests']}, "
                        f"else {DEFAULTS['cpu']['requests']})")
    p.add_argument("--prefix", type=int, default=None,
                   help="prefix tokens (shared in the shared workload; default: GPU "
                        f"{DEFAULTS['gpu']['prefix']}, else {DEFAULTS['cpu']['prefix']})")
    p.add_argument("--suffix", type=int, default=32, help="unique tokens after the prefix")
    p.add_argument("--candidates", type=int, default=4, help="single-token candidates per request")
    p.add_argument("--workloads", default=",".join(WORKLOADS),
                   help="comma-separated: shared, distinct, mixed (prompt lengths spread over 16x, nothing shared), "
                        "and MoE-Prefill's regimes shared-prefix, long-context, multi-select, mix "
                        "(launch/bench/serve_workloads.py)")
    p.add_argument("--prefixes", type=int, default=4, help="shared-prefix: distinct shared prefixes of --prefix tokens")
    p.add_argument("--context", type=int, default=None,
                   help="long-context: prompt tokens (default 4 x (--prefix + --suffix), within the model's positions)")
    p.add_argument("--long-requests", type=int, default=None,
                   help="long-context: requests (default --requests / 16, at least 1; mix takes half)")
    p.add_argument("--choice-tokens", type=int, default=8, help="multi-select: tokens of each candidate")
    p.add_argument("--orders", default="longest",
                   help="comma-separated scoring orders (launch.serve --order) to serve each workload with: longest "
                        "(Θ-batching) and spf (shortest prefill first, PrefillOnly); each row reports the wait of "
                        f"every request and of the longest (a share of {LONGEST_SHARE:g} of them)")
    p.add_argument("--placement", default=None, help="moejax.load's placement (default: auto; streamed: Θ-batching)")
    p.add_argument("--profile", default=None,
                   help="hardware profile Θ comes from (moejax.load's profile=: a datasheet name or a JSON; default "
                        "the devices' own; a CPU has none, so streamed there has no Θ without it)")
    p.add_argument("--kv-modes", default=None,
                   help="comma-separated prefix-cache modes to serve each workload with: on, off, auto (default: "
                        "GPU distinct off,auto and shared auto; else all three)")
    p.add_argument("--max-batch-tokens", type=int, default=None,
                   help="the runner's --max-batch-tokens (default: GPU sized from the device, else "
                        f"{DEFAULTS['cpu']['max_batch_tokens']})")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="measured ceiling for MFU, TFLOP/s (default: the hardware profile's peak)")
    p.add_argument("--measure-peak", action="store_true",
                   help="MFU against the bf16 matmul ceiling measured now (launch/gpu_ceilings.py)")
    p.add_argument("--no-resident", action="store_true",
                   help="skip the resident prefill reference (a second pass over every token)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON file (default bench/results/serve-<device>.json)")
    return p
