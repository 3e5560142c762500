"""`launch.bench offload --sections fmoe`: fMoE's sensitivity rows, measured as batch-1 decode TPOT with the cached
placement (fMoE, arXiv 2502.05370, §6.5-6.6):

- slots: TPOT against the expert cache's size, on demand (LRU only) and with the calibrated expert maps (T+S+δ).
- distance: TPOT against the prefetch distance d, one calibrated store per d (built from the same traces).
- policy: the store's replacement ablation, online (each store starts empty, the router predictor stands in until it
  holds maps, every pass served adds its maps) at a small capacity, so that maps are replaced while serving: §4.4's
  redundancy against "hits" (a new map replaces the least chosen one).

Each row runs bench_offload's decode case (TTFT, TPOT slope, the cache's counters)."""
from __future__ import annotations

import argparse
import copy
import gc
import os
import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np
from flax import nnx

from launch.bench import offload_modes
from moejax.engine import Engine
from moejax.offload.cached import CachedExpertsRuntime
from moejax.offload.predict import DefaultVectors, RouterPredictor
from moejax.offload.predict.expert_maps import ExpertMapPredictor, ExpertMapStore, build_store
from moejax.offload.predict.traces import record


def _values(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{what}: comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{what}: integers >= 1, got {text!r}")
    return values


def fmoe(args: argparse.Namespace, resident: Engine, save: Callable[[dict, str], None], *,
         load: Callable[..., Engine], decode_case: Callable[..., dict]) -> dict:
    """save(the section so far, row) after each measured row; load(args, **options) -> engine and
    decode_case(name, engine, prompt, args, reference) -> row are bench_offload's."""
    cfg = resident.config
    moe_layers = sum(cfg.is_moe(i) for i in range(cfg.num_layers))
    k, E = cfg.num_experts_per_tok, cfg.num_experts
    slot_counts = _values(args.fmoe_slots, "--fmoe-slots") if args.fmoe_slots else sorted(
        {max(2 * k, E * moe_layers * f // 8) for f in (1, 2, 4, 6)})
    distances = [d for d in _values(args.fmoe_distances, "--fmoe-distances") if d < moe_layers]
    slots = args.cache_slots or max(2 * k, E * moe_layers // 2)
    rng = np.random.default_rng(args.seed + 1)
    prompt = rng.integers(0, cfg.vocab_size, args.prompt_len).tolist()
    n_cal = args.calibration_prompts or (2 if args.quick else 8)
    len_cal = args.calibration_tokens or (64 if args.quick else 256)
    cal_prompts, source = offload_modes.calibration_prompts(resident, args.prompts, n_cal, len_cal, args.seed + 3)
    traces, vectors = record(resident, cal_prompts, max_tokens_per_prompt=len_cal, max_tokens=2 ** 62)
    embed = np.asarray(nnx.merge(resident.graphdef, resident.params).embed[...], np.float32)
    stores = {d: build_store(traces, embed, capacity=args.capacity, distance=d) for d in distances}
    print(f"fmoe: batch 1 greedy, prompt {args.prompt_len} tokens, {args.new_tokens} new; {len(traces.tokens)} "
          f"calibration tokens ({source}); slots {slot_counts}, distances {distances}, online capacity "
          f"{args.fmoe_capacity}", flush=True)
    rows: list[dict] = []
    reference = decode_case("resident", resident, prompt, args)["tokens"]

    def run(name: str, sweep: str, value: int, cache_slots: int, **options: Any) -> None:
        engine = load(args, placement="cached", cache_slots=cache_slots, eviction=args.eviction, **options)
        row = decode_case(f"{name} {sweep}={value}", engine, prompt, args, reference)
        runtime = engine.layered_steps.placement
        assert isinstance(runtime, CachedExpertsRuntime), "placement cached"
        predictor = runtime.predictor
        if isinstance(predictor, ExpertMapPredictor):
            predictor.drain()
            row["store"] = dict(offload_modes.store_size(predictor.store), policy=predictor.store.policy,
                                hits=int(predictor.store.hits.sum()))
        rows.append(dict(row, sweep=sweep, value=value, predictor=name, cache_slots=cache_slots))
        save(dict(rows=rows), row["mode"])
        del engine
        gc.collect()

    def maps(d: int) -> ExpertMapPredictor:  # update=False: every timed run serves the calibration store
        return ExpertMapPredictor(copy.deepcopy(stores[d]), update=False)

    for n in slot_counts:
        run("on-demand", "slots", n, n)
        run("expert_map", "slots", n, n, predictor=maps(1 if 1 in stores else distances[0]), prefetch_distance=1)
    for d in distances:
        run("expert_map", "distance", d, slots, predictor=maps(d), prefetch_distance=d)
    with tempfile.TemporaryDirectory(prefix="moejax-bench-fmoe-") as tmp:
        path = vectors.save(os.path.join(tmp, "vectors"))
        for policy in ("redundancy", "hits"):
            store = ExpertMapStore.unsized(args.fmoe_capacity, 1, policy)
            fallback = RouterPredictor(DefaultVectors.load(path))
            run(f"expert_map-online-{policy}", "capacity", args.fmoe_capacity, slots,
                predictor=ExpertMapPredictor(store, fallback=fallback), prefetch_distance=1)
    return dict(batch=1, prompt_len=args.prompt_len, new_tokens=args.new_tokens, eviction=args.eviction,
                default_slots=slots, calibration=dict(prompts=len(cal_prompts), tokens_each=len_cal, source=source),
                note=__doc__, rows=rows)
