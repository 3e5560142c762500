"""`python -m launch.bench layouts`: each parallel layout (moejax.layout) on the devices present, against
the one-device resident model loaded in the same run.

Per layout: load, one warm-up call (compilation), then --repeats timed calls of the forward (`engine.logits` on
CPU; on a GPU `engine.generate(rows, 1)`, a prefill with the head on the last position only, since the full logits
of a large batch outgrow the device and their copy back would dominate; --call picks either); tokens/s and the
ratio to the one-device model; and the bytes each device sends per layer, analytic (moejax.costs.layout_comm: as
implemented, and MoE-Prefill Table 1's figure) next to measured:
- single-program layouts: the collectives of the compiled full-logits step (moejax.sharding.hlo_comm), those
  inside the routed experts' shard_map programs per MoE layer, the rest per layer ("attention");
- pipeline (attn=pp,experts=pp): the collective-permutes of the compiled full-logits step (its stage program is
  one shard_map), per layer as "attention"; it runs prefill-only scoring, so its timed call is always
  `engine.logits` (the row's `call` says so);
- dep: `engine.stats()` of one forward (A->E and E->A bytes between the groups, padding included), per MoE layer
  and per sending device, plus the collectives of the expert group's compiled program (EP inside the group);
- async_ep with placement=streamed: the collectives of one MoE layer's compiled program (it all-gathers the next
  layer's experts; in steady state every MoE layer is gathered once per pass) and the host -> device bytes.
Every shape is the padded one the engine runs (batch and sequence rounded up to powers of two).

A spec may carry the load options `placement=` and `window=` (AsyncEP's two-channel pipeline:
"attn=dp,experts=async_ep,placement=streamed,window=1"); specs in --layouts are separated by ';'.

With a single device this exits with the command that simulates 8 CPU devices (no re-exec: the flag must be set
before JAX starts, and a re-exec would hide it from the recorded command). Simulated CPU devices share the same
cores and memory: their times and ratios say nothing about GPUs; only the byte counts carry over.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import os
from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

import moejax
from launch.bench.results import no_file
from launch.bench.util import time_calls, timed_call
from moejax.buckets import bucket, rows_bucket
from moejax.config import ModelConfig
from moejax.costs import by_kind, layout_comm
from moejax.engine import MIN_SEQ_BUCKET, Engine
from moejax.kernels.platform import on_gpu
from moejax.layout import Layout
from moejax.models.checkpoint import read_config
from moejax.offload import layered_steps
from moejax.presets import preset_config
from moejax.sharding import hlo_comm
from moejax.sharding.gathered import GatheredStreamed

GPU_MODEL, CPU_MODEL = "qwen3-30b-a3b", "tiny-qwen3-moe"
SIMULATE = "XLA_FLAGS=--xla_force_host_platform_device_count=8"
LOAD_KEYS = ("placement", "window")  # load options a spec may carry next to the layout keys
NOTE_CPU = ("Simulated CPU devices share the same cores and memory: the times and ratios below say nothing about "
            "GPUs. Only the byte counts carry over to real devices.")


@dataclasses.dataclass(frozen=True)
class Case:
    spec: str  # as given
    layout: Layout  # resolved against the model and the devices
    load: dict  # extra load options (placement, window)

    @property
    def streamed(self) -> bool:
        return self.load.get("placement") == "streamed"

    @property
    def label(self) -> str:
        lay = self.layout
        if lay.experts == "dep":
            return f"dep {lay.attn_devices}+{lay.expert_devices} r1={lay.r1} r2={lay.r2} {lay.order}"
        name = f"{lay.attn}/{lay.experts}" + (f" M={lay.microbatches}" if lay.attn == "pp" else "")
        if lay.experts == "ep":
            name += " a2a" if lay.exchange == "all_to_all" else " gather"
        if self.streamed:
            name += f" streamed w={self.load.get('window', 1)}"
        return name + ("" if lay.devices == jax.device_count() else f" ({lay.devices} dev)")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = sub.add_parser("layouts", help="each parallel layout: tokens/s vs one device, bytes per layer vs analytic")
    p.add_argument("--model", default=None, help=f"preset or HF directory (default GPU {GPU_MODEL}, CPU {CPU_MODEL})")
    p.add_argument("--num-layers", type=int, default=None, help="first N layers (default GPU 4, CPU all)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="default: GPU bf16, CPU f32")
    p.add_argument("--batch", type=int, default=None, help="rows per step (default: the device count)")
    p.add_argument("--seq", type=int, default=None, help="tokens per row (default GPU 1024, CPU 128)")
    p.add_argument("--call", default=None, choices=["logits", "prefill"],
                   help="timed call: engine.logits or engine.generate(rows, 1) (default CPU logits, GPU prefill)")
    p.add_argument("--layouts", default=None,
                   help="';'-separated layout specs (default: every layout that fits the devices present)")
    p.add_argument("--repeats", type=int, default=None, help="timed calls per layout (default 10)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON file (default bench/results/layouts-<device>.json)")
    return p


def model_config(model: str, num_layers: int | None) -> ModelConfig:
    """The config moejax.load builds, without loading weights (flags are checked before any work)."""
    cfg = ModelConfig.from_hf(read_config(model) if os.path.isdir(model) else preset_config(model))
    return cfg.replace(num_layers=num_layers) if num_layers else cfg


def _largest_divisor(n: int, at_most: int, at_least: int = 1) -> int | None:
    return next((d for d in range(at_most, at_least - 1, -1) if n % d == 0), None)


def default_specs(cfg: ModelConfig, n: int) -> list[str]:
    """Every layout that fits `n` devices: attn=tp on the most devices that divide the heads; DEP with half the
    devices (or the nearest that divides the experts) as its expert group; the pipeline over all n (when the model
    has n layers or more)."""
    E, width = cfg.num_experts, cfg.moe_intermediate_size or 0
    specs = ["attn=dp,experts=replicated"]
    specs += ["attn=dp,experts=tp"] if width and width % n == 0 else []
    if E % n == 0:
        specs += ["attn=dp,experts=ep", "attn=dp,experts=ep,exchange=gather", "attn=dp,experts=async_ep"]
    tp = _largest_divisor(cfg.num_heads, n, 2)
    if tp:
        devices = "" if tp == n else f",devices={tp}"
        specs += [f"attn=tp,experts=tp{devices}"] if width and width % tp == 0 else []
        specs += [f"attn=tp,experts=ep{devices}"] if E % tp == 0 else []
    b = _largest_divisor(E, n // 2)
    if b:  # the same groups three ways: r1/r2 split and the two orders
        groups = f"attn=dp,experts=dep,attn_devices={n - b},expert_devices={b}"
        specs += [f"{groups},r1=1,r2=1,order=asas", f"{groups},r1=2,r2=2,order=asas", f"{groups},r1=2,r2=2,order=aass"]
    if E % n == 0:
        specs.append("attn=dp,experts=async_ep,placement=streamed,window=1")
    if cfg.num_layers >= n:
        specs.append("attn=pp,experts=pp")
    return specs


def parse_case(spec: str, cfg: ModelConfig, n: int) -> Case:
    """A spec -> Case (ValueError with the Layout's text for a bad one)."""
    layout_parts, load = [], {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, _, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if key == "window" and not (value.isdigit() and int(value) >= 1):
            raise ValueError(f"layout {spec!r}: window must be an int >= 1, got {value!r}")
        if key in LOAD_KEYS:
            load[key] = int(value) if key == "window" else value
        else:
            layout_parts.append(part)
    layout = Layout.parse(",".join(layout_parts)).resolve(cfg.num_experts or 1, n,
                                                          expert_width=cfg.moe_intermediate_size or 0,
                                                          heads=cfg.num_heads, layers=cfg.num_layers)
    if load and not (layout.experts == "async_ep" and load.get("placement") == "streamed"):
        raise ValueError(f"layout {spec!r}: placement/window combine with a layout only as experts=async_ep, "
                         "placement=streamed")
    return Case(spec, layout, load)


def analytic(cfg: ModelConfig, case: Case, B: int, T: int, itemsize: int) -> dict:
    """moejax.costs.layout_comm per device by collective kind, as means over one forward: attention per layer,
    experts per MoE layer (ValueError: a shape it refuses)."""
    comm = layout_comm(cfg, case.layout, B, T, itemsize)
    moe = comm.moe_layers
    # streamed AsyncEP gathers every MoE layer once per pass (the last layer's program gathers the first for the
    # next pass); the resident one keeps the first layer whole
    experts = by_kind(comm.experts, moe) if case.streamed else comm.step_by_kind("experts")
    return dict(modelled=True, attention=_per(comm.step_by_kind("attention"), comm.layers),
                experts=_per(experts, moe), experts_past_first_layer=comm.layer_by_kind("experts"),
                ideal_attention=comm.ideal_attention, ideal_experts=comm.ideal_experts, layers=comm.layers,
                moe_layers=moe, transfers=comm.as_dict())


def _per(by_kind: dict, times: int) -> dict:
    return {kind: v / times for kind, v in by_kind.items()} if times else {}


def measured_hlo(engine: Engine, B: int, T: int) -> dict:
    """The compiled full-logits step's collectives: inside the expert programs per MoE layer, the rest per layer
    (means over the step); the pipeline's, all inside its stage program, per layer."""
    logits = engine.steps.logits
    if not hasattr(logits, "lower"):
        raise ValueError(f"layout {engine.layout}: its logits step is no single program to lower")
    text = logits.lower(engine.params, jax.ShapeDtypeStruct((B, T), jnp.int32)).compile().as_text()
    assert text is not None, "XLA gives the compiled program's text"
    found = hlo_comm.collectives(text)
    if engine.layout is not None and engine.layout.attn == "pp":
        return dict(source="collectives of the compiled full-logits step (the pipeline's stage program)",
                    collectives=len(found), experts={},
                    attention=_per(hlo_comm.bytes_by_kind(found), engine.config.num_layers))
    return dict(source="collectives of the compiled full-logits step", collectives=len(found),
                attention=_per(hlo_comm.bytes_by_kind(found, in_shard_map=False), engine.config.num_layers),
                experts=_per(hlo_comm.bytes_by_kind(found, in_shard_map=True), sum(engine.config.moe_layers)))


def measured_dep(engine: Engine, run_forward: Callable[[], object]) -> dict:
    """One forward's counters between the groups (A->E per attention device + E->A per expert device, as
    moejax.costs counts DEP's "device_put"), and the collectives of the expert group's compiled program summed over
    every token chunk of the forward (compiled once per chunk shape). Means per MoE layer."""
    placement: Any = engine.layered_steps.placement  # Disaggregated, whose run the bench wraps to record chunks
    chunks: list[tuple[int, tuple]] = []

    def run(layer: int, *arrays: jax.Array) -> Any:  # records each chunk's shapes on its way to the expert group
        chunks.append((layer, tuple((a.shape, a.dtype) for a in arrays)))
        return type(placement).run(placement, layer, *arrays)
    placement.run = run
    engine.reset_stats()
    try:
        run_forward()
    finally:
        del placement.run  # back to the class's method
    stats = engine.stats()["total"]
    lay, moe = engine.layout, sum(engine.config.moe_layers)
    assert lay is not None, "a DEP layout"
    program: dict = {}  # chunk shapes -> bytes by kind of one run of the expert program
    inner: dict = {}
    for layer, shapes in chunks:
        if shapes not in program:
            into, program_of, _ = placement.route()
            args = [jax.ShapeDtypeStruct(shape, dtype, sharding=into) for shape, dtype in shapes]
            text = program_of.lower(*args, placement.store.fetch(layer)).compile().as_text()
            program[shapes] = hlo_comm.bytes_by_kind(hlo_comm.collectives(text))
        for kind, v in program[shapes].items():
            inner[kind] = inner.get(kind, 0.0) + v
    a2e, e2a = stats["a2e_bytes"] / moe / lay.attn_devices, stats["e2a_bytes"] / moe / lay.expert_devices
    return dict(source="engine.stats() of one forward (device_put A->E, E->A) and the expert group's compiled "
                       "program over every chunk", stats_total=stats, chunks=len(chunks),
                a2e_per_attention_device=a2e, e2a_per_expert_device=e2a,
                experts={"device_put": a2e + e2a, **_per(inner, moe)}, attention={})


def measured_streamed(engine: Engine, run_forward: Callable[[], object]) -> dict:
    """AsyncEP streamed: the collectives of one MoE layer's compiled program (captured from a forward), and the
    host -> device bytes of one forward from engine.stats()."""
    placement = engine.layered_steps.placement
    assert isinstance(placement, GatheredStreamed), "AsyncEP streamed runs its layers through GatheredStreamed"
    captured: dict[str, tuple[layered_steps.Layer, tuple, dict]] = {}
    call = layered_steps.Layer.__call__

    # the arguments of one MoE layer's program, compiled below
    def capture(self: layered_steps.Layer, fn: Callable[..., Any], *args: Any, **static: Any) -> Any:
        if fn is placement._step and args[-1] is not None:
            captured.setdefault("call", (self, args, static))
        return call(self, fn, *args, **static)
    layered_steps.Layer.__call__ = capture  # type: ignore[method-assign]  # every layer's call, capturing, until restored
    engine.reset_stats()
    try:
        run_forward()
    finally:
        layered_steps.Layer.__call__ = call  # type: ignore[method-assign]  # the class's own again
    stats = engine.stats()["total"]
    layer, args, static = captured["call"]
    program = cast(jax.stages.Wrapped, layer._mine[placement._step])  # a jit (layered_steps.Layer)
    text = program.lower(layer.state, *args, **static).compile().as_text()
    assert text is not None, "XLA gives the compiled program's text"
    moe_layers = sum(engine.config.moe_layers)
    return dict(source="collectives of one MoE layer's compiled program; engine.stats() of one forward",
                experts=hlo_comm.bytes_by_kind(hlo_comm.collectives(text)), attention={},
                h2d_bytes_per_moe_layer_all_devices=stats["bytes_h2d"] / moe_layers, stats_total=stats)


def _same(a: dict | None, b: dict | None) -> bool | None:
    if a is None or b is None:
        return None
    a, b = ({k: v for k, v in d.items() if v} for d in (a, b))
    return a.keys() == b.keys() and all(math.isclose(a[k], b[k], rel_tol=1e-6) for k in a)


def _kib(v: float | None) -> str:
    return "-" if v is None else f"{v / 1024:.1f}"


def _kinds(by_kind: dict | None) -> str:
    if by_kind is None:
        return "not modelled"
    return ", ".join(f"{k} {v / 1024:.1f} KiB" for k, v in sorted(by_kind.items()) if v) or "none"


def _defaults(args: argparse.Namespace, gpu: bool) -> None:
    args.model = args.model or (GPU_MODEL if gpu else CPU_MODEL)
    args.dtype = args.dtype or ("bfloat16" if gpu else "float32")
    args.call = args.call or ("prefill" if gpu else "logits")
    args.repeats = args.repeats or 10
    args.seq = args.seq or (1024 if gpu else 128)
    args.batch = args.batch or jax.device_count()
    if args.num_layers is None and gpu:
        args.num_layers = 4


def check_args(args: argparse.Namespace) -> tuple[ModelConfig, list[Case], dict]:
    """Everything a run needs, checked before loading anything: (config, cases, analytic by spec)."""
    for flag in ("batch", "seq", "repeats", "num_layers"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    cfg = model_config(args.model, args.num_layers)
    if not cfg.num_experts:
        raise ValueError(f"--model {args.model}: not a mixture-of-experts model")
    n = jax.device_count()
    specs = [s.strip() for s in args.layouts.split(";") if s.strip()] if args.layouts else default_specs(cfg, n)
    if not specs:
        raise ValueError("--layouts: no layout given")
    cases, figures = [], {}
    T = bucket(args.seq, MIN_SEQ_BUCKET)
    itemsize = jnp.dtype(args.dtype).itemsize
    for spec in specs:
        try:
            case = parse_case(spec, cfg, n)
        except ValueError as e:
            raise ValueError(f"--layouts: {e}") from None
        B = rows_bucket(args.batch, case.layout.row_multiple)  # the shape the engine runs
        try:
            figures[spec] = analytic(cfg, case, B, T, itemsize)
        except ValueError as e:
            raise ValueError(f"--batch {args.batch} (runs as {B}) with layout {spec!r}: {e}") from None
        cases.append(case)
    return cfg, cases, figures


def _run_case(case: Case, args: argparse.Namespace, ids: np.ndarray, figures: dict, baseline_tps: float | None) -> dict:
    engine = moejax.load(args.model, dtype=args.dtype, num_layers=args.num_layers, seed=args.seed,
                         compilation_cache=False, layout=case.layout if case.spec else None, **case.load)
    call = "logits" if case.layout.attn == "pp" else args.call  # the pipeline is prefill-only scoring
    run = timed_call(engine, call, ids)
    first, runs, other = time_calls(run, args.repeats)
    median = float(np.median(runs))
    tps = ids.size / median
    B, T = rows_bucket(ids.shape[0], case.layout.row_multiple), bucket(ids.shape[1], MIN_SEQ_BUCKET)
    if case.layout.experts == "dep":
        measured = measured_dep(engine, run)
    elif case.streamed:
        measured = measured_streamed(engine, run)
    else:
        measured = measured_hlo(engine, B, T)
    del engine
    gc.collect()
    return dict(spec=case.spec, label=case.label, layout=str(case.layout), load=case.load, call=call,
                devices=case.layout.devices, tokens_per_s=tps,
                ratio_to_one_device=None if baseline_tps is None else tps / baseline_tps,
                seconds_median=median, seconds_min=min(runs), seconds=runs, first_call_s=first,
                other_processes_cpu_share=other, analytic=figures, measured=measured,
                attention_equal=_same(figures.get("attention"), measured["attention"]) if figures["modelled"] else None,
                experts_equal=_same(figures.get("experts"), measured["experts"]) if figures["modelled"] else None)


HEADER = (f"  {'layout':30s} {'dev':>3s} {'tok/s':>9s} {'x1dev':>6s} {'other':>5s} | "
          f"{'attention KiB/dev/layer':^23s} | {'experts KiB/dev/MoE layer':^25s} | equal")
SUBHEAD = (f"  {'':30s} {'':3s} {'':9s} {'':6s} {'CPU':>5s} | {'analyt':>7s} {'Tab1':>7s} {'meas':>7s} | "
           f"{'analyt':>8s} {'Tab1':>7s} {'meas':>8s} | att/exp")

LEGEND = ("  analyt: moejax.costs.layout_comm as implemented (padded buffers, routing metadata, float32 partial sums); "
          "Tab1: MoE-Prefill Table 1 (useful traffic only; DEP: useful A->E + E->A); meas: collectives of the compiled "
          "program(s) (DEP also its device_put counters); experts: mean over the MoE layers of one forward; "
          "equal: analytic == measured by collective kind")


def _row_line(r: dict) -> str:
    a, m = r["analytic"], r["measured"]
    total = lambda d: None if d is None else sum(d.values())  # noqa: E731
    equal = "/".join({True: "yes", False: "NO", None: "-"}[r[k]] for k in ("attention_equal", "experts_equal"))
    ratio = "-" if r["ratio_to_one_device"] is None else f"{r['ratio_to_one_device']:.2f}"
    return (f"  {r['label']:30s} {r['devices']:3d} {r['tokens_per_s']:9.0f} {ratio:>6s} "
            f"{r['other_processes_cpu_share']:5.0%} | {_kib(total(a.get('attention'))):>7s} "
            f"{_kib(a.get('ideal_attention')):>7s} {_kib(total(m['attention'])):>7s} | "
            f"{_kib(total(a.get('experts'))):>8s} {_kib(a.get('ideal_experts')):>7s} {_kib(total(m['experts'])):>8s} | "
            f"{equal}")


def layouts(args: argparse.Namespace, env: dict, partial: Callable[[dict, str], None] = no_file) -> dict:
    gpu = on_gpu()
    if jax.device_count() < 2:
        raise SystemExit("layouts: one device present; the layouts need two or more. "
                         + (f"On CPU, simulate 8: {SIMULATE} python -m launch.bench layouts ..." if not gpu else ""))
    _defaults(args, gpu)
    try:
        cfg, cases, figures = check_args(args)
    except (ValueError, KeyError) as e:
        raise SystemExit(f"layouts: {e.args[0] if isinstance(e, KeyError) else e}") from None
    simulated = jax.devices()[0].platform == "cpu"
    ids = np.random.default_rng(args.seed).integers(0, cfg.vocab_size, (args.batch, args.seq))
    B, T = bucket(args.batch), bucket(args.seq, MIN_SEQ_BUCKET)
    print(f"layouts: {args.model} ({cfg.num_layers} layers, {sum(cfg.moe_layers)} MoE, {cfg.num_experts} experts, "
          f"hidden {cfg.hidden_size}, {args.dtype}) on {jax.device_count()} {jax.devices()[0].device_kind} devices; "
          f"batch {args.batch} x seq {args.seq} (runs as {B} x {T}), {args.call}, median of {args.repeats}", flush=True)
    if simulated:
        print(f"NOTE: {NOTE_CPU}", flush=True)

    def record() -> dict:
        return dict(**env, benchmark="layouts", xla_flags=os.environ.get("XLA_FLAGS"),
                    note=NOTE_CPU if simulated else "", units="bytes sent per device per layer (ring convention of "
                    "moejax.costs); tokens_per_s = batch * seq / median seconds of the timed call",
                    config=dict(model=args.model, model_type=cfg.model_type, num_layers=cfg.num_layers,
                                moe_layers=sum(cfg.moe_layers), num_experts=cfg.num_experts,
                                experts_per_token=cfg.num_experts_per_tok, hidden_size=cfg.hidden_size,
                                moe_intermediate_size=cfg.moe_intermediate_size, num_heads=cfg.num_heads,
                                dtype=args.dtype, batch=args.batch, seq=args.seq, padded_batch=B, padded_seq=T,
                                call=args.call, repeats=args.repeats, seed=args.seed),
                    rows=rows)
    baseline = _run_case(Case("", Layout(), {}), args, ids, dict(modelled=False), None)
    baseline.update(label="one device (resident)", layout=None, devices=1, ratio_to_one_device=1.0)
    rows = [baseline]
    partial(record(), baseline["label"])
    print(HEADER + "\n" + SUBHEAD + "\n" + _row_line(baseline), flush=True)
    for case in cases:
        try:
            row = _run_case(case, args, ids, figures[case.spec], baseline["tokens_per_s"])
        except Exception as e:  # one layout failing (e.g. out of memory) must not lose the others
            print(f"  {case.label:30s} FAILED: {type(e).__name__}: {e}", flush=True)
            rows.append(dict(spec=case.spec, label=case.label, layout=str(case.layout),
                             error=f"{type(e).__name__}: {e}"))
            partial(record(), case.label)
            continue
        rows.append(row)
        partial(record(), case.label)
        print(_row_line(row), flush=True)
    print(LEGEND)
    print("details (bytes per device, means per layer / MoE layer as above):")
    for r in rows[1:]:
        if "error" in r:
            continue
        a, m = r["analytic"], r["measured"]
        print(f"  {r['label']}: experts analytic {_kinds(a['experts'])}; measured {_kinds(m['experts'])}"
              + (f"; attention analytic {_kinds(a['attention'])}; measured {_kinds(m['attention'])}"
                 if a["attention"] or m["attention"] else ""))
        if _same(a["experts_past_first_layer"], a["experts"]) is False:
            print(f"    a MoE layer past the first: analytic {_kinds(a['experts_past_first_layer'])} (the first one's "
                  "experts are whole on every device: nothing to gather)")
        if "h2d_bytes_per_moe_layer_all_devices" in m:
            print(f"    host -> device {m['h2d_bytes_per_moe_layer_all_devices'] / 1024:.1f} KiB per MoE layer "
                  "(all devices together)")
    if simulated and args.dtype != "float32":
        print("  (XLA:CPU widens 16-bit collectives to float32: measured exceeds analytic here)")
    if simulated:
        print(f"NOTE: {NOTE_CPU}")
    return record()
