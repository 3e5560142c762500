"""`python -m launch.bench tpot-sweep`: Speculating Experts' Fig. 8 (arXiv 2603.19289, §5.1.3), TPOT over context
lengths at batch 1, each placement measured beside its Eq. 1 bound (moejax.offload.tpot_bound).

Placements, all the layer-by-layer loop so that only where the experts live differs:
- resident: the cached placement with a slot for every expert, warmed up (no copies): the step's compute, Eq. 1's
  compute term;
- cached: --cache-slots slots (default top-k: every layer's experts evict the last one's), experts loaded on demand
  (no predictor: the paper's baseline);
- streamed: every expert of each MoE layer copied each step, --window layers ahead.
(The whole-model resident placement is not the compute term: its step is another program; on a CPU, at a few
tokens, its `auto` expert backend runs every expert.)
Per context length the engines alternate round by round. TPOT, as the paper defines it (the time per output token
after the first), is the slope of the decode loop's seconds (the prefill excluded) between generate(prompt, 1 + n // 2)
and generate(prompt, 1 + n), each length's least over --repeats rounds (the runs least disturbed by other processes;
the loop's constant part cancels; the slope of the medians beside it). The copy term: one expert's copy timed as
`device_put` from the host store (--copy-repeats copies in a row each round, the least round), times the experts the
cached run copied per step (its bytes_h2d counters over the same loops), or every expert (streamed). The bound of each
placement: `overlapped_s` = max(compute, copy), the least TPOT any overlap reaches; `on_demand_s` = compute + copy,
every copy on the critical path (the on-demand cached run's model; on a CPU, where copies and compute share the cores,
every placement's). `--clock cpu` times all of it in this process's CPU seconds instead of wall seconds: on a machine
whose cores other processes share, their load stretches the many small dispatches of a step far more than one large
copy, and CPU seconds keep the two comparable.
On a CPU "host" and "device" are the same RAM: the preset's experts (tiny-wide-experts, 12 MiB each) are wide so that
copying them is not negligible beside computing with them; a large pinned_host -> device copy on XLA:CPU runs well
below the per-expert copy's rate, so the streamed placement measures far above its bound there.
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

import moejax
from launch.bench.offload import decode_loop
from launch.bench.results import no_file
from moejax.engine import Engine
from moejax.kernels.platform import on_gpu
from moejax.offload.host_store import HostStore
from moejax.offload.tpot_bound import tpot_bounds

PLACEMENTS = ("resident", "cached", "streamed")
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}
METHOD = ("TPOT = (least s over rounds of the decode loop of generate(prompt, 1 + n) - the same of generate(prompt, "
          "1 + n // 2)) / (n - n // 2); the loop is the layer loop's decode call (the prefill excluded); the "
          "placements alternate within each round. experts_copied = the loops' bytes_h2d difference / expert bytes / "
          "(n - n // 2). copy_s per expert = s of --copy-repeats block_until_ready(store.fetch_expert(layer, e)) in a "
          "row / --copy-repeats, the least round. compute_s = resident's TPOT. Seconds by --clock: wall, or this "
          "process's CPU seconds (time.process_time).")
PAPER = ("Fig. 8: TPOT of on-demand loading and prefetching, batch 1, prompts of 1K-64K tokens, 32 new tokens, "
         "Qwen3-30B-A3B and others on A6000 / A100 / GH200 behind PCIe 4 or NVLink C2C. Here: the resident, "
         "on-demand cached and streamed placements of a small model on the devices present, against Eq. 1.")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = sub.add_parser("tpot-sweep", help="Speculating Experts' Fig. 8: batch-1 TPOT over context lengths per "
                                          "placement, against Eq. 1's bound")
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="preset or checkpoint (default CPU tiny-wide-experts, GPU "
                                                 "qwen3-30b-a3b)")
    p.add_argument("--num-layers", type=int, default=None, help="first N layers (default GPU 4, CPU all)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="default: GPU bf16, CPU f32")
    p.add_argument("--contexts", default=None, help="prompt lengths (default CPU 64,512; GPU 1024,4096,16384)")
    p.add_argument("--placements", default=",".join(PLACEMENTS), help=f"some of {', '.join(PLACEMENTS)}")
    p.add_argument("--new-tokens", type=int, default=16, help="the longer generation (>= 4; the paper 32)")
    p.add_argument("--cache-slots", type=int, default=None, help="cached: expert slots (default top-k)")
    p.add_argument("--window", type=int, default=1, help="streamed: MoE layers copied ahead")
    p.add_argument("--repeats", type=int, default=3, help="rounds per context length")
    p.add_argument("--copy-repeats", type=int, default=32, help="experts copied one after another in each round, "
                                                                   "timed together")
    p.add_argument("--clock", default="wall", choices=sorted(CLOCKS),
                   help="wall: seconds passed (TPOT); cpu: this process's CPU seconds, which other processes on a "
                        "shared machine disturb less (on a CPU backend only: a GPU's work is not the host's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=None, help="PNG of TPOT and bound over context length (needs matplotlib)")
    p.add_argument("--out", default=None, help="JSON file (default bench/results/tpot-sweep-<device>.json)")


def defaults(args: argparse.Namespace, gpu: bool) -> argparse.Namespace:
    """Fill the device-dependent defaults; a bad value fails here, before any work."""
    args.model = args.model or ("qwen3-30b-a3b" if gpu else "tiny-wide-experts")
    args.dtype = args.dtype or ("bfloat16" if gpu else "float32")
    if args.num_layers is None and gpu:
        args.num_layers = 4
    args.contexts = args.contexts or ("1024,4096,16384" if gpu else "64,512")
    try:
        contexts = [int(v) for v in str(args.contexts).split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--contexts: comma-separated integers, got {args.contexts!r}") from None
    if not contexts or min(contexts) < 1:
        raise ValueError(f"--contexts: prompt lengths >= 1, got {args.contexts!r}")
    args.context_list = sorted(set(contexts))
    placements = [v.strip() for v in str(args.placements).split(",") if v.strip()]
    unknown = [v for v in placements if v not in PLACEMENTS]
    if unknown or "resident" not in placements:
        raise ValueError(f"--placements: some of {', '.join(PLACEMENTS)}, resident among them (the compute term), "
                         f"got {args.placements!r}")
    args.placement_list = [v for v in PLACEMENTS if v in placements]
    if args.new_tokens < 4:
        raise ValueError(f"--new-tokens must be >= 4 (TPOT is a slope between two lengths), got {args.new_tokens}")
    if gpu and args.clock == "cpu":
        raise ValueError("--clock cpu: on a GPU the work is the device's, not this process's CPU time; use wall")
    if args.repeats < 1 or args.copy_repeats < 1:
        raise ValueError("--repeats and --copy-repeats must be >= 1")
    return args


def load_engines(args: argparse.Namespace) -> dict[str, Engine]:
    common: dict[str, Any] = dict(dtype=args.dtype, num_layers=args.num_layers, seed=args.seed,
                                  compilation_cache=False)
    cfg = moejax.load(args.model, placement="resident", **common).config
    moe_layers = sum(cfg.is_moe(i) for i in range(cfg.num_layers))
    every = cfg.num_experts * moe_layers
    options: dict[str, dict[str, Any]] = {
        "resident": dict(placement="cached", cache_slots=every, eviction="lru"),
        "cached": dict(placement="cached", cache_slots=args.cache_slots or cfg.num_experts_per_tok, eviction="lru"),
        "streamed": dict(placement="streamed", window=args.window)}
    return {name: moejax.load(args.model, **options[name], **common) for name in args.placement_list}


def copy_seconds(store: HostStore, copies: int, clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds per expert of `copies` host -> device copies one after another (`device_put` from the store, each
    waited for): a run about as long as a decode loop, so a shared machine disturbs both alike."""
    layer = store.layers[0]
    jax.block_until_ready(store.fetch_expert(layer, 0))  # the first copy warms the path up
    t0 = clock()
    for i in range(copies):
        jax.block_until_ready(store.fetch_expert(layer, i % store.num_experts(layer)))
    return (clock() - t0) / copies


def measure_point(engines: dict[str, Engine], prompt: list[int], new_tokens: int, repeats: int,
                  copy_repeats: int, clock: str = "wall") -> dict:
    """One context length: each placement's TPOT, the experts each copied per step, one expert's copy time and
    Eq. 1's bound per placement from them, all timed by `clock` (CLOCKS)."""
    tick = CLOCKS[clock]
    short, long = 1 + new_tokens // 2, 1 + new_tokens
    for engine in engines.values():  # compile these lengths' shapes, fill the caches (and load the weights)
        for n in (short, long):
            engine.generate([prompt], n, temperature=0.0)
    # the copies are timed from the store whose copies the counters count (the resident row's: the same placement)
    store = engines["cached" if "cached" in engines else "resident"].store
    assert isinstance(store, HostStore) and store.per_expert, "the resident and cached rows are cached engines"
    expert_bytes = store.expert_bytes(store.layers[0])
    loops: dict[str, dict[int, list[float]]] = {name: {short: [], long: []} for name in engines}
    copied: dict[str, list[float]] = {name: [] for name in engines}
    copies: list[float] = []
    for _ in range(repeats):  # the copies timed in each round too: a shared machine's load changes by the second
        for name, engine in engines.items():
            h2d = {}
            for n in (short, long):
                loop = decode_loop(engine, prompt, n, 0.0, 0, tick)
                loops[name][n].append(loop["seconds"])
                h2d[n] = loop["stats"]["total"]["bytes_h2d"]
            copied[name].append((h2d[long] - h2d[short]) / expert_bytes / (long - short))
        copies.append(copy_seconds(store, copy_repeats, tick))
    # the least of the rounds at each length (the runs least disturbed by other processes), their difference per
    # step: the loop's constant part (its setup, the first step) cancels
    measured = {name: (min(v[long]) - min(v[short])) / (long - short) for name, v in loops.items()}
    median = {name: (float(np.median(v[long])) - float(np.median(v[short]))) / (long - short)
              for name, v in loops.items()}
    cfg = engines["resident"].config
    moe_layers = len(store.layers)
    copy_s = min(copies)
    cached_copies = float(np.median(copied["cached"])) if "cached" in engines else 0.0
    bounds = tpot_bounds(max(measured["resident"], 0.0), expert_bytes, expert_bytes / copy_s, moe_layers,
                         cfg.num_experts, cached_copies / moe_layers)
    rows = {name: dict(tpot_s=measured[name], tpot_median_s=median[name],
                       loop_runs_s={str(n): v for n, v in loops[name].items()},
                       experts_copied_per_step=float(np.median(copied[name])), bound=bounds[name].as_dict(),
                       above_bound=measured[name] >= bounds[name].overlapped_s)
            for name in engines}
    return dict(context=len(prompt), clock=clock, lengths=[short, long], expert_bytes=expert_bytes,
                copy_s_per_expert=copy_s, copy_runs_s=copies, copy_gb_per_s=expert_bytes / copy_s / 1e9,
                moe_layers=moe_layers, experts_per_layer=cfg.num_experts, placements=rows)


def tpot_sweep(args: argparse.Namespace, env: dict, partial: Callable[[dict, str], None] = no_file) -> dict:
    """The benchmark: args from this module's parser (argparse defaults plus overrides will do)."""
    gpu = on_gpu()
    defaults(args, gpu)
    t0 = time.perf_counter()
    engines = load_engines(args)
    cfg = engines["resident"].config
    record: dict[str, Any] = dict(
        **env, benchmark="tpot-sweep", paper=PAPER, method=METHOD, bound_module="moejax.offload.tpot_bound",
        config=dict(model=args.model, num_layers=cfg.num_layers, num_experts=cfg.num_experts,
                    experts_per_token=cfg.num_experts_per_tok, hidden_size=cfg.hidden_size,
                    moe_intermediate_size=cfg.moe_intermediate_size, dtype=args.dtype, seed=args.seed),
        settings=dict(contexts=args.context_list, placements=args.placement_list, new_tokens=args.new_tokens,
                      cache_slots=args.cache_slots or cfg.num_experts_per_tok,
                      window=args.window, repeats=args.repeats, copy_repeats=args.copy_repeats,
                      clock=args.clock),
        points=[], wall_s=None)
    rng = np.random.default_rng(args.seed)
    print(f"tpot-sweep: {args.model} ({args.dtype}), placements {', '.join(args.placement_list)}; contexts "
          f"{args.context_list}", flush=True)
    for context in args.context_list:
        prompt = rng.integers(0, cfg.vocab_size, context).tolist()
        point = measure_point(engines, prompt, args.new_tokens, args.repeats, args.copy_repeats, args.clock)
        record["points"].append(point)
        partial(dict(record, wall_s=time.perf_counter() - t0), f"context {context}")
        print(f"  context {context:6d}: copy {point['copy_s_per_expert'] * 1e3:.3f} ms/expert; " + "; ".join(
            f"{name} {row['tpot_s'] * 1e3:.2f} ms (bound {row['bound']['overlapped_s'] * 1e3:.2f}, on demand "
            f"{row['bound']['on_demand_s'] * 1e3:.2f}, {row['experts_copied_per_step']:.1f} experts copied)"
            for name, row in point["placements"].items()), flush=True)
    if args.plot:
        plot(record, args.plot)
        record["plot"] = args.plot
    return dict(record, wall_s=time.perf_counter() - t0)


def plot(record: dict, path: str) -> None:
    """TPOT against context length: each placement measured (solid) and its bound (dashed: overlapped; dotted:
    on demand, the cached run's model)."""
    try:
        import matplotlib  # optional: the plots extra
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install -e '.[plots]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional: the plots extra
    points = record["points"]
    x = [p["context"] for p in points]
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, name in enumerate(record["settings"]["placements"]):
        color = f"C{i}"
        ax.plot(x, [p["placements"][name]["tpot_s"] * 1e3 for p in points], "o-", color=color, label=name)
        ax.plot(x, [p["placements"][name]["bound"]["overlapped_s"] * 1e3 for p in points], "--", color=color,
                label=f"{name} bound (overlapped)")
        if name == "cached":
            ax.plot(x, [p["placements"][name]["bound"]["on_demand_s"] * 1e3 for p in points], ":", color=color,
                    label="cached bound (on demand)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (prompt tokens)")
    ax.set_ylabel("TPOT (ms)")
    ax.set_title(f"Speculating Experts Fig. 8 (there: 1K-64K tokens, A6000/A100/GH200, on demand vs prefetch)\n"
                 f"here: {record['config']['model']} on {record['device']['kind']}, {record['settings']['clock']} "
                 "clock; bounds by Eq. 1", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
