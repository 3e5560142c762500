"""Plans without weights or devices: `python -m launch.plan {dep,lightning,theta,layout} --model M --profile P ...`.

  dep        FinDEP's solver (Alg. 1): attention / expert devices, r1, r2, order for `--tokens` in sequences of
             `--seq-len` on `--devices`; with the PPPipe baseline and the default (half/half, r1 = r2 = 1) under the
             same model; `--exhaustive` adds a brute-force search over the same space
  lightning  MoE-Lightning's HRM policy search (N, μ, A_g, F_g, r_w, r_c) for `--prompt-len` / `--gen-len` on
             `--gpus` GPUs
  theta      MoE-Prefill's Θ by Eq. 1 (`--mode streamed | async_ep | two_channel`, `--devices`)
  layout     what layout="auto" would choose on `--devices` for steps of `--tokens`

--model: a preset (see moejax.presets()), the embedded model or a checkpoint directory (only config.json is read).
--profile: a datasheet (h100, h200, a100, l4, t4) or a profile JSON written by `launch.profile_devices`; `--override
FIELD=VALUE` (repeatable) changes any field, dotted into groups (e.g. h2d.bandwidth=100e9, device.flops=5e14).
--json prints one JSON object; --plot DIR writes PNGs (matplotlib: the `plots` extra)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any

import numpy as np

from moejax.config import ModelConfig
from moejax.models.checkpoint import read_config
from moejax.plan import dep_sim
from moejax.plan.datasheets import load_profile
from moejax.plan.findep import DepSchedule, default_plan, pppipe_plan, solve_dep
from moejax.plan.hardware import Profile
from moejax.plan.hrm import plot_roofline
from moejax.plan.layouts import choose_layout
from moejax.plan.lightning import policy_roofline, search_policy
from moejax.plan.plots import gantt, theta_plot
from moejax.plan.theta import layer_time_curve, theta_eq1
from moejax.presets import PRESETS, preset_config, resolve_embedded


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m launch.plan", description=__doc__.split("\n\n")[0])
    p.add_argument("planner", choices=["dep", "lightning", "theta", "layout"])
    p.add_argument("--model", required=True, help="preset, embedded model or checkpoint directory")
    p.add_argument("--profile", required=True,
                   help="h100, h200, a100, l4, t4, or a profile JSON (launch.profile_devices)")
    p.add_argument("--override", action="append", default=[], metavar="FIELD=VALUE",
                   help="change a profile field (dotted: h2d.bandwidth=100e9); repeatable")
    p.add_argument("--tokens", type=int, default=16384, help="tokens per step (dep, layout)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (dep, layout; default min(tokens, "
                                                            "4096))")
    p.add_argument("--devices", type=int, default=8, help="devices (dep, layout, theta async_ep / two_channel)")
    p.add_argument("--exhaustive", action="store_true", help="dep: also a brute-force search over the same space")
    p.add_argument("--gpus", type=int, default=1, help="lightning: GPUs in tensor parallel")
    p.add_argument("--prompt-len", type=int, default=512, help="lightning: prompt tokens")
    p.add_argument("--gen-len", type=int, default=128, help="lightning: generated tokens")
    p.add_argument("--mode", default="streamed", choices=["streamed", "async_ep", "two_channel"], help="theta channel")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", default=None, metavar="DIR", help="write the plan's plots (PNG) into DIR")
    return p


def model_config(model: str) -> ModelConfig:
    path = resolve_embedded(model)
    if os.path.isdir(path):
        return ModelConfig.from_hf(read_config(path))
    if model not in PRESETS:
        raise ValueError(f"--model {model!r} is neither a checkpoint directory nor a preset ({', '.join(PRESETS)})")
    return ModelConfig.from_hf(preset_config(model))


def overrides(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        field, sep, value = item.partition("=")
        if not sep or not field or not value:
            raise ValueError(f"--override {item!r}: expected FIELD=VALUE, e.g. h2d.bandwidth=100e9")
        out[field.strip()] = value.strip()
    return out


def _jsonable(x: object) -> Any:  # JSON values: dicts, lists, scalars
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return _jsonable(dataclasses.asdict(x))
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    return x


def run_dep(cfg: ModelConfig, profile: Profile, args: argparse.Namespace) -> tuple[dict, str, list]:
    seq = args.seq_len or min(args.tokens, 4096)
    kw: dict[str, Any] = dict(devices=args.devices, tokens=args.tokens, seq_len=seq)  # the planners' keywords
    plan = solve_dep(cfg, profile, exhaustive=args.exhaustive, **kw)
    baseline, default = pppipe_plan(cfg, profile, **kw), default_plan(cfg, profile, **kw)
    out = plan.as_dict() | {"layout": plan.layout_spec(), "pppipe": baseline.as_dict(), "default": default.as_dict(),
                            "speedup_vs_pppipe": plan.predicted_tokens_per_s / baseline.predicted_tokens_per_s,
                            "speedup_vs_default": plan.predicted_tokens_per_s / default.predicted_tokens_per_s}
    text = "\n".join([plan.describe(), f"PPPipe baseline: {baseline.describe()}", f"default: {default.describe()}",
                      f"FinDEP / PPPipe {out['speedup_vs_pppipe']:.2f}x, FinDEP / default "
                      f"{out['speedup_vs_default']:.2f}x (predicted)"])
    plots = []
    if args.plot:
        schedules = {f"{p.order.upper()} A={p.attn_devices} B={p.expert_devices} r1={p.r1} r2={p.r2}":
                     dep_sim.simulate_schedule(cfg, profile, p, layers=min(cfg.num_layers, 3))
                     for p in _orders(cfg, profile, plan, baseline, kw)}
        plots.append(gantt(schedules, os.path.join(args.plot, "dep-gantt.png"),
                           f"{args.model} on {args.devices} x {profile.device.name}, {args.tokens} tokens (first 3 "
                           "layers)"))
    return out, text, plots


def _orders(cfg: ModelConfig, profile: Profile, plan: DepSchedule, baseline: DepSchedule, kw: dict[str, Any]
            ) -> list[DepSchedule]:
    """The chosen plan, the same devices under the other order, and PPPipe: the three Gantt panels."""
    other = "aass" if plan.order == "asas" else "asas"
    return [plan, solve_dep(cfg, profile, order=other, attn_devices=plan.attn_devices,
                            expert_devices=plan.expert_devices, **kw), baseline]


def run_lightning(cfg: ModelConfig, profile: Profile, args: argparse.Namespace) -> tuple[dict, str, list]:
    policy = search_policy(cfg, profile, prompt_len=args.prompt_len, gen_len=args.gen_len, gpus=args.gpus)
    plots = []
    if args.plot:
        plots.append(plot_roofline(policy_roofline(cfg, profile, policy), policy,
                                   os.path.join(args.plot, "roofline.png")))
    return policy.as_dict(), policy.describe(), plots


def run_theta(cfg: ModelConfig, profile: Profile, args: argparse.Namespace) -> tuple[dict, str, list]:
    devices = 1 if args.mode == "streamed" else args.devices
    theta = theta_eq1(cfg, profile, mode=args.mode, devices=devices)
    plots = []
    if args.plot:
        flops = list(np.geomspace(theta.theta_flops / 100, theta.theta_flops * 100, 60))
        curve = [(f, *t) for f, t in zip(flops, layer_time_curve(cfg, profile, theta, flops), strict=True)]
        plots.append(theta_plot(curve, theta.theta_flops, os.path.join(args.plot, "theta.png"),
                                f"{args.model}, {args.mode} on {profile.name}: Θ = {theta.theta_flops:.3g} FLOPs"))
    return theta.as_dict(), theta.describe(), plots


def run_layout(cfg: ModelConfig, profile: Profile, args: argparse.Namespace) -> tuple[dict, str, list]:
    choice = choose_layout(cfg, profile, args.devices, args.tokens, args.seq_len or min(args.tokens, 4096))
    out = {"layout": choice.best.spec, "predicted_tokens_per_s": choice.best.tokens_per_s, "solve_ms": choice.solve_ms,
           "options": [dict(spec=o.spec, predicted_tokens_per_s=o.tokens_per_s, why=o.why) for o in choice.options]}
    return out, choice.describe(), []


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        cfg = model_config(args.model)
        profile = load_profile(args.profile, overrides(args.override))
        if args.planner in ("dep", "layout", "lightning") and args.tokens < 1:
            raise ValueError(f"--tokens must be >= 1, got {args.tokens}")
        if args.planner in ("dep", "layout") or (args.planner == "theta" and args.mode != "streamed"):
            profile = dataclasses.replace(profile, gpus=args.devices)
        run = {"dep": run_dep, "lightning": run_lightning, "theta": run_theta, "layout": run_layout}[args.planner]
        out, text, plots = run(cfg, profile, args)
    except (ValueError, OSError, RuntimeError) as e:
        sys.exit(f"launch.plan {args.planner}: {e}")
    out = _jsonable(out) | {"profile": profile.name, "profile_source": profile.source, "plots": plots}
    if args.json:
        print(json.dumps(out))
    else:
        print(profile.describe())
        print(text)
        for path in plots:
            print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
