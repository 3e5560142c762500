"""`python -m launch.bench paper NAME`: the benchmarks that stand in for one paper's tables and figures, each run as
its own `python -m launch.bench ...` process at sizes that fit a 2-core CPU (or, with --gpu, the GPU sizes where
they exist), one JSON and one plot per figure. Each figure's record says which of the paper's numbers it
corresponds to and what differs (model, device, scale); the summary record lists the figures with their seconds.

Figures are written to `RESULTS/paper/NAME/FIGURE-DEVICE.json` (RESULTS: --results, bench/results by default; each
run appended, as every benchmark's results file) and `FIGURE-DEVICE.png` (drawn from the run just made); the summary
to `RESULTS/paper-NAME-DEVICE.json`. Each benchmark writes its own record into a scratch directory first, so a
figure that fails or runs out of time leaves the results already there as they were."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

from launch.bench.paper_figures import PAPERS, Figure
from launch.bench.paper_plots import draw
from launch.bench.provenance import device_tag
from launch.bench.results import ResultsFile, read_runs

BUDGET_S = 600  # each paper's set on 2 CPU cores


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = sub.add_parser("paper", help="one paper's tables and figures, reproduced at CPU (or --gpu) sizes")
    p.add_argument("name", choices=sorted(PAPERS), help="the paper")
    p.add_argument("--gpu", action="store_true", help="the GPU sizes, for the figures that have them")
    p.add_argument("--figures", default=None,
                   help="comma-separated figure names to run (default: every figure of the paper)")
    p.add_argument("--budget-s", type=float, default=BUDGET_S,
                   help="seconds for the whole set; a figure that would run past it is stopped and reported")
    p.add_argument("--results", default=os.path.join("bench", "results"),
                   help="folder of the figures' records and plots (paper/NAME/ below it)")
    p.add_argument("--out", default=None, help="summary JSON (default RESULTS/paper-NAME-<device>.json)")
    p.set_defaults(results_stem=lambda a: os.path.join(a.results, f"paper-{a.name}"), check=check_args)
    return p


def check_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Before any work: the figure names the user typed, and --budget-s."""
    known = [f.name for f in PAPERS[args.name]]
    if args.figures is not None:
        unknown = [n for n in args.figures.split(",") if n not in known]
        if unknown or not args.figures:
            parser.error(f"--figures: {', '.join(unknown) or '(empty)'} not a figure of {args.name}; its figures: "
                         f"{', '.join(known)}")
    if not args.budget_s > 0:
        parser.error(f"--budget-s must be positive, got {args.budget_s:g}")


def chosen(args: argparse.Namespace) -> list[Figure]:
    names = None if args.figures is None else set(args.figures.split(","))
    return [f for f in PAPERS[args.name] if names is None or f.name in names]


def run_figure(fig: Figure, *, gpu: bool, timeout_s: float, scratch: str) -> tuple[dict | None, dict]:
    """(the benchmark's record, or None when it did not finish; how the run went)."""
    argv = list(fig.gpu_argv if gpu and fig.gpu_argv is not None else fig.argv)
    out = os.path.join(scratch, f"{fig.name}.json")
    command = [sys.executable, "-m", "launch.bench", *argv, "--out", out]
    env = dict(os.environ)
    if fig.cpu_devices > 1 and not gpu:  # simulated devices, set before the child's JAX starts
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={fig.cpu_devices}"
    started = time.monotonic()
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=max(timeout_s, 1))
        status, tail = ("ok" if done.returncode == 0 else f"exit {done.returncode}"), done.stderr[-2000:]
    except subprocess.TimeoutExpired as e:
        status = f"stopped after {timeout_s:.0f} s (--budget-s)"
        tail = (e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr or "")[-2000:]
    runs = read_runs(out)
    record = runs[-1] if runs and status == "ok" else None
    how = dict(figure=fig.name, status=status, seconds=round(time.monotonic() - started, 1),
               command="python -m launch.bench " + " ".join(argv))
    if record is None:
        how["stderr_tail"] = tail
        if runs:  # what a stopped benchmark measured before it stopped
            how["partial_record"] = runs[-1]
    return record, how


def paper(args: argparse.Namespace, env: dict, partial: object) -> dict:
    """Runs the paper's figures in order within --budget-s; the summary record."""
    if args.gpu and env["device"]["platform"] != "gpu":  # the GPU sizes would run for hours on a CPU
        raise SystemExit(f"launch.bench paper: --gpu runs the GPU sizes, but this machine's devices are "
                         f"{env['device']['platform']}; drop --gpu for the CPU sizes")
    device = device_tag(env["device"]["kind"])
    folder = os.path.join(args.results, "paper", args.name)
    os.makedirs(folder, exist_ok=True)
    started, rows = time.monotonic(), []
    ran: dict[tuple[str, ...], tuple[dict | None, dict]] = {}  # figures of one benchmark run share it
    with tempfile.TemporaryDirectory(prefix="paper-") as scratch:
        for fig in chosen(args):
            left = args.budget_s - (time.monotonic() - started)
            argv = fig.gpu_argv if args.gpu and fig.gpu_argv is not None else fig.argv
            if argv not in ran and left <= 0:
                rows.append(dict(figure=fig.name, status="not run: --budget-s spent"))
                continue
            print(f"[paper {args.name}] {fig.name}: {fig.corresponds}", flush=True)
            if argv not in ran:
                ran[argv] = run_figure(fig, gpu=args.gpu, timeout_s=left, scratch=scratch)
                record, how = ran[argv]
            else:
                record, first = ran[argv]
                how = dict(first, seconds=0.0, shares_run_of=first["figure"])
            base = os.path.join(folder, f"{fig.name}-{device}")
            entry = dict(how, paper=args.name, figure=fig.name, corresponds_to=fig.corresponds, differs=fig.differs,
                         record=record)
            ResultsFile(base + ".json").complete(entry)
            # paths in the summary: below --results, so a record names no folder of the machine it ran on
            row = dict(figure=fig.name, **{k: how[k] for k in ("status", "seconds")},
                       json=os.path.relpath(base + ".json", args.results))
            if record is not None:
                plot = draw(fig, record, base + ".png")
                row["plot"] = os.path.relpath(plot, args.results) if plot.endswith(".png") else plot
            rows.append(row)
            print(f"[paper {args.name}] {fig.name}: {how['status']} in {how['seconds']} s", flush=True)
    total = round(time.monotonic() - started, 1)
    return dict(env, benchmark="paper", paper=args.name, gpu=args.gpu, budget_s=args.budget_s, seconds=total,
                within_budget=total <= args.budget_s and all(r["status"] == "ok" for r in rows), figures=rows)

