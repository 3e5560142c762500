"""`python -m launch.bench prefill`: prefill tokens/s and achieved FLOP/s (moejax.costs) of each moejax expert backend
and, when torch and transformers import, of transformers' eager forward on the same checkpoint in the same process
(launch/bench/cli.py's docstring says how the weights are shared and what is timed)."""
from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import moejax
from launch.bench.results import no_file
from launch.bench.util import hf_checkpoint, time_calls
from moejax import costs
from moejax.models.checkpoint import read_config
from moejax.presets import preset_config


def _result(engine: str, impl: str, tokens: int, flops: int, timing: tuple[float, list[float], float],
            **extra: object) -> dict:
    first, runs, other = timing
    best, median = min(runs), float(np.median(runs))
    print(f"  {engine:12s} {impl:10s} {tokens / median:9.1f} tok/s  {flops / median / 1e12:7.4f} TFLOP/s  "
          f"median {median:.3f}s  min {best:.3f}s  (first call {first:.1f}s; other processes {other:.0%} CPU)",
          flush=True)
    return dict(engine=engine, impl=impl, tokens_per_s=tokens / median, tflops_per_s=flops / median / 1e12,
                seconds_median=median, seconds_min=best, seconds=runs, repeats=len(runs), first_call_s=first,
                other_processes_cpu_share=other, **extra)


def _transformers(model: Any, ids: np.ndarray, repeats: int, tokens: int, flops: int, hf_experts: list[str]
                  ) -> tuple[list[dict], np.ndarray]:
    import torch  # optional: transformers' reference only
    torch.set_num_threads(os.cpu_count() or 1)
    results: list[dict] = []
    logits: np.ndarray | None = None
    x = torch.from_numpy(np.asarray(ids, np.int64))
    for experts in hf_experts:
        if experts != "default":
            model.set_experts_implementation(experts)
        used = getattr(model.config, "_experts_implementation", None)
        out: dict[str, Any] = {}
        with torch.no_grad():
            timing = time_calls(lambda: out.__setitem__("logits", model(input_ids=x, use_cache=False).logits), repeats)  # noqa: B023 (timed here)
        logits = out["logits"].float().numpy() if logits is None else logits
        results.append(_result("transformers", str(used), tokens, flops, timing, attn_implementation="eager",
                               experts_implementation=used, torch_threads=torch.get_num_threads()))
    assert logits is not None, "hf_experts names no implementation"
    return results, logits


def prefill(args: argparse.Namespace, env: dict, partial: Callable[[dict, str], None] = no_file) -> dict:
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
    hf_results: list[dict] = []
    hf_logits: np.ndarray | None = None
    tmp: tempfile.TemporaryDirectory[str] | None = None
    source = args.model
    load_avg = [os.getloadavg()]
    if use_hf:
        tmp = tempfile.TemporaryDirectory(prefix="moejax-bench-")
        t0 = time.perf_counter()
        if is_dir:  # transformers 5 reads every hub layout; load the checkpoint itself
            import torch  # optional: transformers' reference only
            import transformers  # optional: transformers' reference only
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
    results: list[dict] = []

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
        out: dict[str, np.ndarray] = {}
        timing = time_calls(lambda: out.__setitem__("logits", engine.logits(ids)), args.repeats)  # noqa: B023 (timed here)
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
        # frees the weights before the next load (not del: the timed lambda names both; None is no Engine, no dict)
        engine = out = None  # type: ignore[assignment]
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


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
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
    return p
