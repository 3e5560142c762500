"""`python -m launch.bench kernels`: grouped expert GEMM, the fused expert FFN and attention, each backend next
to the plain baselines, side by side in one process on fresh random data (never zeros).

Grouped GEMM (gate/up projection of M = tokens x top-k routed rows, uniform random top-k routing) and the whole
routed FFN are compared with a dense matmul of the same FLOPs (one weight matrix, same M, K, N), with
`jax.lax.ragged_dot` and, on CPU, with computing every expert densely. Attention prefill (causal, GQA) is
compared with `jax.nn.dot_product_attention` (cuDNN) where cuDNN handles the case, and decode (one query per
sequence over a full KV cache) is reported as GB/s of K/V read. Each timed call is synchronised with
`block_until_ready` and timed on the host clock after a warm-up call; medians over `--repeats`, inputs rotated
over two sets so no call reuses the previous call's data from cache.
"""
from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from moejax.kernels import expert_ffn, grouped_matmul
from moejax.kernels.attention import attention
from moejax.kernels.attention import cudnn as cudnn_attention
from moejax.kernels.backends import on_gpu
from launch.bench_util import time_calls

SHAPES = {"qwen3-30b-a3b": dict(hidden=2048, width=768, experts=128, top_k=8),
          "mixtral-8x7b": dict(hidden=4096, width=14336, experts=8, top_k=2),
          "tiny": dict(hidden=64, width=32, experts=8, top_k=2)}  # a smoke run (launch.gpu_check --dry-run)
ATTENTION = dict(heads=32, kv_heads=4, head_dim=128)  # Qwen3-30B-A3B


def add_parser(sub):
    p = sub.add_parser("kernels", help="grouped GEMM, expert FFN and attention backends vs dense/ragged_dot/cuDNN")
    p.add_argument("--shapes", default="qwen3-30b-a3b,mixtral-8x7b", help=f"expert shapes: {', '.join(SHAPES)}")
    p.add_argument("--tokens", default=None, help="routed token counts (default GPU 1K..32K; CPU 64,256, where "
                                                  "ragged_dot took 10-15 s per call at 256 on 2 cores)")
    p.add_argument("--seqs", default=None, help="prefill lengths for attention (default GPU 4K..32K, CPU 512,2048)")
    p.add_argument("--decode-batch", type=int, default=None, help="sequences per decode step (GPU 64, CPU 8)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32"], help="default: GPU bf16, CPU f32")
    p.add_argument("--repeats", type=int, default=None, help="timed calls per case (GPU 20, CPU 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON file (default bench/results/kernels-<device>.json)")
    return p


def _ints(text, default):
    return [int(v) for v in text.split(",")] if text else default


def _median_seconds(fn, inputs, repeats):
    rotation = itertools.cycle(inputs)
    first, runs, other = time_calls(lambda: jax.block_until_ready(fn(*next(rotation))), repeats)
    return float(np.median(runs)), dict(seconds=runs, first_call_s=first, other_processes_cpu_share=other)


def _row(table, section, case, name, flops, seconds, timing, bytes_moved=None, **extra):
    row = dict(section=section, case=case, name=name, seconds_median=seconds, tflops_per_s=flops / seconds / 1e12,
               flops=flops, **timing, **extra)
    if bytes_moved is not None:
        row.update(bytes=bytes_moved, gb_per_s=bytes_moved / seconds / 1e9)
    table.append(row)
    rate = f"{row['tflops_per_s']:8.3f} TFLOP/s" + (f" {row['gb_per_s']:8.1f} GB/s" if bytes_moved else "")
    print(f"  {section:10s} {case:34s} {name:18s} {seconds * 1e3:10.3f} ms {rate}", flush=True)
    return row


def _routing(rng, tokens, experts, top_k):
    scores = rng.random((tokens, experts))
    idx = np.argsort(scores, axis=1)[:, :top_k].astype(np.int32)  # uniform random distinct experts per token
    weights = rng.random((tokens, top_k)).astype(np.float32)
    return idx, weights


def grouped(args, dtype, table):
    gpu = on_gpu()
    mine = "pallas" if gpu else "xla"
    rng = np.random.default_rng(args.seed)
    for shape_name in args.shapes.split(","):
        s = SHAPES[shape_name]
        D, I, E, k = s["hidden"], s["width"], s["experts"], s["top_k"]
        wsets = 2 if gpu else 1  # CPU: weights are far larger than its caches; save host memory
        wgu = [jnp.asarray((rng.standard_normal((E, D, 2 * I), np.float32) / np.sqrt(D))).astype(dtype)
               for _ in range(wsets)]
        wd = [jnp.asarray((rng.standard_normal((E, I, D), np.float32) / np.sqrt(I))).astype(dtype)
              for _ in range(wsets)]
        for T in _ints(args.tokens, [1024, 2048, 4096, 8192, 16384, 32768] if gpu else [64, 256]):
            M = T * k
            case = f"{shape_name} T={T}"
            sets = []
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
            print(f"{case}: {M} routed rows", flush=True)
            dense = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(a.dtype))
            base, t = _median_seconds(dense, [(d["xs"], d["wgu"][0]) for d in sets], args.repeats)
            ref = _row(table, "gemm", case, "dense_matmul", gemm_flops, base, t)
            names = [mine, "ragged_dot"] + ([] if gpu else ["reference"])
            for name in names:
                fn = jax.jit(functools.partial(grouped_matmul, backend=name))
                sec, t = _median_seconds(fn, [(d["xs"], d["wgu"], d["sizes"]) for d in sets], args.repeats)
                _row(table, "gemm", case, name if name != "reference" else "all_experts", gemm_flops, sec, t,
                     vs_dense_matmul=ref["seconds_median"] / sec)

            def dense_ffn(x, a, b):
                h = jnp.dot(x, a, preferred_element_type=jnp.float32)
                g, u = jnp.split(h, 2, axis=-1)
                return jnp.dot((jax.nn.silu(g) * u).astype(x.dtype), b, preferred_element_type=jnp.float32)
            base, t = _median_seconds(jax.jit(dense_ffn), [(d["xs"], d["wgu"][0], d["wd"][0]) for d in sets],
                                      args.repeats)
            ref = _row(table, "ffn", case, "dense_ffn", ffn_flops, base, t)
            for name in [mine, "tiled", "ragged_dot"] + ([] if gpu else ["dense"]):
                fn = jax.jit(functools.partial(expert_ffn, backend=name))
                sec, t = _median_seconds(fn, [(d["x"], d["idx"], d["w"], d["wgu"], d["wd"]) for d in sets],
                                         args.repeats)
                _row(table, "ffn", case, name if name != "dense" else "all_experts", ffn_flops, sec, t,
                     vs_dense_ffn=ref["seconds_median"] / sec)


def attention_cases(args, dtype, table):
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
            ref = _row(table, "attention", case, "cudnn", flops, sec, t)
        for name in backends:
            if name == "reference" and S > 2048:
                continue  # materialises [H, S, S]
            fn = jax.jit(functools.partial(attention, backend=name))
            sec, t = _median_seconds(fn, sets, args.repeats)
            extra = {} if ref is None else dict(vs_cudnn=ref["seconds_median"] / sec)
            _row(table, "attention", case, name, flops, sec, t, **extra)
    B = args.decode_batch or (64 if gpu else 8)
    for S in _ints(args.seqs, [4096, 32768] if gpu else [2048]):
        case = f"decode B={B} S={S} H={H}/{K} D={D}"
        sets = [(rand(B, 1, H, D), rand(B, S, K, D), rand(B, S, K, D)) for _ in range(2)]
        flops, moved = 4 * B * S * D * H, 2 * B * S * K * D * jnp.dtype(dtype).itemsize
        print(case, flush=True)
        for name in backends:
            fn = jax.jit(functools.partial(attention, backend=name))
            sec, t = _median_seconds(fn, sets, args.repeats)
            _row(table, "attention", case, name, flops, sec, t, bytes_moved=moved)


def kernels(args, env) -> dict:
    gpu = on_gpu()
    dtype = jnp.dtype(args.dtype or ("bfloat16" if gpu else "float32"))
    args.repeats = args.repeats or (20 if gpu else 3)
    table = []
    grouped(args, dtype, table)
    attention_cases(args, dtype, table)
    if not gpu:
        print("(CPU: Pallas kernels run only interpreted here; GPU numbers need a GPU run of this command)")
    return dict(**env, benchmark="kernels", dtype=str(dtype), repeats=args.repeats,
                timing="host clock around block_until_ready, median", results=table)
