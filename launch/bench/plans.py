"""`python -m launch.bench plans`: the planners' own run time, and DEP as FinDEP's solver configures it against the
default and the PPPipe baseline, measured on the devices present.

1. Solver time (no devices): FinDEP's Alg. 1 (`moejax.plan.findep.solve_dep`) for 8-64 devices on the h100
   datasheet and three model shapes, with the exhaustive search over the same space beside it (same choice?);
   MoE-Lightning's policy search on S1 (Mixtral 8x7B, t4); the layout planner; Θ by Eq. 1. Median of --solver-repeats.
2. The devices' profile, measured at --model's shapes (`moejax.measure.hardware`; --quick: a coarse sweep) and kept in
   the record (on a GPU: what the planners need from it). With 2 or more devices, three DEP layouts of --model
   run the same batch of --tokens tokens (sequences of --seq):
   FinDEP's choice on that profile, the default (half the devices each, r1 = r2 = 1, ASAS) and PPPipe's best;
   --repeats timed `engine.logits` calls each, interleaved round by round, after a warm-up (compilation); measured
   tokens/s and ratios next to the predicted ones. On simulated CPU devices
   (XLA_FLAGS=--xla_force_host_platform_device_count=8) every "device" shares the same cores, so the groups cannot
   run at once: the measured ratio shows what the choice costs or saves in work (padding, chunking, dispatch), not
   the overlap FinDEP is for; only real devices show that."""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

import moejax
from launch.bench.results import no_file
from moejax.config import ModelConfig
from moejax.measure.hardware import Shapes, measure_profile, sweep_for
from moejax.plan.datasheets import load_profile
from moejax.plan.findep import default_plan, pppipe_plan, solve_dep
from moejax.plan.hardware import Profile
from moejax.plan.layouts import choose_layout
from moejax.plan.lightning import search_policy
from moejax.plan.theta import theta_eq1
from moejax.presets import preset_config

SOLVER_MODELS = ("qwen3-30b-a3b", "deepseek-v2-lite", "mixtral-8x7b")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = sub.add_parser("plans", help="planner run times; DEP as FinDEP chooses vs default vs PPPipe, measured")
    p.add_argument("--model", default="tiny-qwen3-moe", help="preset whose DEP layouts run on the devices present")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per measured step")
    p.add_argument("--seq", type=int, default=256, help="tokens per sequence of the measured step")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=5, help="timed calls per DEP layout")
    p.add_argument("--solver-repeats", type=int, default=20)
    p.add_argument("--profile", default=None, help="a measured profile JSON to plan DEP with (default: measure now)")
    p.add_argument("--quick", action="store_true",
                   help="a coarse profile sweep, and solver times for one model at 8 and 64 devices without the "
                        "exhaustive search (the GPU check's dry run)")
    p.add_argument("--out", default=None, help="JSON file (default bench/results/plans-<device>.json)")
    return p


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return float(np.median(times))


def solver_times(repeats: int, quick: bool) -> dict:
    h100 = load_profile("h100")
    out: dict = {"findep": [], "lightning": None, "layout": None, "theta_ms": None}
    for name in SOLVER_MODELS[:1] if quick else SOLVER_MODELS:
        cfg = ModelConfig.from_hf(preset_config(name))
        for devices in (8, 64) if quick else (8, 16, 32, 64):
            kw: dict[str, Any] = dict(devices=devices, tokens=16384, seq_len=2048)  # solve_dep's keywords
            plan = solve_dep(cfg, h100, exhaustive=not quick, **kw)
            ms = _median_ms(lambda: solve_dep(cfg, h100, **kw), repeats)  # noqa: B023 (timed here)
            ex_ms, same = None, None
            if not quick:
                ex_ms = _median_ms(lambda: solve_dep(cfg, h100, exhaustive=True, **kw), max(1, repeats // 10))  # noqa: B023 (timed here)
                ex = plan.as_dict()["exhaustive"]
                same = all(ex[k] == getattr(plan, k) for k in ("attn_devices", "expert_devices", "r1", "r2", "order"))
            out["findep"].append(dict(model=name, devices=devices, solve_ms=ms, with_exhaustive_ms=ex_ms,
                                      same_as_exhaustive=same, choice=plan.layout_spec(),
                                      predicted_tokens_per_s=plan.predicted_tokens_per_s))
            print(f"  findep {name:16s} {devices:2d} devices: {ms:6.2f} ms"
                  + ("" if quick else f" (with exhaustive {ex_ms:7.1f} ms, same choice: {same})")
                  + f" -> {plan.layout_spec()}", flush=True)
    mixtral = ModelConfig.from_hf(preset_config("mixtral-8x7b"))
    t4 = load_profile("t4")
    policy = search_policy(mixtral, t4, prompt_len=418, gen_len=128)
    out["lightning"] = dict(solve_ms=_median_ms(lambda: search_policy(mixtral, t4, prompt_len=418, gen_len=128),
                                                max(1, repeats // 4)),
                            N=policy.N, mu=policy.mu, A_g=policy.A_g, F_g=policy.F_g, r_w=policy.r_w, r_c=policy.r_c)
    qwen3 = ModelConfig.from_hf(preset_config("qwen3-30b-a3b"))
    out["layout"] = dict(devices=8, solve_ms=_median_ms(lambda: choose_layout(qwen3, h100, 8, 16384, 2048), repeats))
    out["theta_ms"] = _median_ms(lambda: theta_eq1(mixtral, h100), repeats)
    print(f"  lightning S1: {out['lightning']['solve_ms']:.0f} ms (N={policy.N}, mu={policy.mu}); layout planner "
          f"{out['layout']['solve_ms']:.1f} ms; theta {out['theta_ms']:.3f} ms", flush=True)
    return out


def measured_profile(cfg: ModelConfig, args: argparse.Namespace) -> tuple[Profile, float]:
    """The devices' profile at the model's shapes (or --profile's), and the seconds measuring took."""
    if args.profile:
        return load_profile(args.profile), 0.0
    sweep = sweep_for(jax.devices()[0].platform, quick=args.quick)
    m = measure_profile(Shapes.of(cfg, args.model), sweep, dtype=args.dtype)
    return m.profile, m.seconds


def dep_runs(args: argparse.Namespace, cfg: ModelConfig, profile: Profile) -> dict:
    devices = jax.device_count()
    kw: dict[str, Any] = dict(devices=devices, tokens=args.tokens, seq_len=args.seq)
    plans = {"findep": solve_dep(cfg, profile, **kw),
             "default": default_plan(cfg, profile, **kw),
             "pppipe": pppipe_plan(cfg, profile, **kw)}
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (args.tokens // args.seq, args.seq))
    engines = {}
    for name, plan in plans.items():
        engines[name] = moejax.load(args.model, dtype=args.dtype, compilation_cache=False, layout=plan.layout_spec())
        engines[name].logits(ids)  # compile
    seconds: dict[str, list[float]] = {name: [] for name in plans}
    for _ in range(args.repeats):  # interleaved: a slow stretch of the machine hits every layout alike
        for name, engine in engines.items():
            start = time.perf_counter()
            engine.logits(ids)
            seconds[name].append(time.perf_counter() - start)
    results: list[dict[str, Any]] = []  # JSON rows
    for name, plan in plans.items():
        median = float(np.median(seconds[name]))
        results.append(dict(name=name, layout=plan.layout_spec(), seconds=seconds[name], seconds_median=median,
                            tokens_per_s=ids.size / median, predicted_tokens_per_s=plan.predicted_tokens_per_s))
        print(f"  {name:8s} {plan.layout_spec():80s} {ids.size / median:9.1f} tok/s measured, "
              f"{plan.predicted_tokens_per_s:12.1f} predicted", flush=True)
    rate = {r["name"]: r["tokens_per_s"] for r in results}
    predicted = {r["name"]: r["predicted_tokens_per_s"] for r in results}
    ratios = {f"findep / {o}": dict(measured=rate["findep"] / rate[o], predicted=predicted["findep"] / predicted[o])
              for o in ("default", "pppipe")}
    for k, v in ratios.items():
        print(f"  {k}: measured {v['measured']:.2f}x, predicted {v['predicted']:.2f}x")
    return dict(results=results, ratios=ratios)


def plans(args: argparse.Namespace, environment: dict, partial: Callable[[dict, str], None] = no_file) -> dict:
    print("solver run times (h100 datasheet, 16384 tokens in sequences of 2048):", flush=True)
    record = dict(**environment, benchmark="plans", solvers=solver_times(args.solver_repeats, args.quick),
                  config=dict(model=args.model, tokens=args.tokens, seq=args.seq, dtype=args.dtype,
                              repeats=args.repeats, quick=args.quick))
    partial(record, "solver run times")
    cfg = ModelConfig.from_hf(preset_config(args.model))
    profile, seconds = measured_profile(cfg, args)
    record.update(profile=profile.as_dict(), profile_seconds=seconds)
    partial(record, "profile")
    print(profile.describe(), f"(measured in {seconds:.0f} s)" if seconds else "", flush=True)
    if jax.device_count() >= 2:
        print(f"DEP on {jax.device_count()} x {jax.devices()[0].device_kind}, {args.model}, {args.tokens} tokens:",
              flush=True)
        record["dep"] = dep_runs(args, cfg, profile)
    else:
        record["dep"] = None
        print("DEP runs skipped: one device (simulate 8 with XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    return record
