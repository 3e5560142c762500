"""Benchmarks: `python -m launch.bench <command> ...`; each run is appended as JSON to bench/results/ (or --out), and
rewritten there, marked partial, after each measured row (launch/bench_results.py).

serve: the batch runner on synthetic scoring workloads (launch/bench_serve.py).
kernels: grouped GEMM, expert FFN and attention backends against dense matmul, ragged_dot and cuDNN
(launch/bench_kernels.py).
offload: pinned-host -> device bandwidth, streamed vs resident prefill around the saturation threshold, decode
time per token with cached experts (launch/bench_offload.py).
peers: moejax against transformers and (with --vllm-python) vLLM, each in its own process, interleaved, on scoring
with and without a shared prefix and on greedy generation (launch/bench_peers.py).
layouts: each parallel layout on the devices present (8 simulated CPU devices, or GPUs): tokens/s against the
one-device model, and bytes sent per device per layer, analytic next to measured (launch/bench_layouts.py).
quality: held-out perplexity, top-1 accuracy and expert load of a model with a tokenizer, against a bigram floor
(launch/bench_quality.py).
predictors: every expert predictor on held-out routing traces: recall per layer and distance, expert-cache hit
rates with each as prefetcher, and the accuracy cost of executing its predictions (launch/bench_predictors.py).
generate: output tokens/s of continuous batching vs static batching vs transformers' batched generate on a
long-tail workload, with slot utilisation (launch/bench_generate.py).
plans: the planners' own run time (FinDEP's solver, MoE-Lightning's policy search, the layout planner, Θ) and, on
2 or more devices, DEP as FinDEP's solver configures it against the default and PPPipe, measured
(launch/bench_plans.py).
prefill: prefill tokens/s and achieved FLOP/s (moejax.costs) of each moejax expert backend and, when torch and
transformers import, of transformers' eager forward on the same checkpoint in the same process. For a preset
the HF model is built from the preset's config (truncated to --num-layers), initialised (normal, std 0.02,
seeded), saved to a temporary directory and moejax loads that directory, so both engines run identical
weights. Compilation is excluded: each engine runs once to warm up, then `--repeats` timed runs.
eval: an lm-eval multiple-choice task (shared contexts) through --model moejax vs hf (and vllm): requests/s and
the ratio (launch/bench_eval.py).
lightning: generation with placement lightning (MoE-Lightning's CGOPipe) against streamed and cached at one device
budget: tokens/s, the largest batch each reached, the busy share of each resource (launch/bench_lightning.py).
frontend: MoE-Prefill's frontend routing shared-prefix scoring over 2-64 replicas (prefix-aware, round robin,
random), simulated from a hardware profile, no devices: prefix-cache hit rate against one engine, FLOPs balance,
predicted throughput (launch/bench_frontend.py); --real: 2 engine replicas on this machine (Ray) under each routing
against one engine (launch/bench_frontend_real.py).
router-free: router-free speculative decoding with the true router skipped against run for misprediction counts:
time per output token at batch 1 and a larger batch (launch/bench_router_free.py).
dep-online: FinDEP's online phase: the solver's time per step shape, cache hits and the schedule chosen per shape (on
presets, no devices), and DEP with r1/r2/order re-solved per step under continuous batching on the devices present
(launch/bench_dep_online.py).
depth: launch.serve's first run on a deep checkpoint of tiny widths against the same model cut to a few layers,
each with an empty compilation cache (launch/bench_depth.py).
invariant: batch_invariant's cost, prefill and decode throughput with the mode and without, alternating
(launch/bench_invariant.py).
dep-a2e: DEP's A2E straight to the experts' owners against regrouped by an all-to-all inside the expert group,
end to end on the devices present, with the logits against one device (launch/bench_dep.py).
"""
from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time

import numpy as np

import moejax
from moejax import costs
from moejax.models.checkpoint import read_config
from moejax.presets import preset_config

from launch import (bench_dep, bench_dep_online, bench_depth, bench_eval, bench_frontend, bench_generate,
                    bench_invariant, bench_kernels, bench_layouts, bench_lightning, bench_offload, bench_peers,
                    bench_plans, bench_predictors, bench_quality, bench_router_free, bench_serve, xla_startup)
from launch.bench_results import ResultsFile, no_file
from launch.bench_util import device_tag, environment, hf_checkpoint, time_calls


def _result(engine: str, impl: str, tokens: int, flops: int, timing, **extra) -> dict:
    first, runs, other = timing
    best, median = min(runs), float(np.median(runs))
    print(f"  {engine:12s} {impl:10s} {tokens / median:9.1f} tok/s  {flops / median / 1e12:7.4f} TFLOP/s  "
          f"median {median:.3f}s  min {best:.3f}s  (first call {first:.1f}s; other processes {other:.0%} CPU)",
          flush=True)
    return dict(engine=engine, impl=impl, tokens_per_s=tokens / median, tflops_per_s=flops / median / 1e12,
                seconds_median=median, seconds_min=best, seconds=runs, repeats=len(runs), first_call_s=first,
                other_processes_cpu_share=other, **extra)


def _transformers(model, ids, repeats, tokens, flops, hf_experts) -> tuple[list[dict], np.ndarray]:
    import torch
    torch.set_num_threads(os.cpu_count())
    results, logits = [], None
    x = torch.from_numpy(np.asarray(ids, np.int64))
    for experts in hf_experts:
        if experts != "default":
            model.set_experts_implementation(experts)
        used = getattr(model.config, "_experts_implementation", None)
        out = {}
        with torch.no_grad():
            timing = time_calls(lambda: out.__setitem__("logits", model(input_ids=x, use_cache=False).logits), repeats)
        logits = out["logits"].float().numpy() if logits is None else logits
        results.append(_result("transformers", str(used), tokens, flops, timing, attn_implementation="eager",
                               experts_implementation=used, torch_threads=torch.get_num_threads()))
    return results, logits


def prefill(args, env: dict, partial=no_file) -> dict:
    is_dir = os.path.isdir(args.model)
    hf_config = read_config(args.model) if is_dir else preset_config(args.model)
    if args.num_layers:
        hf_config["num_hidden_layers"] = args.num_layers
        if isinstance(hf_config.get("layer_types"), list):
            hf_config["layer_types"] = hf_config["layer_types"][: args.num_layers]
    ids = np.random.default_rng(args.seed).integers(0, hf_config["vocab_size"], (args.batch, args.seq))
    tokens = args.batch * args.seq
    use_hf = not args.no_transformers
    if use_hf:
        try:
            import torch  # noqa: F401
            import transformers  # noqa: F401
        except ImportError as e:
            print(f"transformers comparison skipped: {e}")
            use_hf = False
    hf_results, hf_logits, tmp = [], None, None
    source = args.model
    load_avg = [os.getloadavg()]
    if use_hf:
        tmp = tempfile.TemporaryDirectory(prefix="moejax-bench-")
        t0 = time.perf_counter()
        if is_dir:  # transformers 5 reads every hub layout; load the checkpoint itself
            import torch
            import transformers
            hf_model = transformers.AutoModelForCausalLM.from_pretrained(
                args.model, attn_implementation="eager", dtype=torch.float32,
                num_hidden_layers=hf_config["num_hidden_layers"])
        else:
            hf_model = hf_checkpoint(hf_config, tmp.name, args.seed)
            source = tmp.name
        print(f"transformers model ready in {time.perf_counter() - t0:.1f}s", flush=True)
    cfg = moejax.load(source, dtype=args.dtype, num_layers=args.num_layers, compilation_cache=False).config
    flops = costs.prefill_flops(cfg, args.batch, args.seq)
    print(f"{args.model}: {cfg.num_layers} layers, batch {args.batch} x seq {args.seq}, {args.dtype}, "
          f"{flops.total / 1e9:.1f} GFLOP per prefill ({flops.experts / 1e9:.1f} in routed experts)", flush=True)
    results = []

    def record() -> dict:
        return dict(**env, benchmark="prefill", load_average_before_after=load_avg,
                    config=dict(model=args.model, model_type=cfg.model_type, num_layers=cfg.num_layers,
                                hidden_size=cfg.hidden_size, num_experts=cfg.num_experts,
                                experts_per_token=cfg.num_experts_per_tok,
                                moe_intermediate_size=cfg.moe_intermediate_size, vocab_size=cfg.vocab_size,
                                params=costs.param_count(cfg), active_params=costs.active_param_count(cfg),
                                dtype=args.dtype, batch=args.batch, seq=args.seq, flops=flops.as_dict()),
                    results=hf_results + results)
    if use_hf:
        hf_results, hf_logits = _transformers(hf_model, ids, args.repeats, tokens, flops.total,
                                              args.hf_experts.split(","))
        partial(record(), "transformers")
        del hf_model
        gc.collect()
    for impl in args.impls.split(","):
        engine = moejax.load(source, dtype=args.dtype, kernels=f"experts={impl}", num_layers=args.num_layers,
                             compilation_cache=False)
        out = {}
        timing = time_calls(lambda: out.__setitem__("logits", engine.logits(ids)), args.repeats)
        extra = {}
        if hf_logits is not None:
            diff = float(np.max(np.abs(out["logits"] - hf_logits)))
            extra = dict(max_abs_logits_diff_vs_transformers=diff,
                         rel_logits_diff_vs_transformers=diff / float(np.max(np.abs(hf_logits))))
        results.append(_result("moejax", impl, tokens, flops.total, timing, **extra))
        partial(record(), f"moejax {impl}")
        if extra:
            print(f"    max |logits - transformers| = {extra['max_abs_logits_diff_vs_transformers']:.3g} "
                  f"(relative {extra['rel_logits_diff_vs_transformers']:.3g})")
        engine = out = None  # frees the weights before the next load (not del: the timed lambda names both)
        gc.collect()
    load_avg.append(os.getloadavg())
    if tmp is not None:
        tmp.cleanup()
    for hf in hf_results:
        for r in results:
            r[f"speedup_vs_transformers_{hf['impl']}"] = r["tokens_per_s"] / hf["tokens_per_s"]
            print(f"  moejax {r['impl']:8s} / transformers ({hf['impl']}): "
                  f"{r['tokens_per_s'] / hf['tokens_per_s']:.2f}x")
    return record()


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m launch.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--note", default=None,
                        help="a line the record keeps (e.g. that a CPU run is at small sizes); before the command")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prefill", help="prefill throughput of each expert impl vs transformers")
    p.add_argument("--model", required=True, help="preset name or HF checkpoint directory")
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--impls", default="xla,ragged_dot,dense", help="expert FFN backends to time")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-transformers", action="store_true")
    p.add_argument("--hf-experts", default="default",
                   help="transformers experts implementations to time, e.g. grouped_mm,eager (default: its default)")
    p.add_argument("--out", default=None, help="JSON file (default bench/results/prefill-<device>.json)")
    p.set_defaults(run=prefill)
    # run(args, environment, partial): partial(record so far, row) after each measured row; the benchmarks that
    # measure all their rows before they assemble a record (peers, quality, predictors) write once, at the end
    at_end = lambda run: lambda a, env, partial: run(a, env)  # noqa: E731
    bench_serve.add_parser(sub).set_defaults(run=bench_serve.serve)
    bench_kernels.add_parser(sub).set_defaults(run=bench_kernels.kernels)
    bench_offload.add_parser(sub).set_defaults(run=bench_offload.offload)
    bench_layouts.add_parser(sub).set_defaults(run=bench_layouts.layouts)
    bench_peers.add_parser(sub).set_defaults(run=at_end(bench_peers.peers))
    bench_quality.add_parser(sub).set_defaults(run=at_end(bench_quality.quality))
    bench_predictors.add_parser(sub).set_defaults(run=at_end(bench_predictors.predictors))
    bench_generate.add_parser(sub).set_defaults(run=bench_generate.generate)
    bench_plans.add_parser(sub).set_defaults(run=bench_plans.plans)
    bench_eval.add_parser(sub).set_defaults(run=bench_eval.eval_bench)
    bench_lightning.add_parser(sub).set_defaults(run=bench_lightning.lightning)
    bench_frontend.add_parser(sub).set_defaults(run=bench_frontend.frontend)
    bench_router_free.add_parser(sub).set_defaults(run=bench_router_free.router_free)
    bench_dep_online.add_parser(sub).set_defaults(run=bench_dep_online.dep_online)
    bench_dep.add_parser(sub).set_defaults(run=bench_dep.dep_a2e)
    bench_depth.add_parser(sub).set_defaults(run=bench_depth.depth)
    bench_invariant.add_parser(sub).set_defaults(run=bench_invariant.invariant)
    args = parser.parse_args(argv)
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
    out = args.out or os.path.join("bench", "results", f"{args.command}-{device_tag(env['device']['kind'])}.json")
    results = ResultsFile(out)
    runs = results.complete(args.run(args, env, results.partial))
    print(f"wrote {out} ({runs} runs)")


if __name__ == "__main__":
    main()
