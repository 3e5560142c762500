"""`python -m launch.bench offload --sections decode --placements ...`: every decode placement side by side at one
device memory budget, on the same requests.

The budget is --budget-fraction of the model's weight bytes (default 0.4: 24 GB of qwen3-30b-a3b's 61 GB of
bfloat16 weights is 0.39; on the GPU the model is a slice of its first --num-layers layers with random weights);
the experts of the offloaded placements live in pinned host memory. Placements, in the order they run (the first
ones matter most, so a stopped run keeps them):

  resident       no budget: every weight on the device (the ceiling; its TPOT is the 'compute' of the split below)
  streamed       every MoE layer's experts copied in while the layer before computes (window --window)
  cached-lru     the expert cache, LRU, no predictor: misses loaded when their layer runs (on demand). It also
                 records the true routing of every pass (moejax.offload.predict.lookahead.RoutingRecorder)
  cached-oracle  the cache with the look-ahead oracle: at layer l, layer l+1's true experts from that recording of
                 the same requests (the bound any layer-ahead predictor reaches; random weights route near
                 uniformly, so this measures each mechanism's cost and that bound, not prediction quality)
  lightning      MoE-Lightning: the KV cache in host memory, attention on the host, experts paged (policy N = the
                 batch, mu = N/4, r_w = 0)
  cached-router, cached-expert_map, cached-speculative, cached-router_free: the predictors (as time allows),
                 calibrated on the resident engine (or read from --calibration, made beforehand)

Every placement serves the same workloads through the continuous-batching scheduler (as launch.serve does): --batches
requests at once of --prompt-len random tokens and --new-tokens each (greedy), then one batch-1 row at --long-prompt
tokens. The KV pool is what the budget leaves beside the weights (lightning: host memory), so a placement may
carry fewer rows than asked: 'largest batch' is the most rows one decode step carried. Per row:

  tokens_per_s   output tokens / wall seconds of the run (prefill included)
  ttft_s         wall seconds of the same requests with one output token each (every request's first token)
  tpot_s         decode steps' wall seconds / decode steps (each step gives every running row one token)
  hit_rate       the expert cache's hits / lookups in the decode (the run's counters less the one-token run's)
  split          Speculating Experts' Fig. 7 split of a decode step (arXiv 2603.19289): compute = resident's TPOT
                 at the same workload, copy_waited = seconds the step waited on host -> device copies
                 (engine.stats() wait_s), idle = tpot - compute - copy_waited (dispatch, host work, copies not
                 counted as waits)

Each run is preceded by an untimed one of two output tokens (compilation). Item 'lightning_claim': MoE-Lightning's
(arXiv 2411.11217) claim at a budget where few rows' KV fits beside the weights (--device-rows): lightning's batch
and throughput against streamed's (window 2: the same three layers of experts on the device) and cached's, its
measured ms per layer against the HRM's prediction for the policy it runs (moejax.plan.lightning), and the host
attention kernel's GB/s against a streaming read of the same pool (moejax.lightning.host_attention_bench)."""
from __future__ import annotations

import argparse
import functools
import gc
import os
import shutil
import tempfile
import time
from collections.abc import Callable

import jax
import numpy as np

from launch.bench import offload_modes
from moejax.engine import Engine
from moejax.lightning.host_attention_bench import measure_paged
from moejax.measure.lightning_probe import Probe, explain_engine
from moejax.offload.memory_budget import RESERVE_FRACTION, MemoryBudgetError
from moejax.offload.predict.expert_maps import ExpertMapStore
from moejax.offload.predict.lookahead import LookAheadOracle, RoutingRecorder
from moejax.plan.lightning import LightningPolicy
from moejax.sched.continuous import GenRequest, Scheduler, Stats
from moejax.sched.pool_size import BLOCK, pool_size

PLACEMENTS = ("resident", "streamed", "cached-lru", "cached-oracle", "lightning", "cached-router", "cached-expert_map",
              "cached-speculative", "cached-router_free")
DEFAULT_PLACEMENTS = "resident,streamed,cached-lru,cached-oracle,lightning"
BUDGET_FRACTION = 0.4
PREDICTOR_MODES = {"cached-router": "prefetch", "cached-expert_map": "expert_map", "cached-speculative": "speculative",
                   "cached-router_free": "speculative"}


def add_arguments(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument("--placements", default=None,
                   help=f"decode: run these placements side by side at one budget instead of the cached modes "
                        f"(in order; 'default' = {DEFAULT_PLACEMENTS}); choose from {', '.join(PLACEMENTS)}")
    p.add_argument("--batches", default=None, help="placements: requests served at once (default GPU 1,64,256; "
                                                   "CPU 1,4)")
    p.add_argument("--long-prompt", type=int, default=None, help="placements: one batch-1 row at this prompt "
                                                                 "length (default GPU 4096, CPU 128; 0: none)")
    p.add_argument("--budget-fraction", type=float, default=BUDGET_FRACTION,
                   help="placements: device budget as a fraction of the weight bytes")
    p.add_argument("--device-rows", type=int, default=4,
                   help="placements: lightning's claim runs at a budget holding the KV of this many rows beside the "
                        "weights (0: skip the claim)")
    p.add_argument("--calibration", default=None,
                   help="placements: directory with the predictors' calibration (default vectors, map store) made "
                        "beforehand by --save-calibration (default: calibrate on the resident engine)")
    p.add_argument("--save-calibration", default=None,
                   help="placements: only make the predictors' calibration and write it to this directory (for a "
                        "later run's --calibration; same --model, --num-layers, --dtype, --seed)")


def parse_placements(text: str) -> list[str]:
    names = [n.strip() for n in (DEFAULT_PLACEMENTS if text == "default" else text).split(",") if n.strip()]
    unknown = [n for n in names if n not in PLACEMENTS]
    if unknown or not names:
        raise ValueError(f"--placements: unknown {', '.join(unknown) or '(none given)'} (choose from "
                         f"{', '.join(PLACEMENTS)})")
    if "cached-oracle" in names and "cached-lru" not in names[:names.index("cached-oracle")]:
        raise ValueError("--placements: cached-oracle needs cached-lru before it (its trace is recorded there)")
    return list(dict.fromkeys(names))


def check_arguments(args: argparse.Namespace) -> None:
    """--placements and the calibration directories, before any work."""
    parse_placements(args.placements)
    if args.save_calibration and os.path.exists(args.save_calibration):
        raise ValueError(f"--save-calibration: {args.save_calibration} exists; name a new directory")
    if args.calibration and not all(os.path.isdir(os.path.join(args.calibration, d)) for d in ("vectors", "store")):
        raise ValueError(f"--calibration: {args.calibration} does not hold vectors/ and store/ (made by "
                         "--save-calibration)")
    if not 0 < args.budget_fraction <= 1:
        raise ValueError(f"--budget-fraction must be in (0, 1], got {args.budget_fraction}")


def workloads(args: argparse.Namespace, gpu: bool) -> list[dict]:
    batches = [int(b) for b in (args.batches or ("1,64,256" if gpu else "1,4")).split(",")]
    long = args.long_prompt if args.long_prompt is not None else (4096 if gpu else 128)
    rows = [dict(batch=b, prompt_len=args.prompt_len, new_tokens=args.new_tokens) for b in batches if b <= 64]
    if long:
        rows.append(dict(batch=1, prompt_len=long, new_tokens=args.new_tokens))
    rows += [dict(batch=b, prompt_len=args.prompt_len, new_tokens=args.new_tokens) for b in batches if b > 64]
    return rows


def _requests(work: dict, vocab: int, max_tokens: int, seed: int) -> list[GenRequest]:
    rng = np.random.default_rng(seed + work["batch"] * 7919 + work["prompt_len"])
    key = np.asarray(jax.random.key_data(jax.random.key(seed)))
    return [GenRequest(rng.integers(1, vocab, work["prompt_len"]).tolist(), max_tokens, key, tag=i)
            for i in range(work["batch"])]


def _serve(engine: Engine, requests: list[GenRequest], max_rows: int, before: Callable[[], None]
           ) -> tuple[Stats, list, dict]:
    """One scheduler run of `requests` -> (its Stats, tokens per request, engine.stats() of the run)."""
    size = pool_size(engine, [(len(r.prompt), r.max_tokens) for r in requests])
    out: dict = {}
    options = {"max_rows": max_rows, **engine.placement.scheduler_defaults()}
    before()
    engine.reset_stats()
    stats = Scheduler(engine, size.blocks, **options).run(
        requests, lambda g, t, c: out.__setitem__(g.tag, list(t)), lambda g, m: out.__setitem__(g.tag, m))
    return stats, [out.get(i) for i in range(len(requests))], dict(engine.stats(), kv_pool=size.describe())


def _totals(engine_stats: dict) -> dict:
    t = engine_stats.get("total") or {}
    return {k: v for k, v in t.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def measure(engine: Engine, work: dict, seed: int, *, restart: Callable[[str], None] = lambda kind: None,
            compute_s: float | None = None, reference: list | None = None) -> dict:
    """One placement on one workload: a warm-up run (2 tokens), a one-token run (TTFT) and the full run."""
    vocab = engine.config.vocab_size
    rows = work["batch"]
    runs: dict[str, tuple[Stats, list, dict]] = {}
    t_all = time.perf_counter()
    for kind, n in (("warm", 2), ("ttft", 1), ("full", work["new_tokens"])):
        requests = _requests(work, vocab, n, seed)
        runs[kind] = _serve(engine, requests, rows, functools.partial(restart, kind))
    first, first_tokens, first_engine = runs["ttft"]
    stats, tokens, engine_stats = runs["full"]
    done = [t for t in tokens if isinstance(t, list)]
    generated = sum(map(len, done))
    steps = max(stats.decode_steps, 1)
    tpot = stats.decode_s / steps
    full, one = _totals(engine_stats), _totals(first_engine)
    decode = {k: full[k] - one.get(k, 0) for k in full}  # the decode's counters: the full run's less the prefill's
    looked = decode.get("hits", 0) + decode.get("misses", 0)
    # the full run's waits less the one-token run's: noisy where both prefills waited (clamped at 0; raw kept)
    wait = max(decode.get("wait_s", 0.0), 0.0) / steps
    row = dict(**work, tokens_per_s=generated / stats.run_s, ttft_s=first.run_s, tpot_s=tpot,
               largest_batch=stats.peak_rows, decode_steps=stats.decode_steps, generated_tokens=generated,
               failed=[t for t in tokens if not isinstance(t, list)][:2], run_s=stats.run_s,
               decode_tokens_per_s=stats.decode_rows_useful / stats.decode_s if stats.decode_s else None,
               hit_rate=decode["hits"] / looked if looked else None,
               bytes_h2d_per_step=decode.get("bytes_h2d", 0) / steps if "bytes_h2d" in decode else None,
               split=dict(compute_s=compute_s, copy_waited_s=wait,
                          idle_s=None if compute_s is None else tpot - compute_s - wait),
               kv_pool=engine_stats["kv_pool"], decode_counters=decode, full_run_counters=full,
               scheduler=stats.as_dict(),
               measure_s=time.perf_counter() - t_all)
    if reference is not None:
        row["tokens_equal_resident"] = tokens == reference
    row["_tokens"] = tokens
    return row


def budget_gb(resident: Engine, fraction: float) -> float:
    return fraction * resident.param_bytes() / 2**30


def claim_budget_gb(resident: Engine, rows: int, work: dict) -> float:
    """The smallest budget lightning fits (the non-expert weights and three layers of experts, its double-buffered
    pages and the assembled layer, within the budget less its reserve), raised where needed so that streamed with
    the same three layers keeps room for `rows` sequences' KV (moejax.sched.pool_size: the budget less half the
    reserve, less the weights)."""
    b = resident.memory_budget
    weights = b.resident_bytes + 3 * b.expert_bytes * b.experts_per_layer
    kv = resident.kv_bytes_per_token() * rows * (work["prompt_len"] + work["new_tokens"] + 16)
    return max(weights / (1 - RESERVE_FRACTION), (weights + kv) / (1 - RESERVE_FRACTION / 2)) / 2**30


def _rows_fit(engine: Engine, work: dict) -> int:
    """How many of the workload's sequences the engine's KV pool holds at once (at least 1)."""
    seqs = [(work["prompt_len"], work["new_tokens"])] * work["batch"]
    each = -(-(work["prompt_len"] + work["new_tokens"]) // BLOCK)
    return max(pool_size(engine, seqs).blocks // each, 1)


def lightning_options(work: dict) -> dict:
    n = work["batch"]
    return dict(batch_size=n, micro_batch=max(n // 4, 1), resident_share=0.0, kv_device_share=0.0,
                attention_on="host", plan_seq_len=work["prompt_len"], plan_gen_len=work["new_tokens"])


class Calibration:
    """What the predictor placements need, built once from the resident engine or read from a directory."""

    def __init__(self, resident: Engine, args: argparse.Namespace, log: Callable[[str], None]) -> None:
        self.directory = args.calibration or tempfile.mkdtemp(prefix="moejax-bench-calibration-")
        modes = ["prefetch", "expert_map"]
        if args.calibration:  # made beforehand (--save-calibration) for the same model, seed and layers
            store = ExpertMapStore.load(os.path.join(args.calibration, "store"))
            self.value = offload_modes.Calibration(os.path.join(args.calibration, "vectors"), None, store,
                                                   dict(read_from=args.calibration,
                                                        store=offload_modes.store_size(store)))
            return
        n = args.calibration_prompts or 4
        tokens = args.calibration_tokens or min(args.prompt_len, 256)
        prompts, source = offload_modes.calibration_prompts(resident, "random", n, tokens, args.seed + 3)
        self.value = offload_modes.build(resident, prompts, modes, self.directory, distill_steps=0,
                                         capacity=args.capacity, log=log)
        self.value.record.update(source=source, tokens_each=tokens)
        if args.save_calibration:
            os.makedirs(args.save_calibration, exist_ok=True)
            shutil.copytree(self.value.vectors_path, os.path.join(args.save_calibration, "vectors"),
                            dirs_exist_ok=True)
            assert self.value.store is not None  # built: the expert_map mode needs it
            self.value.store.save(os.path.join(args.save_calibration, "store"))

    def options(self, name: str) -> dict:
        options = offload_modes.engine_options(PREDICTOR_MODES[name], self.value)
        if name == "cached-router_free":
            options.update(router_free=True)
        return options


def _engine_options(name: str, budget: float, args: argparse.Namespace, work: dict, recorder: RoutingRecorder | None,
                    oracle: LookAheadOracle | None, calibration: Calibration | None) -> dict:
    if name == "resident":
        return dict(placement="resident")
    if name == "streamed":
        return dict(placement="streamed", window=args.window, device_memory_gb=budget)
    if name == "lightning":
        return dict(placement="lightning", device_memory_gb=budget, **lightning_options(work))
    options = dict(placement="cached", device_memory_gb=budget, eviction=args.eviction)
    if name == "cached-lru":
        options.update(predictor=recorder)
    elif name == "cached-oracle":
        options.update(predictor=oracle, prefetch_distance=1)
    else:
        assert calibration is not None, f"{name} needs the calibration"
        options.update(calibration.options(name))
    return options


def _print(name: str, row: dict) -> None:
    if "error" in row:
        print(f"  {name:18s} B={row['batch']:<4d} T={row['prompt_len']:<5d} {row['error']}", flush=True)
        return
    s = row["split"]
    hit = "" if row["hit_rate"] is None else f" hit {row['hit_rate']:.3f}"
    same = "" if "tokens_equal_resident" not in row else f" same {row['tokens_equal_resident']}"
    split = "" if s["idle_s"] is None else (f" [compute {s['compute_s'] * 1e3:.2f} wait "
                                            f"{s['copy_waited_s'] * 1e3:.2f} idle {s['idle_s'] * 1e3:.2f} ms]")
    print(f"  {name:18s} B={row['batch']:<4d} T={row['prompt_len']:<5d} {row['tokens_per_s']:9.1f} tok/s  TTFT "
          f"{row['ttft_s'] * 1e3:8.2f} ms  TPOT {row['tpot_s'] * 1e3:8.3f} ms  batch {row['largest_batch']:3d}"
          f"{hit}{split}{same}", flush=True)


def run(args: argparse.Namespace, resident: Engine, gpu: bool, save: Callable[[dict, str], None],
        load: Callable[..., Engine]) -> dict:
    """save(the section so far, last row) after each row; load(**options) loads the benchmark's model."""
    names = parse_placements(args.placements)
    works = workloads(args, gpu)
    budget = args.budget_gb if getattr(args, "budget_gb", None) else budget_gb(resident, args.budget_fraction)
    record: dict = dict(method=__doc__, placements=names, workloads=works, budget_gb=budget,
                        budget_fraction=args.budget_fraction, weight_bytes=resident.param_bytes(),
                        experts_memory="pinned_host", rows=[], refused={})
    print(f"decode placements at {budget:.3f} GiB ({args.budget_fraction:g} of {resident.param_bytes() / 2**30:.3f} "
          f"GiB of weights): {', '.join(names)}; workloads {works}", flush=True)
    recorder, oracle = RoutingRecorder(), LookAheadOracle()
    traces: dict = {}
    references: dict = {}
    compute: dict = {}
    calibration: Calibration | None = None
    if args.save_calibration:  # made beforehand (on CPU) for a later run's --calibration: nothing is timed
        calibration = Calibration(resident, args, lambda m: print(f"  {m}", flush=True))
        record.update(calibration=calibration.value.record, saved_calibration=args.save_calibration, rows=[])
        print(f"  calibration written to {args.save_calibration}: {calibration.value.record}", flush=True)
        return record

    def restart_for(name: str, w: int) -> Callable[[str], None]:
        def restart(kind: str) -> None:
            if name == "cached-lru":  # keep each run's trace for the oracle (the dict the run fills)
                recorder.restart()
                traces[(w, kind)] = recorder.trace
            elif name == "cached-oracle":
                oracle.restart(traces.get((w, kind), {}))
        return restart

    # the placements before the predictors, then lightning's claim, then the predictors (as time allows)
    order = [n for n in names if n not in PREDICTOR_MODES] + ["claim"] + [n for n in names if n in PREDICTOR_MODES]
    for name in order:
        if name == "claim":
            record["ratios_vs_streamed"] = _ratios(record["rows"])
            if args.device_rows:
                record["lightning_claim"] = lightning_claim(args, resident, works, load, save, record)
                save(record, "lightning claim")
            continue
        if name in PREDICTOR_MODES and calibration is None:
            calibration = Calibration(resident, args, lambda m: print(f"  {m}", flush=True))
            record["calibration"] = calibration.value.record
        engine = None
        for w, work in enumerate(works):
            if engine is None or name == "lightning":
                try:
                    engine = resident if name == "resident" else load(
                        **_engine_options(name, budget, args, work, recorder, oracle, calibration))
                except (MemoryBudgetError, ValueError) as e:  # the budget does not hold this placement
                    row = dict(placement=name, **work, error=f"refused: {e}")
                    record["rows"].append(row)
                    record["refused"][name] = str(e)
                    _print(name, row)
                    save(record, f"{name} refused")
                    engine = None
                    if name == "lightning":
                        continue
                    break
            restart = restart_for(name, w)
            try:
                row = measure(engine, work, args.seed, restart=restart, compute_s=compute.get(w),
                              reference=references.get(w))
            except Exception as e:  # noqa: BLE001 - one failing row (device memory, a runtime error) is recorded
                row = dict(placement=name, **work, error=f"{type(e).__name__}: {str(e)[:400]}")
                record["rows"].append(row)
                _print(name, row)
                save(record, f"{name} failed")
                continue
            tokens = row.pop("_tokens")
            if name == "resident":
                references[w], compute[w] = tokens, row["tpot_s"]
            if not name.startswith("cached"):
                row["hit_rate"] = None  # no expert cache: streamed copies every expert, lightning pages them
            if name == "cached-oracle":
                row["oracle"] = dict(served=oracle.served, unmatched=oracle.unmatched)
            row.update(placement=name, description=engine.placement.describe(
                engine.layered_steps if engine.layer_by_layer else None))
            record["rows"].append(row)
            _print(name, row)
            save(record, f"{name} batch {work['batch']} prompt {work['prompt_len']}")
            if name == "lightning":
                del engine
                engine = None
                gc.collect()
        del engine
        gc.collect()
    record["ratios_vs_streamed"] = _ratios(record["rows"])
    return record


def _ratios(rows: list[dict]) -> dict:
    """Each placement's tokens/s over streamed's, per workload."""
    base = {(r["batch"], r["prompt_len"]): r["tokens_per_s"] for r in rows
            if r["placement"] == "streamed" and "error" not in r}
    return {f"{r['placement']} B={r['batch']} T={r['prompt_len']}": r["tokens_per_s"] / base[(r["batch"],
                                                                                            r["prompt_len"])]
            for r in rows if "error" not in r and (r["batch"], r["prompt_len"]) in base}


def lightning_claim(args: argparse.Namespace, resident: Engine, works: list[dict], load: Callable[..., Engine],
                    save: Callable[[dict, str], None], record: dict) -> dict:
    """Lightning, streamed and cached at a budget holding --device-rows rows' KV beside lightning's weights, on the
    largest batch workload at --prompt-len; lightning's measured ms per layer against the HRM's; host attention GB/s."""
    work = max((w for w in works if w["prompt_len"] == args.prompt_len), key=lambda w: w["batch"])
    budget = claim_budget_gb(resident, args.device_rows, work)
    claim: dict = dict(budget_gb=budget, device_rows=args.device_rows, workload=work, rows=[],
                       requests="lightning serves the workload's batch; streamed and cached min(batch, 2 x the rows "
                                "their KV pool holds at once)",
                       target="lightning tokens/s >= 2x streamed's at the same budget (MoE-Lightning, arXiv "
                              "2411.11217)")
    record["lightning_claim"] = claim
    print(f"lightning claim at {budget:.3f} GiB (lightning's smallest, at least {args.device_rows} rows' KV beside "
          f"streamed's weights), "
          f"batch {work['batch']}:", flush=True)
    for name in ("lightning", "streamed", "cached-lru"):
        options = _engine_options(name, budget, args, work, None, None, None)
        if name == "streamed":  # window 2: three layers of experts on the device, as lightning holds
            options["window"] = 2
        try:
            engine = load(**options)
        except (MemoryBudgetError, ValueError) as e:
            claim["rows"].append(dict(placement=name, error=f"refused: {e}"))
            continue
        # streamed and cached carry only the rows their KV pool holds: more requests than two waves of them repeat
        # the same steady state, and would spend the time a GPU check has
        served = work if name == "lightning" else dict(work, batch=min(work["batch"], 2 * _rows_fit(engine, work)))
        try:
            row = measure(engine, served, args.seed)
        except Exception as e:  # noqa: BLE001 - recorded, and the next placement runs
            claim["rows"].append(dict(placement=name, **served, error=f"{type(e).__name__}: {str(e)[:400]}"))
            continue
        row.pop("_tokens")
        row["placement"] = name
        if not name.startswith("cached"):
            row["hit_rate"] = None
        if name == "lightning":
            row["hrm"] = _hrm(engine, explain_engine, args, row)
        claim["rows"].append(row)
        _print(name, row)
        save(record, f"claim {name}")
        del engine
        gc.collect()
    got = {r["placement"]: r for r in claim["rows"] if "error" not in r}
    if "lightning" in got:
        claim["ratio_vs"] = {k: got["lightning"]["tokens_per_s"] / r["tokens_per_s"] for k, r in got.items()
                             if k != "lightning"}
        claim["largest_batch"] = {k: r["largest_batch"] for k, r in got.items()}
    cfg = resident.config
    ctx = work["prompt_len"] + work["new_tokens"] // 2
    try:
        claim["host_attention"] = measure_paged(
            "gqa", batch=min(work["batch"], 64), context=ctx, heads=cfg.num_heads,
            kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype=args.dtype, repeats=3)
        h = claim["host_attention"]
        h["fraction_of_read"] = h["gb_per_s"] / h["read_gb_per_s"]
        print(f"  host attention {h['gb_per_s']:.2f} GB/s vs streaming read {h['read_gb_per_s']:.2f} GB/s "
              f"({h['fraction_of_read']:.2f}) on {os.cpu_count()} cores", flush=True)
    except Exception as e:  # noqa: BLE001 - a record of why, not a crash of the benchmark
        claim["host_attention"] = dict(error=f"{type(e).__name__}: {e}")
    return claim


def _hrm(engine: Engine,
         explain_engine: Callable[[Engine, str | None], tuple[list[str], Probe, LightningPolicy | None]],
         args: argparse.Namespace, row: dict) -> dict:
    """Lightning's probed ms per layer, the measured decode step per layer, and the HRM's prediction."""
    layers = engine.config.num_layers
    lines, probe, predicted = explain_engine(engine, getattr(args, "profile", None))
    out: dict = dict(measured_ms_per_layer=row["tpot_s"] / layers * 1e3, probe=probe.as_dict(), probe_text=lines)
    if predicted is not None:
        out.update(predicted_ms_per_layer=predicted.decode.total_s * 1e3, predicted_profile=predicted.hardware,
                   predicted_bound=predicted.bound, predicted_tokens_per_s=predicted.decode_tokens_per_s)
        out["measured_over_predicted"] = out["measured_ms_per_layer"] / out["predicted_ms_per_layer"]
    else:
        out["predicted"] = "no hardware profile for this device (the lines say why)"
    return out
