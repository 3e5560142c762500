"""`python -m launch.bench offload`: expert offloading on one device, measured against the resident model.

- h2d: pinned-host -> device bandwidth of one large `jax.device_put` (the source already in pinned_host memory,
  `block_until_ready`, median of repeats): the peak the other sections are compared with.
- prefill: a resident and a streamed engine of the same preset and seed (and a streamed one with stream='jit',
  where XLA schedules the copies inside the whole-model jit: the alternative to compare on a GPU). The streamed
  one's saturation threshold Θ is profiled (moejax.measure.saturation), then both run the same batches from Θ/4
  to 4Θ tokens (each rounded to a power of two, at least 16, so no batch is padded; rows of at most --seq tokens):
  throughput of streamed vs resident, routed-expert bytes moved per pass and the H2D rate that implies
  (bytes / streamed seconds).
  The timed call is `engine.logits` (all positions, logits copied back to the host) on CPU; on a GPU it is a
  prefill through `engine.generate(rows, 1)` (KV cache, head on the last position only), since the full logits
  of the larger batches (tokens x vocab x 4 bytes) outgrow the device and their copy back would dominate;
  --call picks either.
- decode: batch-1 greedy decode with the cached placement in each of --modes (launch/bench/offload_modes.py): on
  demand (no predictor: LRU-only with --eviction lru), exact prefetch and speculative execution with the router
  predictor, prefetch with the distilled estimator, with fMoE's expert maps (T+S+δ) and its ablations
  (expert_map-T+S, expert_map-T), MoE-Infinity's request-level activation matrices (moe_infinity, fMoE's
  baseline), all calibrated on the resident engine, and the resident model. Time to first
  token is the median of generate(prompt, 1); time per output token is the slope between two lengths; counters
  are `engine.stats()` of the decode loop alone, per output token (see DECODE_METHOD). The analytic bound of what
  overlapping copies with compute can save is min(compute, copy) / (compute + copy), with compute the resident
  TPOT and copy the on-demand bytes per token over the h2d peak.
  With --placements, the decode section instead runs every decode placement side by side at one device budget on
  the same requests (launch/bench/decode_placements.py: resident, streamed, cached LRU, the look-ahead oracle,
  lightning, the predictors; batch 1, 64, 256 and a 4K-token prompt; MoE-Lightning's claim).

Each timed case runs once to warm up (compilation), then --repeats timed runs; medians are reported. Nothing is
asserted: the record states targets next to the measurements.
"""
from __future__ import annotations

import argparse
import gc
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

import moejax
from launch.bench import decode_placements as bench_decode_placements
from launch.bench import expert_map_plots, offload_modes
from launch.bench.fmoe_sweeps import fmoe
from launch.bench.results import no_file
from launch.bench.util import time_calls, timed_call
from moejax.buckets import bucket
from moejax.costs import layer_flops_per_token
from moejax.engine import Engine
from moejax.kernels.platform import on_gpu
from moejax.measure.saturation import profile_saturation
from moejax.offload.cached import CachedExpertsRuntime
from moejax.offload.predict.activation_matrices import ActivationMatrixPredictor
from moejax.offload.predict.expert_maps import ExpertMapPredictor
from moejax.offload.saturation import Saturation
from moejax.offload.tpot_bound import TpotBound
from moejax.placements import Cached

GPU_MODEL, CPU_MODEL = "qwen3-30b-a3b", "tiny-qwen3-moe"
THETA_MULTIPLES = (0.25, 0.5, 1, 2, 4)
DECODE_METHOD = ("TTFT = median s of generate(prompt, 1), the expert cache as the previous call left it. "
                 "TPOT = (median s of generate(prompt, 1 + n_long) - "
                 "median s of generate(prompt, 1 + n_short)) "
                 "/ (n_long - n_short), n_short = new_tokens // 2, n_long = new_tokens: both runs include the "
                 "prefill and the decode loop's setup, which cancel. Cached modes: counters of one more "
                 "generate(prompt, 1 + n_long) reset when its decode loop starts (a wrapper around "
                 "engine.layered_steps.decode), divided by its n_long decode steps; decode_loop_s_per_token is "
                 "that loop's wall time per step, a cross-check of the slope")
NOTE = ("On CPU the pinned_host and device memories are the same RAM and a 'copy' is a memcpy, so the CPU "
        "ratios (streamed/resident, achieved/peak H2D, bound reached) say nothing about a GPU.")
TARGETS = dict(prefill_throughput_ratio_above_theta=0.9, prefill_h2d_fraction_below_theta=0.8)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = sub.add_parser("offload", help="H2D bandwidth; streamed vs resident prefill around Θ; cached decode TPOT")
    p.add_argument("--model", default=None, help=f"preset (default GPU {GPU_MODEL}, CPU {CPU_MODEL})")
    p.add_argument("--num-layers", type=int, default=None, help="first N layers (default GPU 8, CPU all)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="default: GPU bf16, CPU f32")
    p.add_argument("--seq", type=int, default=None, help="prefill row length at most (power of two; GPU 4096, "
                                                         "CPU 512)")
    p.add_argument("--tokens", default=None, help="prefill token counts (default Θ/4..4Θ from the profile)")
    p.add_argument("--max-tokens", type=int, default=None, help="drop prefill sizes above this")
    p.add_argument("--profile-tokens", type=int, default=None, help="Θ profile batch (GPU 4096, CPU 512)")
    p.add_argument("--call", default=None, choices=["logits", "prefill"],
                   help="prefill timed through engine.logits or engine.generate(rows, 1) (default CPU logits, "
                        "GPU prefill)")
    p.add_argument("--window", type=int, default=1, help="streamed: MoE layers copied ahead")
    p.add_argument("--cache-slots", type=int, default=None,
                   help="cached decode: expert slots (default half the experts of all layers, at least 2 top-k)")
    p.add_argument("--eviction", default="lru", choices=["lru", "lfu", "priority"])
    p.add_argument("--sections", default="prefill,decode",
                   help="what to measure besides h2d: prefill, decode, fmoe (launch/bench/fmoe_sweeps.py)")
    p.add_argument("--modes", default=offload_modes.DEFAULT_MODES,
                   help=f"cached decode modes (on-demand always runs): {', '.join(offload_modes.MODES)}")
    p.add_argument("--prompts", default="random", choices=["random", "stdlib"],
                   help="decode and calibration prompts: random ids, or stdlib text (held-out split for the decode "
                        "prompt, train split for calibration; needs the model's tokenizer)")
    p.add_argument("--calibration-prompts", type=int, default=None, help="default 8 (quick 2); one map each")
    p.add_argument("--calibration-tokens", type=int, default=None, help="tokens each (default 256, quick 64)")
    p.add_argument("--distill-steps", type=int, default=300, help="estimator mode: distillation steps")
    p.add_argument("--capacity", type=int, default=1024, help="expert_map modes: store capacity")
    p.add_argument("--fmoe-slots", default=None, help="fmoe section: cache sizes (default 1/8..6/8 of the experts)")
    p.add_argument("--fmoe-distances", default="1,2,3", help="fmoe section: prefetch distances (< MoE layers)")
    p.add_argument("--fmoe-capacity", type=int, default=4, help="fmoe section: online stores' capacity (small: "
                   "maps are replaced while serving)")
    p.add_argument("--new-tokens", type=int, default=None, help="decode tokens (default 64; quick 8)")
    p.add_argument("--prompt-len", type=int, default=None, help="decode prompt tokens (default 64; --placements 512, "
                                                                "quick 32)")
    p.add_argument("--temperature", type=float, default=0.0, help="decode sampling temperature (0: greedy)")
    p.add_argument("--h2d-mib", type=int, default=None, help="H2D copy size in MiB (GPU 1024, CPU 64)")
    p.add_argument("--repeats", type=int, default=None, help="timed calls per case (GPU 5, CPU 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="smallest sizes: a smoke run")
    p.add_argument("--plot", default=None, help="PNG of each decode mode's TTFT, TPOT and hit rate (needs "
                                                "matplotlib)")
    p.add_argument("--out", default=None, help="JSON file (default bench/results/offload-<device>.json)")
    bench_decode_placements.add_arguments(p)
    return p


def _defaults(args: argparse.Namespace, gpu: bool) -> argparse.Namespace:
    args.model = args.model or (GPU_MODEL if gpu else CPU_MODEL)
    args.dtype = args.dtype or ("bfloat16" if gpu else "float32")
    args.call = args.call or ("prefill" if gpu else "logits")
    args.repeats = args.repeats or (1 if args.quick else 5 if gpu else 3)
    args.seq = bucket(args.seq or (4096 if gpu else 512))
    args.profile_tokens = args.profile_tokens or (64 if args.quick else 4096 if gpu else 512)
    args.new_tokens = args.new_tokens or (8 if args.quick else 64)
    args.h2d_mib = args.h2d_mib or (16 if args.quick else 1024 if gpu else 64)
    if args.prompt_len is None:
        args.prompt_len = (32 if args.quick else 512) if args.placements else 64
    if args.placements:
        bench_decode_placements.check_arguments(args)  # a typo fails before any work
    if args.num_layers is None and gpu:
        args.num_layers = 8
    if args.quick and args.tokens is None:
        args.tokens = "16,64"
    if args.new_tokens < 2:
        raise ValueError("--new-tokens must be >= 2 (TPOT is a slope between two lengths)")
    return args


def _load(args: argparse.Namespace, **options: Any) -> Engine:
    return moejax.load(args.model, dtype=args.dtype, num_layers=args.num_layers, seed=args.seed,
                       compilation_cache=False, **options)


def _median(fn: Callable[[], object], repeats: int) -> tuple[float, dict]:
    first, runs, other = time_calls(fn, repeats)
    return float(np.median(runs)), dict(seconds=runs, first_call_s=first, other_processes_cpu_share=other)


# -- h2d ---------------------------------------------------------------------------------------------------------
def h2d(args: argparse.Namespace) -> dict:
    device = jax.devices()[0]
    n = args.h2d_mib << 20
    host = jax.device_put(np.arange(n // 4, dtype=np.uint32),
                          jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host"))
    target = jax.sharding.SingleDeviceSharding(device, memory_kind="device")
    sec, timing = _median(lambda: jax.block_until_ready(jax.device_put(host, target)), max(args.repeats, 10))
    row = dict(bytes=n, seconds_median=sec, gb_per_s=n / sec / 1e9, source_memory_kind="pinned_host",
               **timing)
    print(f"h2d: {n / 2**20:.0f} MiB pinned_host -> device in {sec * 1e3:.2f} ms = {row['gb_per_s']:.2f} GB/s "
          f"(median of {len(timing['seconds'])})", flush=True)
    return row


# -- prefill -----------------------------------------------------------------------------------------------------
def _sizes(args: argparse.Namespace, theta_tokens: int) -> list[int]:
    if args.tokens:
        sizes = [int(v) for v in args.tokens.split(",")]
    else:  # nearest power of two (a multiple of 16): no row or batch padding
        sizes = [max(16, 1 << int(round(np.log2(max(m * theta_tokens, 1))))) for m in THETA_MULTIPLES]
    if args.max_tokens:
        sizes = [s for s in sizes if s <= args.max_tokens]
    return sorted(set(sizes))


def _rows(tokens: int, seq: int) -> tuple[int, int]:
    T = min(seq, tokens)
    return max(1, tokens // T), T


def _saturation_record(sat: Saturation) -> dict:
    return dict(theta_flops=sat.theta_flops, theta_tokens=sat.theta_tokens, ref_tokens=sat.ref_tokens,
                ref_flops=sat.ref_flops, t0_s=sat.t0_s, epsilon=sat.epsilon, compute_s=sat.compute_s,
                streamed_s=sat.streamed_s)


def prefill(args: argparse.Namespace, peak_gb_per_s: float, resident: Engine, save: Callable[[dict, str], None]
            ) -> dict:
    """save(the section so far, row) after each measured row."""
    streamed = _load(args, placement="streamed", window=args.window)
    in_jit = _load(args, placement="streamed", stream="jit")  # the alternative: XLA schedules the copies
    t0 = time.perf_counter()
    sat = profile_saturation(streamed, tokens=args.profile_tokens)
    print(streamed.explain(), flush=True)
    print(f"  (profiled in {time.perf_counter() - t0:.1f}s)", flush=True)
    store = streamed.store
    per_pass = store.total_bytes()
    rng = np.random.default_rng(args.seed + 2)
    rows = []
    print(f"  {'tokens':>7s} {'B x T':>10s} {'/Θ':>5s} {'resident':>11s} {'streamed':>11s} {'str/res':>7s} "
          f"{'MiB/pass':>9s} {'H2D GB/s':>8s} {'/peak':>6s} {'wait/pass':>10s} {'in-jit':>11s} {'jit/res':>7s}",
          flush=True)
    for tokens in _sizes(args, sat.theta_tokens):
        B, T = _rows(tokens, args.seq)
        ids = rng.integers(0, resident.config.vocab_size, (B, T))
        res_s, res_t = _median(timed_call(resident, args.call, ids), args.repeats)
        streamed.reset_stats()
        str_s, str_t = _median(timed_call(streamed, args.call, ids), args.repeats)
        jit_s, jit_t = _median(timed_call(in_jit, args.call, ids), args.repeats)
        stats, passes = streamed.stats()["total"], 1 + args.repeats
        gbps = per_pass / str_s / 1e9
        row = dict(tokens=B * T, batch=B, seq=T, padded_tokens=bucket(B) * bucket(T, 16),
                   tokens_over_theta=B * T / sat.theta_tokens,
                   regime="transfer-bound" if B * T < sat.theta_tokens else "compute-bound",
                   resident_s=res_s, streamed_s=str_s, resident_tokens_per_s=B * T / res_s,
                   streamed_tokens_per_s=B * T / str_s, throughput_ratio=res_s / str_s,
                   bytes_per_pass=per_pass, measured_bytes_per_pass=stats["bytes_h2d"] / passes,
                   wait_s_per_pass=stats["wait_s"] / passes, h2d_gb_per_s=gbps,
                   h2d_fraction_of_peak=gbps / peak_gb_per_s, in_jit_s=jit_s, in_jit_throughput_ratio=res_s / jit_s,
                   in_jit_h2d_gb_per_s=per_pass / jit_s / 1e9,
                   resident_timing=res_t, streamed_timing=str_t, in_jit_timing=jit_t)
        rows.append(row)
        save(dict(saturation=_saturation_record(sat), rows=rows), f"prefill {B * T} tokens")
        print(f"  {B * T:7d} {f'{B} x {T}':>10s} {row['tokens_over_theta']:5.2f} {res_s * 1e3:9.2f}ms "
              f"{str_s * 1e3:9.2f}ms {row['throughput_ratio']:7.3f} {per_pass / 2**20:9.1f} {gbps:8.2f} "
              f"{row['h2d_fraction_of_peak']:6.3f} {row['wait_s_per_pass'] * 1e3:8.2f}ms {jit_s * 1e3:9.2f}ms "
              f"{row['in_jit_throughput_ratio']:7.3f}", flush=True)
    cfg = streamed.config
    record = dict(window=args.window, call=args.call, max_row_tokens=args.seq, profile_tokens=args.profile_tokens,
                  layer_flops_per_token=layer_flops_per_token(cfg),
                  moe_layers=len(store.layers),
                  expert_bytes_per_layer={i: store.layer_bytes(i) for i in store.layers},
                  saturation=_saturation_record(sat), memory_budget=streamed.memory_budget.describe(),
                  throughput_ratio="resident_s / streamed_s (streamed throughput over resident)",
                  in_jit="stream='jit': the experts are host-memory inputs of the whole-model jit and XLA "
                         "schedules their copies (no window); in_jit_throughput_ratio = resident_s / in_jit_s",
                  h2d_gb_per_s="bytes_per_pass (routed experts of all MoE layers) / streamed_s", rows=rows)
    del streamed, in_jit, store
    gc.collect()
    return record


# -- decode ------------------------------------------------------------------------------------------------------
def _counters(stats: dict, tokens: int, top_k: int) -> dict:
    """engine.stats() of a decode loop -> totals per output token and hit rates (overall, per MoE layer)."""
    total = stats["total"]
    fields = ("hits", "misses", "prefetches", "bytes_h2d", "wait_s", "speculated_tokens", "mispredicted_tokens")
    rate = lambda s: s["hits"] / (s["hits"] + s["misses"]) if s["hits"] + s["misses"] else None  # noqa: E731
    out = dict(per_token={f: total[f] / tokens for f in fields}, hit_rate=rate(total),
               layer_hit_rates={layer: rate(s) for layer, s in stats["layers"].items()},
               totals=total, layers=stats["layers"])
    if total["checked_tokens"]:  # speculated tokens checked against the true router
        out["mispredicted_fraction"] = total["mispredicted_tokens"] / total["checked_tokens"]
        # top-k choices: the fraction of predicted (token, expert) pairs the true router did not make
        choices = total["checked_tokens"] * top_k
        out["mispredicted_choice_fraction"] = total["mispredicted_choices"] / choices if choices else None
    return out


def decode_loop(engine: Engine, prompt: list[int], n: int, temperature: float, seed: int,
                clock: Callable[[], float] = time.perf_counter) -> dict:
    """One generate(prompt, n) of a cached engine with its counters reset when the decode loop starts (after
    the prefill), read when it ends: (tokens, decode-loop seconds by `clock`, engine.stats() of the loop alone)."""
    steps = engine.layered_steps
    seen: dict[str, Any] = {}
    original = steps.decode

    def decode(*args: Any, **kwargs: Any) -> tuple[jax.Array, jax.Array]:
        engine.reset_stats()
        t0 = clock()
        out = jax.block_until_ready(original(*args, **kwargs))
        seen.update(seconds=clock() - t0, stats=engine.stats())
        return out
    steps.decode = decode  # type: ignore[method-assign]  # this instance's decode, timed, until the del below
    try:
        seen["tokens"] = engine.generate([prompt], n, temperature=temperature, seed=seed)[0]
    finally:
        del steps.decode
        engine.reset_stats()
    return seen


def _decode_case(name: str, engine: Engine, prompt: list[int], args: argparse.Namespace,
                 reference: list[int] | None = None) -> dict:
    short, long = 1 + args.new_tokens // 2, 1 + args.new_tokens
    out: dict[int, list[int]] = {}
    times: dict[int, dict] = {}
    ttft, ttft_timing = _median(lambda: engine.generate([prompt], 1, temperature=args.temperature, seed=args.seed),
                                args.repeats)
    for n in (short, long):
        run = lambda: out.__setitem__(n, engine.generate([prompt], n, temperature=args.temperature,  # noqa: E731, B023 (timed here)
                                                         seed=args.seed)[0])
        sec, timing = _median(run, args.repeats)
        times[n] = dict(seconds_median=sec, **timing)
    tpot = (times[long]["seconds_median"] - times[short]["seconds_median"]) / (long - short)
    tokens = out[long]
    row = dict(mode=name, ttft_s=ttft, tpot_s=tpot, ttft_timing=ttft_timing,
               lengths={n: times[n] for n in (short, long)}, tokens=tokens, distinct_tokens=len(set(tokens)))
    if reference is not None:
        row["tokens_equal_resident"] = sum(a == b for a, b in zip(tokens, reference, strict=True)) / len(reference)
    if isinstance(engine.placement, Cached):
        loop = decode_loop(engine, prompt, long, args.temperature, args.seed)  # one more, untimed run
        steps_run = len(loop["tokens"]) - 1  # the first token comes from the prefill
        row.update(placement=engine.layered_steps.placement.describe(), decode_loop_s_per_token=loop["seconds"] /
                   steps_run, stats=_counters(loop["stats"], steps_run, engine.config.num_experts_per_tok))
    s = row.get("stats")
    extra = "" if s is None else (
        f"  hit rate {s['hit_rate']:.3f}  {s['per_token']['bytes_h2d'] / 2**20:7.3f} MiB/token  "
        f"wait {s['per_token']['wait_s'] * 1e3:6.3f} ms/token"
        + (f"  mispredicted tokens {s['mispredicted_fraction']:.3f}, choices "
           f"{s['mispredicted_choice_fraction']:.3f}" if "mispredicted_fraction" in s else ""))
    match = f"  same tokens {row['tokens_equal_resident']:.2f}" if "tokens_equal_resident" in row else ""
    print(f"  {name:14s} TTFT {ttft * 1e3:8.3f} ms  TPOT {tpot * 1e3:8.3f} ms{extra}{match}  "
          f"({row['distinct_tokens']} distinct tokens)", flush=True)
    return row


def decode(args: argparse.Namespace, peak_gb_per_s: float, resident: Engine, save: Callable[[dict, str], None]
           ) -> dict:
    """save(the section so far, row) after each measured row."""
    cfg = resident.config
    moe_layers = sum(cfg.is_moe(i) for i in range(cfg.num_layers))
    k = cfg.num_experts_per_tok
    slots = args.cache_slots or max(2 * k, cfg.num_experts * moe_layers // 2)
    modes = offload_modes.parse_modes(args.modes)
    rng = np.random.default_rng(args.seed + 1)
    if args.prompts == "stdlib":
        prompt = offload_modes.stdlib_prompts(resident, "held_out", 1, args.prompt_len, rng)[0]
    else:
        prompt = rng.integers(0, cfg.vocab_size, args.prompt_len).tolist()
    n_cal = args.calibration_prompts or (2 if args.quick else 8)
    len_cal = args.calibration_tokens or (64 if args.quick else 256)
    cal_prompts, source = offload_modes.calibration_prompts(resident, args.prompts, n_cal, len_cal, args.seed + 3)
    how = "greedy" if args.temperature == 0 else f"temperature {args.temperature}"
    print(f"decode: batch 1 {how}, prompt {args.prompt_len} tokens ({args.prompts}), {args.new_tokens} new; cached "
          f"placement, {slots} slots of {cfg.num_experts} x {moe_layers} experts, eviction {args.eviction}; modes "
          f"{', '.join(modes)}", flush=True)
    rows = [_decode_case("resident", resident, prompt, args)]
    save(dict(rows=rows), "decode resident")
    reference = rows[0]["tokens"]
    with tempfile.TemporaryDirectory(prefix="moejax-bench-vectors-") as tmp:
        calibration = offload_modes.build(resident, cal_prompts, modes, tmp, distill_steps=args.distill_steps,
                                          capacity=args.capacity, log=lambda msg: print(f"  {msg}", flush=True))
        print(f"  calibration: {calibration.record}", flush=True)
        for name in modes:
            options = offload_modes.engine_options(name, calibration)
            engine = _load(args, placement="cached", cache_slots=slots, eviction=args.eviction, **options)
            rows.append(_decode_case(name, engine, prompt, args, reference))
            if name.startswith("expert_map"):
                runtime = engine.layered_steps.placement
                assert isinstance(runtime, CachedExpertsRuntime), "placement cached"
                assert isinstance(runtime.predictor, ExpertMapPredictor), "expert-map modes predict by maps"
                rows[-1]["store"] = offload_modes.store_size(runtime.predictor.store)
            if name.startswith("moe_infinity"):
                runtime = engine.layered_steps.placement
                assert isinstance(runtime, CachedExpertsRuntime), "placement cached"
                assert isinstance(runtime.predictor, ActivationMatrixPredictor), "moe_infinity modes"
                rows[-1]["activation_matrices"] = len(runtime.predictor.collection)
            save(dict(rows=rows), f"decode {name}")
            del engine
            gc.collect()
    by = {r["mode"]: r for r in rows}
    compute = by["resident"]["tpot_s"]
    copy = by["on-demand"]["stats"]["per_token"]["bytes_h2d"] / (peak_gb_per_s * 1e9)
    eq1 = TpotBound("cached", compute, copy, by["on-demand"]["stats"]["per_token"]["misses"])  # Eq. 1
    bound = eq1.saving_s / eq1.on_demand_s if compute > 0 and copy > 0 else None  # None: a slope <= 0
    analytic = dict(compute_s=compute, copy_s=copy, bound=bound,
                    formula="bound = min(compute, copy) / (compute + copy); compute = resident TPOT, copy = "
                            "on-demand bytes_h2d per token / h2d peak; reached = (1 - TPOT_mode / "
                            "TPOT_on-demand) / bound")
    ondemand = by["on-demand"]["tpot_s"]
    for name in modes[1:]:
        saved = 1 - by[name]["tpot_s"] / ondemand
        analytic[f"saved_{name}"] = saved
        analytic[f"reached_{name}"] = saved / bound if bound else None
    print(f"  bound: compute {compute * 1e3:.3f} ms, copy {copy * 1e3:.3f} ms -> overlap saves at most "
          f"{_fmt(bound)} of on-demand time; " + ", ".join(
              f"{name} saved {analytic[f'saved_{name}']:.3f} (reached {_fmt(analytic[f'reached_{name}'])})"
              for name in modes[1:]), flush=True)
    return dict(batch=1, prompt_len=args.prompt_len, new_tokens=args.new_tokens, temperature=args.temperature,
                method=DECODE_METHOD, modes=modes, mode_note=offload_modes.__doc__,
                cache_slots=slots, eviction=args.eviction, prefetch_distance=1, prompts=args.prompts,
                calibration=dict(calibration.record, tokens_each=len_cal, source=f"{source} through the resident "
                                 "engine", expert_maps_update=False),
                analytic=analytic, rows=rows)


def _fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.3f}"


def offload(args: argparse.Namespace, env: dict, partial: Callable[[dict, str], None] = no_file) -> dict:
    gpu = on_gpu()
    _defaults(args, gpu)
    t0 = time.perf_counter()
    print(f"offload: {args.model} ({args.num_layers or 'all'} layers, {args.dtype}), repeats {args.repeats}",
          flush=True)
    peak = h2d(args)
    resident = _load(args, placement="resident")
    cfg = resident.config
    record = dict(**env, benchmark="offload", note=NOTE, targets=TARGETS,
                  config=dict(model=args.model, model_type=cfg.model_type, num_layers=cfg.num_layers,
                              num_experts=cfg.num_experts, experts_per_token=cfg.num_experts_per_tok,
                              hidden_size=cfg.hidden_size, moe_intermediate_size=cfg.moe_intermediate_size,
                              dtype=args.dtype, seed=args.seed, repeats=args.repeats, quick=args.quick),
                  timing="host clock around block_until_ready / host results, median after a warm-up call",
                  wall_s=None, h2d=peak, prefill=None, decode=None)

    def saver(section: str) -> Callable[[dict, str], None]:
        def save(part: dict, last: str) -> None:
            record[section] = part
            partial(dict(record, wall_s=time.perf_counter() - t0), last)
        return save
    partial(record, "h2d")
    sections = {x.strip() for x in args.sections.split(",") if x.strip()}
    known = {"prefill", "decode", "fmoe"}
    if sections - known:
        raise ValueError(f"--sections: unknown {', '.join(sorted(sections - known))} ({', '.join(sorted(known))})")
    if "prefill" in sections:
        record["prefill"] = prefill(args, peak["gb_per_s"], resident, saver("prefill"))
    if "decode" in sections and args.placements:
        record["decode"] = bench_decode_placements.run(args, resident, gpu, saver("decode"),
                                                       lambda **options: _load(args, **options))
    elif "decode" in sections:
        record["decode"] = decode(args, peak["gb_per_s"], resident, saver("decode"))
        if args.plot:
            expert_map_plots.decode(record["decode"], args.plot)
            record["plot"] = args.plot
    if "fmoe" in sections:
        record["fmoe"] = fmoe(args, resident, saver("fmoe"), load=_load, decode_case=_decode_case)
    if not gpu:
        print(f"(note: {NOTE})")
    return dict(record, wall_s=time.perf_counter() - t0)
