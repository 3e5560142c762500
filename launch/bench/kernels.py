"""`python -m launch.bench kernels`: grouped expert GEMM, the fused expert FFN and attention, each backend next
to the plain baselines, side by side in one process on fresh random data (never zeros).

Grouped GEMM (gate/up projection of M = tokens x top-k routed rows, uniform random top-k routing) and the whole
routed FFN are compared with a dense matmul of the same FLOPs (one weight matrix, same M, K, N): every backend of
`grouped_matmul` and `expert_ffn` (their BACKENDS; on a GPU the compiled ones, `ragged_dot` among them, and on CPU
also every expert computed densely). A backend whose working memory would not fit the free device memory
(launch/bench/kernel_memory.py) gets a row "skipped: needs N GiB", one that raises a row "failed". Attention prefill
(causal, GQA) is compared with `jax.nn.dot_product_attention` (cuDNN) where cuDNN handles the case, and decode (one
query per sequence over a full KV cache) is reported as GB/s of K/V read. Each timed call is synchronised with
`block_until_ready` and timed on the host clock after a warm-up call; medians over `--repeats`, inputs rotated
over two sets so no call reuses the previous call's data from cache.

Each grouped GEMM and FFN row writes out its FLOPs and `bytes`: what the call must read and write at the least
(its inputs, every expert's weights that its tokens route to, its output; never its intermediates), so that
`gb_per_s` next to `tflops_per_s` says how far a row is from the copy ceiling as well as from the matmul peak.

At `--parts-tokens` (default 8K on a GPU) the GPU FFN backends (pallas, mosaic; pallas_interpret on CPU) are also
timed part by part (section "ffn_parts": routing, each product, the activation where it is not fused, combine;
moejax/kernels/expert_ffn/parts.py, the parts the backends run), each alone on the previous parts' outputs, with
the sum of the parts against the whole call: where a call's time goes beyond its kernels.

`ragged_dot_cudnn` needs XLA's `--xla_gpu_experimental_use_ragged_dot_fusion=true`, which XLA reads once, when
JAX starts its GPU backend: `before_start` adds it to XLA_FLAGS before then (`--no-ragged-dot-fusion` leaves
XLA_FLAGS alone), and the record says which XLA_FLAGS the run had. Under the flag `ragged_dot` compiles to the
same program, so its row says so instead of being timed twice.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import os
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from launch.bench.kernel_memory import FREE_FRACTION, GiB, expert_ffn_bytes, free_bytes, grouped_matmul_bytes, too_large
from launch.bench.results import no_file
from launch.bench.util import time_calls
from moejax.kernels import EXPERT_BACKENDS, GROUPED_MATMUL_BACKENDS, expert_ffn, grouped_matmul
from moejax.kernels.attention import attention
from moejax.kernels.attention import cudnn as cudnn_attention
from moejax.kernels.expert_ffn import parts as ffn_parts
from moejax.kernels.grouped_matmul import ragged_cudnn
from moejax.kernels.grouped_matmul.mosaic_plan import mosaic_unavailable
from moejax.kernels.platform import GPU_ONLY, on_gpu

SHAPES = {"qwen3-30b-a3b": dict(hidden=2048, width=768, experts=128, top_k=8),
          "mixtral-8x7b": dict(hidden=4096, width=14336, experts=8, top_k=2),
          "tiny": dict(hidden=64, width=32, experts=8, top_k=2)}  # a smoke run (launch.gpu_check --dry-run)
ATTENTION = dict(heads=32, kv_heads=4, head_dim=128)  # Qwen3-30B-A3B


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = sub.add_parser("kernels", help="grouped GEMM, expert FFN and attention backends vs dense/ragged_dot/cuDNN")
    p.add_argument("--shapes", default="qwen3-30b-a3b,mixtral-8x7b", help=f"expert shapes: {', '.join(SHAPES)}")
    p.add_argument("--tokens", default=None, help="routed token counts (default GPU 1K..32K; CPU 64,256, where "
                                                  "ragged_dot took 10-15 s per call at 256 on 2 cores)")
    p.add_argument("--seqs", default=None, help="prefill lengths for attention (default GPU 4K..32K, CPU 512,2048)")
    p.add_argument("--decode-batch", type=int, default=None, help="sequences per decode step (GPU 64, CPU 8)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32"], help="default: GPU bf16, CPU f32")
    p.add_argument("--repeats", type=int, default=None, help="timed calls per case (GPU 20, CPU 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--free-gib", type=float, default=None,
                   help="device memory free for one call's working memory, in GiB (default: what the device reports "
                        "free; a CPU reports nothing: every backend runs)")
    p.add_argument("--parts-tokens", default=None,
                   help="token counts at which the GPU FFN backends are also timed part by part (default GPU 8192, "
                        "CPU 32: the dry run's; a count not in --tokens is not run)")
    p.add_argument("--no-ragged-dot-fusion", action="store_true",
                   help="leave XLA_FLAGS as they are (by default the run adds XLA's cuDNN ragged-dot fusion flag, "
                        "which ragged_dot_cudnn needs)")
    p.add_argument("--out", default=None, help="JSON file (default bench/results/kernels-<device>.json)")
    p.set_defaults(before_start=before_start)
    return p


def before_start(args: argparse.Namespace) -> None:
    """Before JAX starts its backend (XLA reads XLA_FLAGS once, then): turn on the cuDNN ragged-dot fusion. It
    changes nothing but ragged_dot's programs, and nothing off a GPU."""
    if not args.no_ragged_dot_fusion:
        os.environ["XLA_FLAGS"] = ragged_cudnn.with_fusion(os.environ.get("XLA_FLAGS", ""))


def same_program_as(name: str, gpu: bool) -> str | None:
    """The backend that `name` compiles to the same program as in this process, or None."""
    return "ragged_dot_cudnn" if name == "ragged_dot" and gpu and ragged_cudnn.fusion_enabled() else None


def gemm_bytes(M: int, K: int, N: int, experts: int, itemsize: int) -> int:
    """The least a product of M rows [M, K] by `experts` weight matrices [K, N] moves: rows in, weights in, [M, N]
    out (a dense gemm is one expert)."""
    return (M * K + experts * K * N + M * N) * itemsize


def ffn_bytes(T: int, D: int, I: int, experts: int, itemsize: int, out_itemsize: int, routed: int = 0) -> int:
    """The least an FFN of T tokens moves: the tokens in, each used expert's gate/up [D, 2I] and down [I, D] weights
    in, [T, D] out, and for a routed FFN its `routed` assignments' int32 ids and float32 weights. The dense FFN
    baseline is one expert over the T * k routed rows."""
    return T * D * itemsize + experts * 3 * D * I * itemsize + T * D * out_itemsize + routed * (4 + 4)


def _ints(text: str | None, default: list[int]) -> list[int]:
    return [int(v) for v in text.split(",")] if text else default


# Not timed on a GPU: interpreted, the CPU path, or every expert on every token (E/k the FLOPs).
NOT_TIMED_ON_GPU = ("pallas_interpret", "xla", "reference", "dense")
SHOWN_AS = {"reference": "all_experts", "dense": "all_experts"}  # the all-experts baselines' row names


def timed_backends(backends: tuple[str, ...], gpu: bool) -> list[str]:
    """The backends to time, from a kernel's own BACKENDS, so that a new one is timed without a change here: on a
    GPU the compiled ones, elsewhere all but the GPU-only and the interpreted ones."""
    if gpu:
        return [b for b in backends if b not in NOT_TIMED_ON_GPU]
    return [b for b in backends if b not in GPU_ONLY and b != "pallas_interpret"]


def _median_seconds(fn: Callable[..., object], inputs: Sequence[tuple[object, ...]], repeats: int
                    ) -> tuple[float, dict]:
    rotation = itertools.cycle(inputs)
    first, runs, other = time_calls(lambda: jax.block_until_ready(fn(*next(rotation))), repeats)
    return float(np.median(runs)), dict(seconds=runs, first_call_s=first, other_processes_cpu_share=other)


class Table:
    """The rows measured so far: each row is printed and saved (the run's partial record) as it is added.
    free() -> the device memory free for the next call (None: unknown)."""

    def __init__(self, save: Callable[[str], None], free: Callable[[], int | None] = free_bytes) -> None:
        self.rows: list[dict] = []
        self.save, self.free = save, free

    def _add(self, row: dict, line: str) -> dict:
        self.rows.append(row)
        print(f"  {row['section']:10s} {row['case']:34s} {row['name']:18s} {line}", flush=True)
        self.save(f"{row['section']} {row['case']} {row['name']}")
        return row

    def timed(self, section: str, case: str, name: str, flops: float, seconds: float, timing: dict,
              bytes_moved: int | None = None, **extra: object) -> dict:
        row = dict(section=section, case=case, name=name, seconds_median=seconds,
                   tflops_per_s=flops / seconds / 1e12, flops=flops, **timing, **extra)
        if bytes_moved is not None:
            row.update(bytes=bytes_moved, gb_per_s=bytes_moved / seconds / 1e9)
        rate = f"{row['tflops_per_s']:8.3f} TFLOP/s" + (f" {row['gb_per_s']:8.1f} GB/s" if bytes_moved else "")
        return self._add(row, f"{seconds * 1e3:10.3f} ms {rate}")

    def part(self, section: str, case: str, name: str, seconds: float, timing: dict, **extra: object) -> dict:
        """A row timed without FLOPs of its own (a part of a call that is not a product)."""
        row = dict(section=section, case=case, name=name, seconds_median=seconds, **timing, **extra)
        return self._add(row, f"{seconds * 1e3:10.3f} ms")

    def not_run(self, section: str, case: str, name: str, status: str, why: str, **extra: object) -> dict:
        """A backend that did not run ("skipped": it would not fit) or did not finish ("failed")."""
        return self._add(dict(section=section, case=case, name=name, **{status: why}, **extra), f"{status}: {why}")


def _time_backend(table: Table, section: str, case: str, name: str, fn: Callable[..., object],
                  inputs: Sequence[tuple[object, ...]], flops: float, needs: int, repeats: int, vs_key: str, ref: dict,
                  bytes_moved: int | None = None) -> None:
    """One backend's row: skipped when its working memory would not fit or when it compiles to another row's
    program, failed when it raises (one backend must not lose the others' rows), else timed against the dense
    baseline `ref`."""
    shown = SHOWN_AS.get(name, name)
    same = same_program_as(name, on_gpu())
    if same:
        table.not_run(section, case, shown, "skipped", f"the same program as {same} under this XLA_FLAGS")
        return
    why = too_large(needs, table.free())
    if why:
        table.not_run(section, case, shown, "skipped", why, needs_bytes=needs)
        return
    try:
        sec, t = _median_seconds(fn, inputs, repeats)
    except Exception as e:  # e.g. out of memory where the estimate fell short, or a backend this JAX lacks
        table.not_run(section, case, shown, "failed", f"{type(e).__name__}: {str(e)[:300]}", needs_bytes=needs)
        return
    table.timed(section, case, shown, flops, sec, t, bytes_moved, needs_bytes=needs,
                **{vs_key: ref["seconds_median"] / sec})


GATHERED = "_gather_in_kernel"  # the Pallas FFN whose gate/up kernel gathers the tokens (no copy in expert order)


def parts_backends(gpu: bool, dtype: DTypeLike) -> list[str]:
    """The FFN backends timed part by part: the GPU kernels (Mosaic GPU for 16-bit operands where it loads), and
    the Pallas FFN with the tokens gathered by its kernel (not a backend yet: timed here first)."""
    pallas = "pallas" if gpu else "pallas_interpret"
    mosaic = gpu and mosaic_unavailable() is None and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
    return [pallas, pallas + GATHERED] + (["mosaic"] if mosaic else [])


def _parts(name: str, state: ffn_parts.State) -> list[ffn_parts.Part]:
    if name == "mosaic":
        return ffn_parts.mosaic_parts(state, "silu", 7.0, 1.702)
    return ffn_parts.pallas_parts(state, "silu", 7.0, 1.702, interpret=name.startswith("pallas_interpret"),
                                  gather_in_kernel=name.endswith(GATHERED))


def parts_call(name: str) -> Callable[..., jax.Array]:
    """The whole FFN of a parts backend, as one jitted call."""
    def call(x: jax.Array, idx: jax.Array, w: jax.Array, wgu: jax.Array, wd: jax.Array) -> jax.Array:
        state = ffn_parts.start(x, idx, w, wgu, wd, None, None)
        return ffn_parts.run(_parts(name, state), state)
    return jax.jit(call)


def time_parts(table: Table, case: str, name: str, sets: list[dict[str, jax.Array]], M: int, D: int, I: int,
               repeats: int) -> None:
    """`name`'s expert FFN part by part, each part jitted alone on the previous parts' outputs, then the sum of the
    parts against the whole call's row (timed before, in the same run)."""
    states = [ffn_parts.start(d["x"], d["idx"], d["w"], d["wgu"], d["wd"], None, None) for d in sets]
    try:
        plist = _parts(name, states[0])
    except Exception as e:  # e.g. a Mosaic GPU that refuses these operands
        table.not_run("ffn_parts", case, name, "failed", f"{type(e).__name__}: {str(e)[:300]}")
        return
    flops = dict(gate_up=4 * M * D * I, down=2 * M * I * D)
    total = 0.0
    for part_name, part in plist:
        fn = jax.jit(part)
        try:
            sec, t = _median_seconds(fn, [(st,) for st in states], repeats)
        except Exception as e:
            table.not_run("ffn_parts", case, f"{name}:{part_name}", "failed", f"{type(e).__name__}: {str(e)[:300]}")
            return
        total += sec
        if part_name in flops:
            table.timed("ffn_parts", case, f"{name}:{part_name}", flops[part_name], sec, t)
        else:
            table.part("ffn_parts", case, f"{name}:{part_name}", sec, t)
        states = [{**st, **fn(st)} for st in states]
    whole = next((r["seconds_median"] for r in table.rows
                  if r["section"] == "ffn" and r["case"] == case and r["name"] == name and "seconds_median" in r), None)
    extra = {} if whole is None else dict(whole_call_s=whole, whole_minus_parts_s=whole - total)
    table.part("ffn_parts", case, f"{name}:sum_of_parts", total, {}, **extra)


def _routing(rng: np.random.Generator, tokens: int, experts: int, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    scores = rng.random((tokens, experts))
    idx = np.argsort(scores, axis=1)[:, :top_k].astype(np.int32)  # uniform random distinct experts per token
    weights = rng.random((tokens, top_k)).astype(np.float32)
    return idx, weights


def grouped(args: argparse.Namespace, dtype: DTypeLike, table: Table) -> None:
    gpu = on_gpu()
    itemsize = jnp.dtype(dtype).itemsize
    rng = np.random.default_rng(args.seed)
    for shape_name in args.shapes.split(","):
        s = SHAPES[shape_name]
        D, I, E, k = s["hidden"], s["width"], s["experts"], s["top_k"]
        wsets = 2 if gpu else 1  # CPU: weights are far larger than its caches; save host memory
        wgu = [jnp.asarray(rng.standard_normal((E, D, 2 * I), np.float32) / np.sqrt(D)).astype(dtype)
               for _ in range(wsets)]
        wd = [jnp.asarray(rng.standard_normal((E, I, D), np.float32) / np.sqrt(I)).astype(dtype)
              for _ in range(wsets)]
        for T in _ints(args.tokens, [1024, 2048, 4096, 8192, 16384, 32768] if gpu else [64, 256]):
            M = T * k
            case = f"{shape_name} T={T}"
            sets: list[dict[str, jax.Array]] = []
            for i in range(2):
                idx, weights = _routing(rng, T, E, k)
                x = jnp.asarray(rng.standard_normal((T, D), np.float32)).astype(dtype)
                order = np.argsort(idx.ravel(), kind="stable")
                xs = x[order // k]
                sizes = jnp.asarray(np.bincount(idx.ravel(), minlength=E).astype(np.int32))
                sets.append(dict(x=x, xs=xs, idx=jnp.asarray(idx), w=jnp.asarray(weights), sizes=sizes,
                                 wgu=wgu[i % wsets], wd=wd[i % wsets]))
            gemm_flops = 2 * M * D * 2 * I
            ffn_flops = 6 * M * D * I
            used = min(E, M)  # uniform routing: at these sizes every expert gets rows
            print(f"{case}: {M} routed rows", flush=True)
            dense = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(a.dtype))
            base, t = _median_seconds(dense, [(d["xs"], d["wgu"][0]) for d in sets], args.repeats)
            ref = table.timed("gemm", case, "dense_matmul", gemm_flops, base, t, gemm_bytes(M, D, 2 * I, 1, itemsize))
            for name in timed_backends(GROUPED_MATMUL_BACKENDS, gpu):
                _time_backend(table, "gemm", case, name, jax.jit(functools.partial(grouped_matmul, backend=name)),
                              [(d["xs"], d["wgu"], d["sizes"]) for d in sets], gemm_flops,
                              grouped_matmul_bytes(name, M, D, 2 * I, E, itemsize), args.repeats,
                              "vs_dense_matmul", ref, gemm_bytes(M, D, 2 * I, used, itemsize))

            def dense_ffn(x: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
                h = jnp.dot(x, a, preferred_element_type=jnp.float32)
                g, u = jnp.split(h, 2, axis=-1)
                return jnp.dot((jax.nn.silu(g) * u).astype(x.dtype), b, preferred_element_type=jnp.float32)
            base, t = _median_seconds(jax.jit(dense_ffn), [(d["xs"], d["wgu"][0], d["wd"][0]) for d in sets],
                                      args.repeats)
            ref = table.timed("ffn", case, "dense_ffn", ffn_flops, base, t,
                              ffn_bytes(M, D, I, 1, itemsize, 4))  # its [M, D] output is float32
            for name in timed_backends(EXPERT_BACKENDS, gpu):
                _time_backend(table, "ffn", case, name, jax.jit(functools.partial(expert_ffn, backend=name)),
                              [(d["x"], d["idx"], d["w"], d["wgu"], d["wd"]) for d in sets], ffn_flops,
                              expert_ffn_bytes(name, T, k, D, I, E, itemsize), args.repeats, "vs_dense_ffn", ref,
                              ffn_bytes(T, D, I, used, itemsize, itemsize, M))
            if T in _ints(args.parts_tokens, [8192] if gpu else [32]):
                for name in parts_backends(gpu, dtype):
                    if not gpu or name.endswith(GATHERED):  # rows the backends' loop above did not time
                        _time_backend(table, "ffn", case, name, parts_call(name),
                                      [(d["x"], d["idx"], d["w"], d["wgu"], d["wd"]) for d in sets], ffn_flops,
                                      expert_ffn_bytes(name, T, k, D, I, E, itemsize), args.repeats, "vs_dense_ffn",
                                      ref, ffn_bytes(T, D, I, used, itemsize, itemsize, M))
                    time_parts(table, case, name, sets, M, D, I, args.repeats)


def attention_cases(args: argparse.Namespace, dtype: DTypeLike, table: Table) -> None:
    gpu = on_gpu()
    H, K, D = ATTENTION["heads"], ATTENTION["kv_heads"], ATTENTION["head_dim"]
    rng = np.random.default_rng(args.seed + 1)
    backends = ["pallas", "xla"] if gpu else ["xla", "reference"]
    rand = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype)  # noqa: E731
    for S in _ints(args.seqs, [4096, 8192, 16384, 32768] if gpu else [512, 2048]):
        case = f"prefill S={S} H={H}/{K} D={D}"
        sets = [(rand(1, S, H, D), rand(1, S, K, D), rand(1, S, K, D)) for _ in range(2)]
        flops = 2 * S * S * D * H  # QK^T and PV, causal half of each
        print(case, flush=True)
        ref = None
        if cudnn_attention.supports(*sets[0], True, None, None, None, None, False):
            fn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"))
            sec, t = _median_seconds(fn, sets, args.repeats)
            ref = table.timed("attention", case, "cudnn", flops, sec, t)
        for name in backends:
            if name == "reference" and S > 2048:
                continue  # materialises [H, S, S]
            fn = jax.jit(functools.partial(attention, backend=name))
            sec, t = _median_seconds(fn, sets, args.repeats)
            extra = {} if ref is None else dict(vs_cudnn=ref["seconds_median"] / sec)
            table.timed("attention", case, name, flops, sec, t, **extra)
    B = args.decode_batch or (64 if gpu else 8)
    for S in _ints(args.seqs, [4096, 32768] if gpu else [2048]):
        case = f"decode B={B} S={S} H={H}/{K} D={D}"
        sets = [(rand(B, 1, H, D), rand(B, S, K, D), rand(B, S, K, D)) for _ in range(2)]
        flops, moved = 4 * B * S * D * H, 2 * B * S * K * D * jnp.dtype(dtype).itemsize
        print(case, flush=True)
        for name in backends:
            fn = jax.jit(functools.partial(attention, backend=name))
            sec, t = _median_seconds(fn, sets, args.repeats)
            table.timed("attention", case, name, flops, sec, t, bytes_moved=moved)


def kernels(args: argparse.Namespace, env: dict, partial: Callable[[dict, str], None] = no_file) -> dict:
    gpu = on_gpu()
    dtype = jnp.dtype(args.dtype or ("bfloat16" if gpu else "float32"))
    args.repeats = args.repeats or (20 if gpu else 3)
    table: Table  # made below: record() reads its rows
    record = lambda: dict(**env, benchmark="kernels", dtype=str(dtype), repeats=args.repeats,  # noqa: E731
                          timing="host clock around block_until_ready, median",
                          xla_flags=os.environ.get("XLA_FLAGS", ""),
                          bytes="the least each call reads and writes: inputs, the weights of the experts its "
                                "tokens route to, output (launch/bench/kernels.py gemm_bytes, ffn_bytes)",
                          memory="a backend runs when its working memory (launch/bench/kernel_memory.py) fits "
                                 f"{FREE_FRACTION:.0%} of the free device memory, else its row says skipped",
                          results=table.rows)
    table = Table(lambda last: partial(record(), last),
                  free_bytes if args.free_gib is None else lambda: int(args.free_gib * GiB))
    grouped(args, dtype, table)
    attention_cases(args, dtype, table)
    if not gpu:
        print("(CPU: Pallas kernels run only interpreted here; GPU numbers need a GPU run of this command)")
    return record()
