"""python -m launch.serve: the moejax batch runner. Reads JSONL requests in the OpenAI Batch envelope
(/v1/chat/completions and /v1/completions: generation; /v1/score: prefill-only scoring, moejax's candidates or
SGLang's query/items/label_token_ids; /generative_scoring: vLLM's) and writes one result line per input line, in
input order, as the OpenAI Batch API does.

Examples:
  python -m launch.serve --input examples/requests.jsonl                 # embedded pycode-moe, to stdout
  python -m launch.serve --model tests/fixtures/qwen3_moe --input examples/formats.jsonl   # chat, SGLang, vLLM
  python -m launch.serve --model /ckpt/Qwen3-30B-A3B --input reqs.jsonl --output results.jsonl \\
      --max-batch-tokens 32768 --metrics metrics.json
  cat reqs.jsonl | python -m launch.serve --input - --output results.jsonl --kv-cache off
  python -m launch.serve --input reqs.jsonl --explain                    # print the plan, run nothing

Rerunning a command whose output file is incomplete (crash, kill, full disk) serves only the missing lines, then
writes the complete file in input order; a rerun with settings that change results (model, dtype, kernels,
layout, placement, ...) is refused instead. A runner holds a lock on its output (<output>.lock, and on
--error-file) until it ends: a second runner on the same output is refused, naming the first's pid and host.

Exit status: 0 when every line got a result computed for it; 1 when any line failed (each still has its
error line: 400 for invalid input, 500 for a failed batch; --allow-invalid-lines exits 0 when only invalid
lines failed) or when results could not be written (the journal keeps what was written); 2 for a flag the user got
wrong (a value out of range or not among the choices, options that do not go together, an unreadable input, an
output path that is the input or another output, a folder, or cannot be written), with one line naming the flag
before the model loads; any other failure (an output another runner is writing, a model that does not load, an
output made with other settings) exits 1 with a message before anything is written.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import secrets
import signal
import sys
import time
from typing import NoReturn

import jax
import numpy as np
from tqdm import tqdm

from moejax import options
from moejax.engine import Engine
from moejax.kernels.backends import Kernels
from moejax.measure.lightning_probe import Probe, explain_engine
from moejax.offload.settings import PlacementSettings
from moejax.plan import plots
from moejax.plan.engine_plan import EnginePlan, Workload
from moejax.plan.resolve import profile_for
from moejax.plan.theta import layer_time_curve
from moejax.replicas.frontend_plan import routing_lines
from moejax.replicas.run import ReplicaPlan
from moejax.requests import output_lock
from moejax.requests.results import SettingsMismatch, WriteFailed
from moejax.sched.batch import explain_lines, serve_lines
from moejax.sched.batch_size import DEFAULT_TOKENS
from moejax.sched.explain import peak_flops
from moejax.sched.pool_size import PoolTooLarge
from moejax.sched.runner import Metrics, Progress
from moejax.sched.serving_options import ServingOptions
from moejax.serving import xla_startup
from moejax.serving.load_engine import load, refusal, replica_notes, run_settings, set_saturation
from moejax.serving.model_options import ModelOptions, Processes
from moejax.serving.output_paths import check_paths
from moejax.serving.replicated import format_summary, serve_replicas
from moejax.sharding import multihost


class OneLineParser(argparse.ArgumentParser):
    """argparse, whose error is one line (the flag and the problem; exit status 2) instead of the usage of every
    flag above it."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (--help lists the flags)\n")


def refuse(message: str) -> NoReturn:
    """A flag the user got wrong, found before any work: its one line on stderr, exit status 2 (argparse's)."""
    print(message, file=sys.stderr)
    raise SystemExit(2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags of the option dataclasses (moejax.options: their defaults, types, choices and help), and this
    command's own: files, Θ, the plots."""
    p = OneLineParser(prog="python -m launch.serve", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    options.add_arguments(p, ModelOptions, ("model",))
    p.add_argument("--input", required=True, help="requests JSONL file, or - for stdin")
    p.add_argument("--output", default=None, help="results JSONL file (default: stdout, no resume)")
    p.add_argument("--error-file", default=None,
                   help="also write the failed lines (4xx, 5xx; as in --output) to this file, as the OpenAI Batch API "
                        "does")
    options.add_arguments(p, ModelOptions, ("dtype", "num_layers", "kernels", "batch_invariant"))
    options.add_arguments(p, ServingOptions)
    options.add_arguments(p, EnginePlan)
    options.add_arguments(p, Workload)
    g = p.add_argument_group("expert offloading (one device; see moejax.offload)")
    options.add_arguments(g, PlacementSettings, ("placement",))
    g.add_argument("--theta", default="profile", choices=["profile", "eq1"],
                   help="placements that copy experts during a forward: the saturation threshold Θ prefill batches "
                        "are filled to: profile (measure it, MoE-Prefill Eq. 3; placement streamed, and AsyncEP "
                        "from the host) or eq1 (from the hardware profile, Eq. 1; no profiling pass). Resident "
                        "experts=async_ep (its all-gather) always takes Eq. 1; without a hardware profile it gets no "
                        "Θ (a note says so) unless eq1 was asked for, which then exits")
    options.add_arguments(g, PlacementSettings, PlacementSettings.names()[1:])
    g = p.add_argument_group("several processes (hosts), one per host; all three flags or none")
    options.add_arguments(g, Processes)
    g = p.add_argument_group("engine replicas behind MoE-Prefill's prefix-aware frontend (Ray; moejax.replicas.run)")
    options.add_arguments(g, ReplicaPlan)
    g = p.add_argument_group("XLA settings read when JAX starts (moejax.serving.xla_startup)")
    xla_startup.add_arguments(g)
    p.add_argument("--metrics", default=None, help="also write the run summary to this JSON file")
    p.add_argument("--explain", action="store_true",
                   help="print the plan (batches, shapes, cache policy) and exit; placement lightning also runs one "
                        "decode call to set the measured per-layer time beside the predicted")
    p.add_argument("--plot", default=None, metavar="DIR",
                   help="with --explain: draw the plans into DIR (a DEP layout's pipeline or lightning's measured "
                        "decode as a Gantt chart, Θ against batch FLOPs; matplotlib, the plots extra)")
    p.add_argument("--allow-invalid-lines", action="store_true",
                   help="exit 0 when the only failed lines were invalid input (each still gets its 400 line)")
    return p.parse_args(argv)


# the option classes with flags here
OPTION_CLASSES = (ModelOptions, ServingOptions, EnginePlan, Workload, PlacementSettings, Processes, ReplicaPlan)


def options_table() -> str:
    """docs/options.md's table of the option flags, from their fields."""
    return options.markdown_table(*OPTION_CLASSES)


def read_lines(path: str) -> list[str]:
    # newline="": only "\n" ends a line (as on stdin); utf-8-sig drops a byte-order mark. Bytes that are not UTF-8
    # stay as lone surrogates (surrogateescape), so the parser can refuse their lines instead of serving a
    # replacement character.
    if path == "-":
        text = sys.stdin.buffer.read().decode("utf-8-sig", errors="surrogateescape")
    else:
        with open(path, encoding="utf-8-sig", errors="surrogateescape", newline="") as f:
            text = f.read()
    lines = text.split("\n")
    return lines[:-1] if lines and lines[-1] == "" else lines


def check_numbers(args: argparse.Namespace) -> str | None:
    """The first numeric flag out of its option's range, as a message naming it; None when all are fine."""
    problem = options.check_flags(args, *OPTION_CLASSES)
    if problem is None and args.process_id is not None and args.num_processes is not None \
            and args.process_id >= args.num_processes:
        return f"--process-id must be below --num-processes ({args.num_processes}); got {args.process_id}"
    return problem


def check_settings(args: argparse.Namespace) -> str | None:
    """The plan's options that go together (a predictor and its files, options that apply to another placement,
    a layout spec), checked as moejax.load would check them but before it, in a message naming the flags."""
    try:
        placement = options.from_args(PlacementSettings, args)
        options.from_args(EnginePlan, args, placement=placement, workload=options.from_args(Workload, args))
    except (ValueError, TypeError) as e:
        return options.as_flags(str(e).removeprefix("moejax.load: "), *OPTION_CLASSES)
    return None


def load_error(args: argparse.Namespace, e: Exception) -> str:
    """A failed load as one line: when a flag of the plan caused it (moejax.load names its keyword), naming that
    flag; else naming --model."""
    text = str(e).removeprefix("moejax.load: ")
    named = options.as_flags(text, *OPTION_CLASSES)
    return named if named.startswith("--") else f"--model {args.model}: {text}"


def check_plot_extra(args: argparse.Namespace) -> str | None:
    """--plot draws --explain's plans with matplotlib, an optional extra: without --explain, or without matplotlib,
    the flag is refused before the model loads (it would do nothing)."""
    if not args.plot:
        return None
    if not args.explain:
        return "--plot draws the plans --explain prints; give --explain too, or drop --plot"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "--plot: drawing the plans needs matplotlib: pip install 'moejax[plots]'"
    return None


def write_metrics(path: str | None, summary: dict) -> None:
    """--metrics: the run summary as JSON (its folder was checked before the run; a failure now, such as a full disk,
    is one line: the results are written already)."""
    if path is None:
        return
    try:
        with open(path, "w") as f:
            json.dump(summary, f, indent=1)
    except OSError as e:
        sys.exit(f"--metrics {path}: cannot write the run summary: {e.strerror or e} (the results are written)")


def check_kernels(args: argparse.Namespace) -> str | None:
    """A backend that cannot run on this platform is refused before the weights load."""
    try:
        kernels = Kernels.parse(args.kernels)
        why = dataclasses.replace(kernels, invariant=bool(getattr(args, "batch_invariant", False))).unavailable()
    except ValueError as e:
        why = str(e).removeprefix("kernels: ")
    return None if why is None else f"--kernels {args.kernels}: {why}".replace("batch_invariant", "--batch-invariant")


def lightning_explain(engine: Engine, args: argparse.Namespace) -> Probe:
    """--explain of placement lightning: one probed decode call (it compiles and runs one: a plan is only as good as
    its prediction) against the HRM's prediction on the hardware profile, printed; -> the probe (--plot draws it)."""
    lines, probe, _ = explain_engine(engine, args.profile)
    print("\n".join(lines))
    return probe


def plan_plots(engine: Engine, args: argparse.Namespace, probe: Probe | None = None) -> list[str]:
    """--explain --plot DIR: the engine's plans drawn (on its hardware profile; lightning: the probed decode call's
    measured pipeline); lines saying what was written."""
    if probe is not None:
        path = plots.gantt({f"{probe.rows} rows, {probe.context} tokens of context, {probe.tokens} decode steps":
                            (probe.seconds, probe.gantt_events())}, os.path.join(args.plot, "lightning-gantt.png"),
                           "lightning decode, measured (moejax.lightning.trace)")
        return [f"plot: {path}"]
    try:
        profile = profile_for(jax.devices()[0].device_kind, len(jax.devices()), args.profile)
    except ValueError as e:
        return [f"no plots: {e}"]
    cfg, out = engine.config, []
    pipeline = engine.placement.predicted_pipeline(cfg, profile, args.max_batch_tokens or DEFAULT_TOKENS)
    if pipeline is not None:
        path = plots.gantt({str(engine.layout): pipeline}, os.path.join(args.plot, "dep-gantt.png"),
                           f"predicted on profile {profile.name}")
        out.append(f"plot: {path}")
    if engine.saturation is not None:
        eq1 = engine.placement.theta(cfg, lambda: profile)  # Eq. 1 in the placement's channel, on this profile
        assert eq1 is not None  # a placement with a Θ copies experts, so it has a channel
        theta = engine.saturation.theta_flops
        flops = list(np.geomspace(theta / 100, theta * 100, 60))
        curve = [(f, *t) for f, t in zip(flops, layer_time_curve(cfg, profile, eq1, flops), strict=True)]
        path = plots.theta_plot(curve, theta, os.path.join(args.plot, "theta.png"),
                                f"Θ {engine.saturation.source}; curves from profile {profile.name}")
        out.append(f"plot: {path}")
    return out or ["no plots: the plans to draw are a DEP layout's pipeline and a streamed placement's Θ"]


def exit_status(summary: dict, allow_invalid_lines: bool) -> int:
    """1 when the output has a failed line: a failed batch, or an invalid line (also one a resumed run
    kept) unless --allow-invalid-lines; else 0."""
    invalid = 0 if allow_invalid_lines else summary["requests_invalid"]
    return 1 if summary["requests_batch_failed"] or invalid else 0


def main(argv: list[str] | None = None) -> int:
    with contextlib.ExitStack() as held:  # the output locks taken below, released however the run ends
        try:
            return _main(parse_args(argv), held)
        except KeyboardInterrupt:  # Ctrl-C: what was running has stopped (replicas included); no traceback
            print("launch.serve: interrupted; the journal keeps the results written (rerun to resume)",
                  file=sys.stderr)
            return 128 + signal.SIGINT


def _main(args: argparse.Namespace, held: contextlib.ExitStack) -> int:
    given = (args.coordinator, args.num_processes, args.process_id)
    multi: tuple[str, int, int] | None = given
    if None in given:
        if any(v is not None for v in given):
            missing = [f for f, v in zip(("--coordinator", "--num-processes", "--process-id"), given, strict=True)
                       if v is None]
            refuse(f"--coordinator, --num-processes and --process-id go together; missing {', '.join(missing)}")
        multi = None
    elif not args.output:  # and not stdout: CPU collectives (gloo) print their own lines there
        refuse("--coordinator: a run over several processes writes its results to --output; give one")
    if args.transfer_address is not None and multi is None:
        refuse("--transfer-address applies to a run over several processes (--coordinator ...); drop it or give "
                 "those")
    problem = check_numbers(args) or check_paths(args) or check_plot_extra(args) or check_settings(args)
    if problem:
        refuse(problem)
    xla_startup.apply(args)  # before anything starts JAX's backend
    try:
        lines = read_lines(args.input)
    except OSError as e:
        refuse(f"--input: cannot read {args.input!r}: {e.strerror}")
    replicas = options.from_args(ReplicaPlan, args)
    if replicas.replicas > 1 or replicas.ray:
        if multi:
            refuse("--replicas/--ray and --coordinator: a run is either engine replicas (Ray) or one engine over "
                     "several processes; give one")
        return _serve_replicas(args, lines, replicas, held)
    notes = replica_notes(replicas)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    # several processes run static batches: the scheduler's host loop runs in one process
    serving = options.from_args(ServingOptions, args, **({"batching": "static"} if multi else {}))
    if multi:
        try:  # before anything touches a JAX device
            multihost.initialize(*multi, transfer_address=args.transfer_address)
        except (ValueError, RuntimeError) as e:
            sys.exit(f"--coordinator {args.coordinator}: {e}")
        _check_processes_agree(args, lines)
    problem = check_kernels(args)  # it asks JAX for the platform: only after joining the other processes
    if problem:
        refuse(problem)
    lock_outputs(args, multi, held)
    try:
        engine = load(args, serving)
    except (ValueError, OSError) as e:
        sys.exit(load_error(args, e))
    problem = refusal(engine, args, lines)  # what the placement cannot serve, before the weights load
    if problem:
        refuse(problem)
    try:  # Θ, for placements that copy experts during a forward: prefill batches are filled to it
        set_saturation(engine, args)
    except ValueError as e:
        sys.exit(f"--theta {args.theta}: {e}")
    writer = multihost.is_main()  # the other processes run the same batches (their collectives) and write nothing
    if args.explain:
        if writer:
            print("\n".join([engine.explain(), *notes]))
            try:
                print(explain_lines(engine, lines, serving))
            except PoolTooLarge as e:
                sys.exit(f"--kv-pool-mb {args.kv_pool_mb}: {e}")
            probe = lightning_explain(engine, args) if engine.placement.probed_at_explain else None
            if args.plot:
                for line in plan_plots(engine, args, probe):
                    print(line)
        return 0
    # Requests without a seed draw theirs from this; every process must draw the same.
    nonce = multihost.main_number(secrets.randbits(62)) if multi else None
    try:
        with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sys.stdout if writer else sink):
            summary = serve_lines(engine, lines, args.output if writer else None, serving,
                                  progress=_progress_bar if writer else None, peak=peak_flops(engine.dtype.name),
                                  settings=run_settings(args, engine), seed_nonce=nonce,
                                  error_file=args.error_file if writer else None)
    except SettingsMismatch as e:
        sys.exit(f"--output {args.output}: {e}")
    except WriteFailed as e:
        sys.exit(f"--output: {e}")
    except output_lock.OutputLockError as e:
        sys.exit(f"{_flag_of(args, e.path)}: {e}")
    except PoolTooLarge as e:
        sys.exit(f"--kv-pool-mb {args.kv_pool_mb}: {e}")
    if not writer:
        return 0
    summary = {"model": args.model, "dtype": engine.dtype.name, **summary}
    print(_format_summary(summary), file=sys.stderr)
    write_metrics(args.metrics, summary)
    return exit_status(summary, args.allow_invalid_lines)


def _serve_replicas(args: argparse.Namespace, lines: list[str], replicas: ReplicaPlan, held: contextlib.ExitStack
                    ) -> int:
    """The run over engine replicas (moejax.serving.replicated): the same output, journal, lock, summary and exit
    status as one engine's; --explain explains one engine (loaded here) as every replica would run it."""
    serving = options.from_args(ServingOptions, args)
    if args.explain:  # one engine, loaded here, as every replica would run it, and the frontend's routing
        try:
            engine = load(args, serving)
            set_saturation(engine, args)
        except (ValueError, OSError) as e:
            sys.exit(load_error(args, e))
        print(engine.explain())
        print(explain_lines(engine, lines, serving))
        print(routing_lines(engine, lines, replicas.replicas, replicas.routing, serving.max_batch_tokens,
                            serving.kv_cache))
        return 0
    lock_outputs(args, None, held)
    summary = serve_replicas(args, lines, serving, replicas)
    print(format_summary(summary), file=sys.stderr)
    write_metrics(args.metrics, summary)
    return exit_status(summary, args.allow_invalid_lines)


def lock_outputs(args: argparse.Namespace, multi: tuple[str, int, int] | None, held: contextlib.ExitStack) -> None:
    """Exit, before the model loads, when another runner is writing this --output (with its journal) or
    --error-file; else hold their locks until main ends (moejax.requests.output_lock). The error file is locked too:
    it is rewritten whole when a run ends, so two runs sharing one would silently drop the other's failed lines.
    Only process 0 writes, so only it locks; it tells the others whether to go on."""
    if args.explain:
        return
    refused = None
    if not multi or multihost.is_main():
        try:
            held.enter_context(output_lock.hold(args.output, args.error_file))
        except output_lock.OutputLockError as e:
            refused = f"{_flag_of(args, e.path)}: {e}"
    if multi and multihost.main_says(refused is not None) and refused is None:
        sys.exit(f"--output {args.output}: process 0 could not lock it (its message says why)")
    if refused:
        sys.exit(refused)


def _flag_of(args: argparse.Namespace, path: str | None) -> str:
    """The flag (and value) that named `path`."""
    if args.error_file and path is not None and os.path.realpath(args.error_file) == path:
        return f"--error-file {args.error_file}"
    return f"--output {args.output}"


def _check_processes_agree(args: argparse.Namespace, lines: list[str]) -> None:
    """Several processes must run the very same batches: each process feeds the rows its own devices hold, so
    different inputs would mix requests silently. Only process 0 keeps a journal, and the others cannot see it
    (other hosts), so a run does not resume: process 0 tells every process whether its output already exists."""
    if not multihost.same_everywhere("\n".join(lines).encode("utf-8", "replace")):
        sys.exit("--input: the processes read different requests; every process needs the same input")
    exists = args.output and any(os.path.exists(p) for p in (args.output, args.output + ".partial"))
    if multihost.main_says(exists):
        sys.exit(f"--output {args.output}: process 0 has this output or its journal already; a run over several "
                 "processes does not resume (the others cannot see it): remove it or write elsewhere")


def _progress_bar(total: int) -> Progress | None:
    """A tqdm bar on a terminal (requests, tokens/s); nothing otherwise."""
    if not sys.stderr.isatty() or not total:
        return None
    bar = tqdm(total=total, unit="req", file=sys.stderr)
    start = time.perf_counter()

    def update(n: int | None, metrics: Metrics) -> None:
        if n is None:
            bar.close()
            return
        bar.update(n)
        tokens = metrics.prompt_tokens + metrics.generated_tokens
        bar.set_postfix_str(f"{tokens / max(time.perf_counter() - start, 1e-9):.0f} tok/s")
    return update


def _format_summary(s: dict) -> str:
    rate = s["tokens_per_s"]
    mfu = s["mfu_estimate"]
    return (f"# {s['model']} on {s['device']}: {s['requests_ok']} ok, {s['requests_failed']} failed, "
            f"{s['requests_resumed']} resumed, {s['requests_invalid']} invalid lines in the input | "
            f"{s['prompt_tokens']} prompt tokens "
            f"({s['cached_prompt_tokens']} from the prefix cache, {s['computed_tokens']} computed), "
            f"{s['generated_tokens']} generated | {s['wall_s']:.2f}s, "
            f"{'-' if rate is None else f'{rate:.0f}'} tok/s | prefix-cache hit rate "
            f"{s['prefix_cache_hit_rate']:.1%} | kv cache {s['kv_cache']} | {s['batching']} batching"
            + ("" if s["slot_utilisation"] is None else f", decode slots {s['slot_utilisation']:.0%} useful")
            + ("" if mfu is None else f" | MFU ~{mfu:.1%} (datasheet peak)"))


if __name__ == "__main__":
    raise SystemExit(main())
