"""`python -m launch.tune_gmm`: the grouped GEMM tuning sweep, sized for one GPU call of at most 3 minutes.

For each shape class (mean rows per expert at Qwen3-30B-A3B's expert shapes: T = 8K, 1K and 32K tokens routed
to 8 of 128 experts, most important first) it times, side by side on fresh random bf16 data:
  - a dense matmul of the same FLOPs (the ratio's denominator),
  - the Pallas Triton kernel, fused gate/up ("glu") and plain ("gemm", at the gate/up shape: the product
    `launch.bench kernels` compares with dense), over candidate tiles, warps, stages and grid orders,
  - the Mosaic GPU kernel over candidate tiles and stages,
  - the whole expert FFN with each backend's best configuration, which decides `auto` for the FFN,
  - as an anchor only, JAX's own Mosaic GPU ragged dot (jax.experimental.pallas.ops.gpu.ragged_dot_mgpu).
Each call's time is the median over rounds of 5 back-to-back calls (async dispatch: launch gaps hidden, as in
the engine), on two input sets in turn. The results file is rewritten after every measurement (`partial` until
the end), and the sweep stops starting configurations at --budget-s.

Results go to bench/results/tune_gmm-<device>.json (`--out`), one run appended to its `runs`, written as it goes
(launch.bench.results: marked partial until the end). `--write-table RESULTS.json` merges the last complete GPU
run's best configurations and fastest backends into the committed table (moejax/kernels/grouped_matmul/
tuning.json) under the run's device kind, which the kernels read; a partial run only with --partial-ok.

`--dry-run` runs the same code on CPU at tiny shapes, the Pallas kernel interpreted and Mosaic skipped (CI).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from launch.bench.provenance import device_tag
from launch.bench.results import ResultsFile, read_runs
from launch.bench.util import environment
from moejax.kernels import expert_ffn
from moejax.kernels.grouped_matmul import mosaic, pallas, tuning
from moejax.kernels.grouped_matmul.aligned import aligned_layout, to_aligned
from moejax.kernels.platform import on_gpu

try:  # JAX's own Mosaic GPU ragged dot, an anchor only: not in every JAX release
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
    MGPU_MISSING = ""
except ImportError as e:
    ragged_dot_mgpu, MGPU_MISSING = None, str(e)  # type: ignore[assignment]  # checked before use

SHAPE = dict(hidden=2048, width=768, experts=128, top_k=8)  # Qwen3-30B-A3B
TOKENS = (8192, 1024, 32768)  # the targets' sizes first: >= 0.8x dense at >= 8K, >= 0.6x at 1K
TINY = dict(hidden=64, width=32, experts=4, top_k=2)
TINY_TOKENS = (64,)

# Candidates in the order worth trying: the first H200 sweep's best first (bench/results/tune_gmm-NVIDIA_H200.json),
# then today's choice before the sweep (row tiles minor), then the rest; --configs N keeps the first N of each.
Config = dict[str, Any]  # a PallasConfig's or MosaicConfig's keyword arguments, as the table keeps them
PALLAS_GLU: list[Config] = [dict(bm=128, bn=128, bk=64, warps=8, stages=3, cols_minor=True),
              dict(bm=64, bn=128, bk=64, warps=4, stages=4, cols_minor=True),
              dict(bm=128, bn=128, bk=64, warps=8, stages=4, cols_minor=True),
              dict(bm=128, bn=128, bk=64, warps=8, stages=3, cols_minor=False),
              dict(bm=128, bn=64, bk=64, warps=4, stages=4, cols_minor=True),
              dict(bm=128, bn=64, bk=64, warps=8, stages=4, cols_minor=True),
              dict(bm=64, bn=64, bk=64, warps=4, stages=4, cols_minor=True)]
PALLAS_GEMM: list[Config] = [dict(bm=128, bn=128, bk=64, warps=8, stages=3, cols_minor=True),
               dict(bm=128, bn=256, bk=64, warps=8, stages=3, cols_minor=True),
               dict(bm=64, bn=256, bk=64, warps=8, stages=3, cols_minor=True),
               dict(bm=128, bn=128, bk=64, warps=8, stages=3, cols_minor=False),
               dict(bm=128, bn=128, bk=64, warps=4, stages=4, cols_minor=True),
               dict(bm=64, bn=128, bk=64, warps=4, stages=4, cols_minor=True)]
MOSAIC: list[Config]
MOSAIC = [dict(bm=128, bn=128, bk=64, stages=3, cols_minor=True, compute_wgs=2),  # warp-specialized (mosaic_ws.py)
          dict(bm=128, bn=128, bk=64, stages=4, cols_minor=True),
          dict(bm=64, bn=128, bk=64, stages=4, cols_minor=True, compute_wgs=2),
          dict(bm=64, bn=256, bk=64, stages=4, cols_minor=True),
          dict(bm=128, bn=128, bk=64, stages=6, cols_minor=True),
          dict(bm=128, bn=128, bk=64, stages=4, cols_minor=False),
          dict(bm=64, bn=128, bk=64, stages=4, cols_minor=True)]
TINY_CONFIGS: dict[str, list[Config]] = dict(glu=[dict(bm=16, bn=16, bk=16, warps=4, stages=3, cols_minor=False),
                         dict(bm=16, bn=16, bk=16, warps=4, stages=3, cols_minor=True)],
                    gemm=[dict(bm=16, bn=32, bk=16, warps=4, stages=3, cols_minor=True)])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m launch.tune_gmm", description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="results JSON (default bench/results/tune_gmm-<device>.json)")
    p.add_argument("--budget-s", type=float, default=170.0, help="start no configuration after this many seconds")
    p.add_argument("--tokens", default=None, help="token counts, comma-separated (default 8192,1024,32768)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of 5 calls per timing")
    p.add_argument("--configs", type=int, default=None, help="try only the first N candidates of each list")
    p.add_argument("--no-anchor", action="store_true", help="skip JAX's own Mosaic ragged dot (an anchor)")
    p.add_argument("--dry-run", action="store_true", help="CPU: tiny shapes, Pallas interpreted, Mosaic skipped")
    p.add_argument("--write-table", metavar="RESULTS", default=None,
                   help="merge a results file's best configurations into the committed tuning table and exit")
    p.add_argument("--table", default=None, help="the table --write-table writes (default: the committed one)")
    p.add_argument("--partial-ok", action="store_true", help="--write-table from a run that was stopped")
    return p.parse_args(argv)


class Sweep:
    """The measurements of one run and the file they are written to after each one."""

    def __init__(self, args: argparse.Namespace, env: dict) -> None:
        self.args, self.t0 = args, time.monotonic()
        self.results = ResultsFile(args.out)
        self.record = dict(**env, benchmark="tune_gmm", budget_s=args.budget_s, rows=[],
                           best=dict(pallas={}, mosaic={}, fastest={}),
                           timing="median over rounds of 5 back-to-back calls, host clock, block_until_ready")

    def out_of_time(self) -> bool:
        return time.monotonic() - self.t0 > self.args.budget_s

    def write(self, final: bool = False) -> None:
        """The run's record in the results file, replacing its earlier partial self (launch.bench.results)."""
        self.record["seconds"] = time.monotonic() - self.t0
        if final:
            self.results.complete(self.record)
        else:
            last = self.record["rows"][-1] if self.record["rows"] else {}
            self.results.partial(self.record, f"{last.get('class', '')} {last.get('what', '')}".strip())

    def add(self, **row: Any) -> dict:
        self.record["rows"].append(row)
        rate = f"{row['tflops_per_s']:7.1f} TFLOP/s" if "tflops_per_s" in row else row.get("skipped", "")
        vs = f" {row['vs_dense']:.2f}x dense" if "vs_dense" in row else ""
        vs += f" err {row['relative_error']:.1e}{' WRONG' if row['wrong'] else ''}" if "relative_error" in row else ""
        cfg = " ".join(f"{k}={v}" for k, v in (row.get("config") or {}).items())
        print(f"  {row['class']:9s} {row['what']:11s} {cfg:58s} {rate}{vs}", flush=True)
        self.write()
        return row


def time_fn(fn: Callable[..., jax.Array], sets: list[tuple[jax.Array, ...]], rounds: int
            ) -> tuple[float, float, jax.Array]:
    """(median seconds per call, seconds of the first call: compiling included, the first call's output)."""
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*sets[0]))
    first = time.perf_counter() - t0
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        outs = [fn(*sets[i % len(sets)]) for i in range(5)]
        jax.block_until_ready(outs)
        times.append((time.perf_counter() - t0) / 5)
    return statistics.median(times), first, out


WRONG = 3e-2  # relative error against the float32 reference past which a configuration is wrong, not slow


def relative_error(out: jax.Array, ref: tuple[np.ndarray, jax.Array]) -> float:
    """ref: (row indices, float32 reference rows); `out`'s rows there against them."""
    rows, want = ref
    got = out[rows, : want.shape[1]].astype(jnp.float32)
    return float(jnp.linalg.norm(got - want) / jnp.maximum(jnp.linalg.norm(want), 1e-30))


SAMPLED_GROUPS = 6  # the reference covers these groups' rows (first, last, between) and 256 tokens' FFN outputs
SAMPLED_TOKENS = 256


def references(d: dict[str, jax.Array]) -> dict[str, tuple[np.ndarray, jax.Array]]:
    """float32 references on a sample of set d, by plain jnp.dot per group: the sweep's GPU call measured the
    plain-JAX backends' whole-problem references at over 70 s (the 2026-11-26 check), longer than its budget."""
    sizes = np.asarray(d["sizes"])
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    groups = np.unique(np.linspace(0, len(sizes) - 1, SAMPLED_GROUPS).astype(int))
    rows = np.concatenate([np.arange(starts[g], starts[g] + sizes[g]) for g in groups])
    wgu = d["wgu"].astype(jnp.float32)
    gemm = jnp.concatenate([jnp.dot(d["xs"][starts[g]:starts[g] + sizes[g]].astype(jnp.float32), wgu[g],
                                    precision=jax.lax.Precision.HIGHEST) for g in groups])
    gate, up = jnp.split(gemm, 2, axis=-1)
    tokens = np.linspace(0, d["x"].shape[0] - 1, SAMPLED_TOKENS).astype(int)
    ffn = expert_ffn(d["x"][tokens].astype(jnp.float32), d["idx"][tokens], d["w"][tokens], wgu,
                     d["wd"].astype(jnp.float32), backend="xla")
    return dict(gemm=(rows, gemm), glu=(rows, jax.nn.silu(gate) * up), ffn=(tokens, ffn))


def make_sets(rng: np.random.Generator, T: int, shape: dict[str, int], dtype: DTypeLike
              ) -> list[dict[str, jax.Array]]:
    D, I, E, k = shape["hidden"], shape["width"], shape["experts"], shape["top_k"]
    wgu = jnp.asarray(rng.standard_normal((E, D, 2 * I), np.float32) / np.sqrt(D)).astype(dtype)
    wd = jnp.asarray(rng.standard_normal((E, I, D), np.float32) / np.sqrt(I)).astype(dtype)
    sets: list[dict[str, jax.Array]] = []
    for _ in range(2):  # fresh data each set; one weight set (the weights are far larger than L2)
        idx = np.argsort(rng.random((T, E)), axis=1)[:, :k].astype(np.int32)
        x = jnp.asarray(rng.standard_normal((T, D), np.float32)).astype(dtype)
        order = np.argsort(idx.ravel(), kind="stable")
        sets.append(dict(x=x, xs=x[order // k], idx=jnp.asarray(idx), sizes=jnp.asarray(
            np.bincount(idx.ravel(), minlength=E).astype(np.int32)), w=jnp.asarray(rng.random((T, k), np.float32)),
            wgu=wgu, wd=wd))
    return sets


def sweep_class(sweep: Sweep, T: int, shape: dict[str, int], dtype: DTypeLike, gpu: bool) -> None:
    D, I, E, k = shape["hidden"], shape["width"], shape["experts"], shape["top_k"]
    M = T * k
    cls = tuning.rows_class(M, E)
    sets = make_sets(np.random.default_rng(T), T, shape, dtype)
    gemm_flops, ffn_flops = 2 * M * D * 2 * I, 6 * M * D * I
    common = dict(tokens=T, rows=M, groups=E, K=D, N=2 * I)
    print(f"T={T}: {M} routed rows, {M / E:.0f} per expert (class {cls})", flush=True)
    rounds = sweep.args.rounds

    def measure(what: str, op: str, fn: Callable[..., jax.Array],
                args_of: Callable[[dict[str, jax.Array]], tuple[jax.Array, ...]], flops: float,
                config: Config | None = None, dense: float | None = None,
                ref: tuple[np.ndarray, jax.Array] | None = None) -> dict:
        try:
            sec, first, out = time_fn(jax.jit(fn), [args_of(d) for d in sets], rounds)
        except Exception as e:  # a configuration the compiler refuses (shared memory, registers) is a result too
            return sweep.add(**common, **{"class": f"{op}/{cls}", "what": what, "config": config,
                                          "skipped": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"})
        row: dict[str, Any]
        row = dict(**common, **{"class": f"{op}/{cls}", "what": what, "config": config, "seconds": sec,
                                "first_call_s": first, "tflops_per_s": flops / sec / 1e12})
        if dense:
            row["vs_dense"] = dense / sec
        if ref is not None:  # a fast wrong answer must never win
            row["relative_error"] = relative_error(out, ref)
            row["wrong"] = not row["relative_error"] <= WRONG
        return sweep.add(**row)

    def fastest(row: dict) -> bool:
        return "seconds" in row and not row.get("wrong")

    refs = references(sets[0])

    dense = measure("dense", "gemm", lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(a.dtype),
                    lambda d: (d["xs"], d["wgu"][0]), gemm_flops)["seconds"]

    def dense_ffn(x: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
        g, u = jnp.split(jnp.dot(x, a, preferred_element_type=jnp.float32), 2, axis=-1)
        return jnp.dot((jax.nn.silu(g) * u).astype(x.dtype), b, preferred_element_type=jnp.float32)
    dense_ffn_s = measure("dense_ffn", "glu", dense_ffn, lambda d: (d["xs"], d["wgu"][0], d["wd"][0]),
                          ffn_flops)["seconds"]

    interpret = not gpu
    best: dict[tuple[str, str], tuple[float, Config]] = {}  # (backend, op) -> (seconds, config)

    keep = slice(sweep.args.configs)
    candidates = {op: configs[keep] for op, configs in
                  (TINY_CONFIGS if not gpu else dict(glu=PALLAS_GLU, gemm=PALLAS_GEMM)).items()}
    for op, configs in candidates.items():
        fused = op == "glu"
        for cfg in configs:
            if sweep.out_of_time():
                break
            c = tuning.PallasConfig(**cfg)

            def run(xp: jax.Array, w: jax.Array, sizes: jax.Array, c: tuning.PallasConfig = c, fused: bool = fused
                    ) -> jax.Array:
                return pallas.grouped_call(xp, w, None, sizes, cfg=c, out_dtype=xp.dtype, act="silu" if fused else None,
                                           interpret=interpret)
            row = measure("pallas", op, run, lambda d: (d["xs"], d["wgu"], d["sizes"]),
                          gemm_flops, cfg, dense, refs[op])
            if fastest(row) and row["seconds"] < best.get(("pallas", op), (np.inf,))[0]:
                best[("pallas", op)] = (row["seconds"], cfg)
    for cfg in (MOSAIC[keep] if gpu else []):
        if sweep.out_of_time():
            break
        mc = mosaic.MosaicConfig(**cfg)
        row = measure("mosaic", "gemm", lambda xs, w, sizes, mc=mc: mosaic.grouped_matmul(xs, w, sizes, mc),
                      lambda d: (d["xs"], d["wgu"], d["sizes"]), gemm_flops, cfg, dense, refs["gemm"])
        if fastest(row) and row["seconds"] < best.get(("mosaic", "gemm"), (np.inf,))[0]:
            best[("mosaic", "gemm")] = (row["seconds"], cfg)
    if not gpu:
        sweep.add(**common, **{"class": f"gemm/{cls}", "what": "mosaic", "skipped": "needs an NVIDIA Hopper GPU"})
    elif ("mosaic", "gemm") in best and not sweep.out_of_time():  # the kernel alone: input already aligned
        mc = mosaic.MosaicConfig(**best[("mosaic", "gemm")][1])
        layouts = [aligned_layout(d["sizes"], M, mc.bm) for d in sets]
        for d, lay in zip(sets, layouts, strict=True):
            d["aligned"], d["tile_group"] = to_aligned(d["xs"], lay), lay.tile_group
        measure("mosaic_kernel", "gemm", lambda xa, w, tg, mc=mc: mosaic.aligned_call(xa, w, tg, mc, xa.dtype),
                lambda d: (d["aligned"], d["wgu"], d["tile_group"]), gemm_flops, best[("mosaic", "gemm")][1], dense,
                None)
        for d in sets:
            del d["aligned"]

    for (backend, op), (_, cfg) in best.items():
        sweep.record["best"][backend][f"{op}/{cls}"] = cfg
    gemm_times = {b: s for (b, op), (s, _) in best.items() if op == "gemm"}
    if gemm_times:
        sweep.record["best"]["fastest"][f"gemm/{cls}"] = min(gemm_times, key=lambda b: gemm_times[b])

    entry = {"pallas": {f"{op}/{cls}": cfg for (b, op), (_, cfg) in best.items() if b == "pallas"},
             "mosaic": {f"gemm/{cls}": cfg for (b, op), (_, cfg) in best.items() if b == "mosaic"}}
    ffn_times: dict[str, float] = {}
    for backend in ["pallas", "mosaic"] if gpu else ["pallas_interpret"]:
        if sweep.out_of_time() or (backend == "mosaic" and not entry["mosaic"]):
            continue
        with tuning.using(entry):
            ffn = lambda x, i, w, a, b, be=backend: expert_ffn(x, i, w, a, b, backend=be)  # noqa: E731
            row = measure(f"ffn_{backend}", "glu", ffn,
                          lambda d: (d["x"], d["idx"], d["w"], d["wgu"], d["wd"]), ffn_flops, None, dense_ffn_s,
                          refs["ffn"])
        if fastest(row):
            ffn_times[backend.removesuffix("_interpret")] = row["seconds"]
    if ffn_times:
        sweep.record["best"]["fastest"][f"glu/{cls}"] = min(ffn_times, key=lambda b: ffn_times[b])
    # an anchor, not a candidate: JAX's own Mosaic GPU ragged dot
    if gpu and not sweep.args.no_anchor and not sweep.out_of_time():
        if ragged_dot_mgpu is None:
            sweep.add(**common, **{"class": f"gemm/{cls}", "what": "jax_ragged_mgpu", "skipped": MGPU_MISSING})
        else:
            anchor: dict[str, Any] = dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=1)
            measure("jax_ragged_mgpu", "gemm", lambda xs, w, sizes: ragged_dot_mgpu.ragged_dot(
                xs, w, group_sizes=sizes, **anchor), lambda d: (d["xs"], d["wgu"], d["sizes"]), gemm_flops, anchor,
                dense)
    sweep.write()


def write_table(results_path: str, table_path: str, partial_ok: bool = False) -> dict:
    """Merge the last GPU run's best configurations into the table under its device kind; returns that entry."""
    runs = [r for r in read_runs(results_path) if r.get("device", {}).get("platform") == "gpu"]
    if not runs:
        raise SystemExit(f"tune_gmm --write-table: {results_path} holds no run measured on a GPU: the table holds "
                         "GPU measurements only")
    run = runs[-1]
    if run.get("partial") and not partial_ok:
        raise SystemExit(f"tune_gmm --write-table: the last GPU run in {results_path} was stopped after "
                         f"{run.get('progress', {}).get('rows')} rows; pass --partial-ok to use what it measured")
    kind = run["device"]["kind"]
    table: dict = {}
    if os.path.exists(table_path):
        with open(table_path) as f:
            table = json.load(f)
    entry = table.setdefault("devices", {}).setdefault(kind, {})
    for section in ("pallas", "mosaic", "fastest"):
        entry.setdefault(section, {}).update(run["best"][section])
    entry["source"] = dict(command=run.get("command"), commit=run.get("git", {}).get("commit"),
                           partial=bool(run.get("partial")), versions=run.get("versions"))
    with open(table_path, "w") as f:
        json.dump(table, f, indent=1, sort_keys=True)
        f.write("\n")
    return entry


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.write_table:
        entry = write_table(args.write_table, args.table or tuning.TABLE_PATH, args.partial_ok)
        print(json.dumps(entry, indent=1))
        return 0

    env = environment()
    env["command"] = " ".join(["python", "-m", "launch.tune_gmm", *(sys.argv[1:] if argv is None else argv)])
    gpu = on_gpu()
    if not gpu and not args.dry_run:
        raise SystemExit("launch.tune_gmm: no GPU here (JAX runs on "
                         f"{jax.default_backend()}); --dry-run runs the sweep's code on CPU at tiny shapes")
    args.out = args.out or os.path.join("bench", "results", f"tune_gmm-{device_tag(env['device']['kind'])}.json")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    sweep = Sweep(args, env)
    tokens: tuple[int, ...]
    shape, tokens = (SHAPE, TOKENS) if gpu else (TINY, TINY_TOKENS)
    if args.tokens:
        tokens = tuple(int(t) for t in args.tokens.split(","))
    dtype = jnp.bfloat16
    for T in tokens:
        if sweep.out_of_time():
            print(f"budget spent: T={T} not started", flush=True)
            break
        sweep_class(sweep, T, shape, dtype, gpu)
    sweep.write(final=True)
    print(json.dumps(sweep.record["best"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
