"""Benchmarks: `python -m launch.bench <command> ...`; each run is appended as JSON to bench/results/ (or --out), and
rewritten there, marked partial, after each measured row (launch/bench/results.py). This module holds the commands
and their flags; each command's code is the module of its name beside it.

serve: the batch runner on synthetic scoring workloads (launch/bench/serve.py).
kernels: grouped GEMM, expert FFN and attention backends against dense matmul, ragged_dot and cuDNN
(launch/bench/kernels.py).
offload: pinned-host -> device bandwidth, streamed vs resident prefill around the saturation threshold, decode
time per token with cached experts (launch/bench/offload.py).
peers: moejax against transformers and (with --vllm-python) vLLM, each in its own process, interleaved, on scoring
with and without a shared prefix and on greedy generation (launch/bench/peers.py).
layouts: each parallel layout on the devices present (8 simulated CPU devices, or GPUs): tokens/s against the
one-device model, and bytes sent per device per layer, analytic next to measured (launch/bench/layouts.py).
quality: held-out perplexity, top-1 accuracy and expert load of a model with a tokenizer, against a bigram floor
(launch/bench/quality.py); --tier2: MoE-Prefill's tier-2 accuracy, multiple-choice code questions answered by
prefill-only scoring and by greedy generation (launch/bench/quality_tier2.py).
predictors: every expert predictor on held-out routing traces: recall per layer and distance, expert-cache hit
rates with each as prefetcher, and the accuracy cost of executing its predictions (launch/bench/predictors.py).
generate: output tokens/s of continuous batching vs static batching vs transformers' batched generate on a
long-tail workload, with slot utilisation (launch/bench/generate.py).
plans: the planners' own run time (FinDEP's solver, MoE-Lightning's policy search, the layout planner, Θ) and, on
2 or more devices, DEP as FinDEP's solver configures it against the default and PPPipe, measured
(launch/bench/plans.py).
prefill: prefill tokens/s and achieved FLOP/s (moejax.costs) of each moejax expert backend and, when torch and
transformers import, of transformers' eager forward on the same checkpoint in the same process. For a preset
the HF model is built from the preset's config (truncated to --num-layers), initialised (normal, std 0.02,
seeded), saved to a temporary directory and moejax loads that directory, so both engines run identical
weights. Compilation is excluded: each engine runs once to warm up, then `--repeats` timed runs
(launch/bench/prefill.py).
eval: an lm-eval multiple-choice task (shared contexts) through --model moejax vs hf (and vllm): requests/s and
the ratio (launch/bench/eval.py).
lightning: generation with placement lightning (MoE-Lightning's CGOPipe) against streamed and cached at one device
budget: tokens/s, the largest batch each reached, the busy share of each resource (launch/bench/lightning.py).
lightning-ablation: MoE-Lightning's §6.1 ablation, its policy under FlexGen's launch order against CGOPipe's in one
engine: tokens/s each and the ratio (launch/bench/lightning_ablation.py).
host-attention: MoE-Lightning's Fig. 9, decode attention on the host over the KV in host memory against the KV
copied to the device and attention there, by context length (launch/bench/host_attention.py).
frontend: MoE-Prefill's frontend routing shared-prefix scoring over 2-64 replicas (prefix-aware, round robin,
random, least requests in flight), simulated from a hardware profile, no devices: prefix-cache hit rate against
one engine, FLOPs balance, predicted throughput (launch/bench/frontend.py); --real: 2 engine replicas on this
machine (Ray) under each routing against one engine (launch/bench/frontend_real.py).
router-free: router-free speculative decoding with the true router skipped against run for misprediction counts:
time per output token at batch 1 and a larger batch (launch/bench/router_free.py).
dep-online: FinDEP's online phase: the solver's time per step shape, cache hits and the schedule chosen per shape (on
presets, no devices), and DEP with r1/r2/order re-solved per step under continuous batching on the devices present
(launch/bench/dep_online.py).
depth: launch.serve's first run on a deep checkpoint of tiny widths against the same model cut to a few layers,
each with an empty compilation cache (launch/bench/depth.py).
invariant: batch_invariant's cost, prefill and decode throughput with the mode and without, alternating
(launch/bench/invariant.py).
tpot-sweep: Speculating Experts' Fig. 8, batch-1 time per output token over context lengths for the resident, cached
and streamed placements, each beside its Eq. 1 bound (launch/bench/tpot_sweep.py).
dep-a2e: DEP's A2E straight to the experts' owners against regrouped by an all-to-all inside the expert group,
end to end on the devices present, with the logits against one device (launch/bench/dep.py).
"""
from __future__ import annotations

import argparse
import os

from launch.bench import dep as bench_dep
from launch.bench import dep_online as bench_dep_online
from launch.bench import depth as bench_depth
from launch.bench import eval as bench_eval
from launch.bench import frontend as bench_frontend
from launch.bench import generate as bench_generate
from launch.bench import host_attention as bench_host_attention
from launch.bench import invariant as bench_invariant
from launch.bench import kernels as bench_kernels
from launch.bench import layouts as bench_layouts
from launch.bench import lightning as bench_lightning
from launch.bench import lightning_ablation as bench_lightning_ablation
from launch.bench import offload as bench_offload
from launch.bench import paper as bench_paper
from launch.bench import peers as bench_peers
from launch.bench import plans as bench_plans
from launch.bench import predictors as bench_predictors
from launch.bench import prefill
from launch.bench import quality as bench_quality
from launch.bench import quality_tier2 as bench_quality_tier2
from launch.bench import router_free as bench_router_free
from launch.bench import serve as bench_serve
from launch.bench import tpot_sweep as bench_tpot_sweep
from launch.bench.provenance import device_tag
from launch.bench.results import ResultsFile
from launch.bench.util import environment
from moejax.serving import xla_startup


def build_parser() -> argparse.ArgumentParser:
    """Every command and its flags (`launch.bench paper` parses its figures' command lines with it in the tests)."""
    parser = argparse.ArgumentParser(prog="python -m launch.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--note", default=None,
                        help="a line the record keeps (e.g. that a CPU run is at small sizes); before the command")
    sub = parser.add_subparsers(dest="command", required=True)
    prefill.add_parser(sub).set_defaults(run=prefill.prefill)
    # run(args, environment, partial): partial(record so far, row) after each measured row; the benchmarks that
    # measure all their rows before they assemble a record (peers, quality, predictors) write once, at the end
    at_end = lambda run: lambda a, env, partial: run(a, env)  # noqa: E731
    bench_serve.add_parser(sub).set_defaults(run=bench_serve.serve)
    bench_kernels.add_parser(sub).set_defaults(run=bench_kernels.kernels)
    bench_offload.add_parser(sub).set_defaults(run=bench_offload.offload)
    bench_layouts.add_parser(sub).set_defaults(run=bench_layouts.layouts)
    bench_peers.add_parser(sub).set_defaults(run=at_end(bench_peers.peers))
    bench_quality.add_parser(sub).set_defaults(run=lambda a, env, partial: (
        bench_quality_tier2.tier2 if a.tier2 else bench_quality.quality)(a, env))
    bench_predictors.add_parser(sub).set_defaults(run=at_end(bench_predictors.predictors))
    bench_generate.add_parser(sub).set_defaults(run=bench_generate.generate)
    bench_plans.add_parser(sub).set_defaults(run=bench_plans.plans)
    bench_eval.add_parser(sub).set_defaults(run=bench_eval.eval_bench)
    bench_lightning.add_parser(sub).set_defaults(run=bench_lightning.lightning)
    bench_lightning_ablation.add_parser(sub).set_defaults(run=bench_lightning_ablation.lightning_ablation)
    bench_host_attention.add_parser(sub).set_defaults(run=bench_host_attention.host_attention)
    bench_frontend.add_parser(sub).set_defaults(run=bench_frontend.frontend)
    bench_router_free.add_parser(sub).set_defaults(run=bench_router_free.router_free)
    bench_dep_online.add_parser(sub).set_defaults(run=bench_dep_online.dep_online)
    bench_dep.add_parser(sub).set_defaults(run=bench_dep.dep_a2e)
    bench_depth.add_parser(sub).set_defaults(run=bench_depth.depth)
    bench_invariant.add_parser(sub).set_defaults(run=bench_invariant.invariant)
    bench_tpot_sweep.add_parser(sub).set_defaults(run=bench_tpot_sweep.tpot_sweep)
    bench_paper.add_parser(sub).set_defaults(run=bench_paper.paper)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "check", None):  # a command's own checks of what the user typed, before any work
        args.check(args, parser)
    if args.command == "prefill" and args.dtype != "float32" and not args.no_transformers:
        parser.error("the transformers comparison runs in float32; pass --no-transformers for other dtypes")
    if args.command == "frontend" and not args.out:  # the simulation and the real run are different records
        args.out = os.path.join("bench", "results", "frontend-real.json" if args.real else "frontend-sim.json")
    if getattr(args, "before_start", None):  # what must be set before JAX starts its backend (XLA_FLAGS)
        args.before_start(args)
    startup = xla_startup.apply(args)  # before environment() starts JAX's backend
    env = environment()
    if hasattr(args, "command_buffers"):  # the commands that take the settings record them
        env["xla_startup"] = startup
    if args.note:
        env["note"] = args.note
    stem = args.results_stem(args) if getattr(args, "results_stem", None) else os.path.join("bench", "results",
                                                                                          args.command)
    out = args.out or f"{stem}-{device_tag(env['device']['kind'])}.json"
    results = ResultsFile(out)
    runs = results.complete(args.run(args, env, results.partial))
    print(f"wrote {out} ({runs} runs)")

