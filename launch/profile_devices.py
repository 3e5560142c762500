"""Measure this machine's hardware profile for the planners (moejax/measure/hardware.py says what and how) and write it
as JSON that `moejax.plan.datasheets.load_profile(path)` reads.

  python -m launch.profile_devices [--out FILE] [--model M] [--quick] [--dtype bfloat16] [--grouped-backend auto]
                                  [--dep] [--dep-model M]
  python -m launch.profile ...   (the same command)

--out defaults to ~/.cache/moejax/profiles/<device tag>.json ($XDG_CACHE_HOME respected), where loading a model
looks for a measured profile (moejax.plan.paths.default_profile_path). --model (a preset, an embedded model or a
checkpoint directory) measures at that model's shapes; without it, generic ones. --quick: fewer and smaller sizes
(seconds on a CPU). --dep also micro-benchmarks DEP's four tasks (attention, expert FFN, A2E, E2A) for every split
of the devices present into an attention and an expert group, at a few token counts, on --dep-model (default
--model, else tiny-qwen3-moe), and keeps their least-squares α-β (FinDEP Eq. 7-11, moejax.measure.dep) in the
profile, where FinDEP's solver uses them. Simulated CPU devices: XLA_FLAGS=--xla_force_host_platform_device_count=8."""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import jax

import moejax
from moejax.config import ModelConfig
from moejax.measure.dep import measure_dep
from moejax.measure.hardware import Measurement, Shapes, grouped_backend_refused, measure_profile, sweep_for
from moejax.measure.quick_profile import write_profile
from moejax.models.checkpoint import CheckpointError, read_config
from moejax.plan.findep_costs import predict_point
from moejax.plan.hardware import DepTaskFits, Profile
from moejax.plan.paths import default_profile_path
from moejax.presets import preset_config, resolve_embedded

GROUPED_BACKENDS = ("auto", "xla", "pallas", "ragged_dot", "einsum")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m launch.profile_devices", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None,
                   help="profile JSON to write (default: ~/.cache/moejax/profiles/<device>.json)")
    p.add_argument("--model", default=None, help="preset, embedded model or checkpoint directory whose shapes to "
                                                 "measure (default: generic shapes)")
    p.add_argument("--quick", action="store_true", help="fewer, smaller sizes: a coarse profile in seconds")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="operand dtype of the compute measurements (the engine's default is bfloat16)")
    p.add_argument("--grouped-backend", default="auto", choices=GROUPED_BACKENDS,
                   help="grouped GEMM: a moejax grouped_matmul backend (auto: what the engine runs) or a batched "
                        "einsum over experts; ragged_dot is refused on a GPU (XLA runs it as a dense masked product)")
    p.add_argument("--dep", action="store_true",
                   help="also measure DEP's tasks per (attention, expert) group split and keep their α-β fits")
    p.add_argument("--dep-model", default=None, help="the model DEP's tasks run (default --model, else "
                                                     "tiny-qwen3-moe)")
    return p


def model_shapes(model: str | None, quick: bool) -> Shapes:
    """The Shapes to measure at; ValueError naming the model when it cannot be read."""
    if model is None:
        return Shapes.generic(quick)
    path = resolve_embedded(model)
    try:
        config = read_config(path) if os.path.isdir(path) else preset_config(model)
        return Shapes.of(ModelConfig.from_hf(config), model)
    except (KeyError, CheckpointError, ValueError) as e:
        raise ValueError(f"--model {model}: {e.args[0] if e.args else e}") from None


def check_writable(path: str) -> None:
    """Create the file's folder and write a scratch file beside it, before minutes of measuring; OSError if not."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise IsADirectoryError(f"{path} is a directory")
    existing = folder
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):  # makedirs would say only "File exists"
        raise NotADirectoryError(f"{existing} is a file, not a folder")
    os.makedirs(folder, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=folder, prefix=".profile-", suffix=".tmp"):
        pass


def writable(path: str) -> bool:
    """check_writable, saying on stderr why not."""
    try:
        check_writable(path)
        return True
    except OSError as e:
        reason = e.strerror or (e.args[0] if e.args else str(e))
        print(f"launch.profile_devices: cannot write the profile to {path}: {reason} (choose another --out)",
              file=sys.stderr)
        return False


def report(measurement: Measurement) -> str:
    """The fits' R² and samples and the curves' points, for the reader of stdout (the JSON holds only Profile)."""
    lines = [f"  {role:6s} {p.name}: best {p.flops / 1e9:.1f} GFLOP/s, memory {p.bandwidth / 1e9:.2f} GB/s, launch "
             f"{p.launch_s * 1e6:.1f} us" for role, p in (("device", measurement.profile.device),
                                                        ("host", measurement.profile.host))]
    for name, fit in measurement.fits.items():
        if name == "network":
            continue
        lines.append(f"  {name:15s} alpha {fit.link.alpha_s * 1e6:9.1f} us  bandwidth {fit.link.bandwidth / 1e9:8.2f} "
                     f"GB/s  R2 {fit.r2:.3f}  worst error {fit.worst_error:.0%}"
                     + (f"  [{fit.note}]" if fit.note else ""))
        lines.append(f"  {'':15s} GB/s by bytes  " + ", ".join(f"{n}: {n / t / 1e9:.3g}" for n, t in fit.samples))
    for name, points in measurement.curves.items():
        cells = ", ".join(f"{size:g}: {rate / 1e12:.3g}" for size, _, rate in points)
        lines.append(f"  {name:15s} TFLOP/s by size  {cells}")
    return "\n".join(lines)


def with_dep_fits(profile: Profile, model: str, dtype: str, quick: bool, log: Callable[[str], None]) -> Profile:
    """The profile with DEP's task fits for every split of the devices present (none on one device)."""
    if jax.device_count() < 2:
        log("--dep: one device, no split into an attention and an expert group: nothing measured")
        return profile
    fits = measure_dep(moejax.load, model, dtype=dtype, sequences=(1, 2) if quick else (1, 2, 4),
                       seq_lens=(16, 64) if quick else (32, 128), repeats=2 if quick else 3, log=log)
    splits = ", ".join(f"{f.attn_devices}+{f.expert_devices}" for f in fits)
    note = f"DEP task fits measured on {model} for splits {splits}"
    return dataclasses.replace(profile, dep=fits, notes=(profile.notes + "; " if profile.notes else "") + note)


def dep_report(fit: DepTaskFits) -> str:
    """One split's fits, and how far they are from the points they were fitted to."""
    errors = [abs(predict_point(fit, p) / p[-1] - 1) for p in fit.points if p[-1] > 0]
    return (f"  dep A={fit.attn_devices} B={fit.expert_devices}: attention {fit.alpha_a * 1e6:.1f} us + "
            f"{fit.beta_gm:.3g} s/mkn + {fit.beta_attn:.3g} s/attn-unit; shared {fit.alpha_s * 1e6:.1f} us + "
            f"{fit.beta_s:.3g} s/mkn; experts {fit.alpha_e * 1e6:.1f} us + {fit.beta_e:.3g} s/mkn; A2E/E2A "
            f"{fit.alpha_c * 1e6:.1f} us + {fit.beta_c:.3g} s/B; median error {statistics.median(errors):.0%}, "
            f"worst {max(errors):.0%} over {len(errors)} points")


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    started = time.perf_counter()
    try:
        shapes = model_shapes(args.model, args.quick)
    except ValueError as e:
        print(f"launch.profile_devices: {e}", file=sys.stderr)
        return 2
    if args.out and not writable(args.out):  # before measuring: a bad path fails at once
        return 2

    refused = grouped_backend_refused(args.grouped_backend, jax.local_devices()[0].platform)
    if refused:
        print(f"launch.profile_devices: --grouped-backend {args.grouped_backend}: {refused}", file=sys.stderr)
        return 2
    out = args.out or default_profile_path(jax.local_devices()[0].device_kind)
    if not writable(out):
        return 2
    measurement = measure_profile(shapes, sweep_for(jax.default_backend(), args.quick), dtype=args.dtype,
                                  grouped_backend=args.grouped_backend,
                                  log=lambda msg: print(f"[{time.perf_counter() - started:6.1f} s] {msg}", flush=True))
    profile = measurement.profile
    if args.dep:
        profile = with_dep_fits(profile, args.dep_model or args.model or "tiny-qwen3-moe", args.dtype, args.quick,
                                lambda msg: print(f"[{time.perf_counter() - started:6.1f} s] {msg}", flush=True))
    write_profile(profile, out)
    print(report(measurement))
    for fit in profile.dep:
        print(dep_report(fit))
    print(profile.describe())
    print(f"wrote {out} in {time.perf_counter() - started:.1f} s (measuring {measurement.seconds:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
