"""`auto` for the grouped expert products (the grouped GEMM and the expert FFN): on a CPU by shape, on a GPU by the
tuning table a GPU run measured."""
from __future__ import annotations

import jax.numpy as jnp
from jax.typing import DTypeLike

from moejax.kernels.grouped_matmul import tuning
from moejax.kernels.grouped_matmul.mosaic_plan import mosaic_unavailable
from moejax.kernels.platform import on_gpu, pallas_unavailable

# On a CPU, the expert FFN of a batch of at most this many tokens runs dense (every token through every expert)
# where experts are at most CPU_DENSE_MAX_RATIO x top-k: its run time is the weights' read either way, and it
# compiles in half the time of the XLA path's capacity tiers (2026-11-26, a decode step program of 8 tokens,
# float32; dense against xla: micro-qwen3-moe (8 experts, top-2) at 16 rows 0.97 against 0.84 ms a token-step,
# compile 1.2 against 2.1 s; pycode-moe (16, top-2) at 16 rows 10.9 against 14.4 ms, at 32 rows 26.4 against
# 26.1 ms, compile 1.4-2.0 against 2.7-4.0 s; at 64 rows dense ran 5-10% slower).
CPU_DENSE_MAX_TOKENS, CPU_DENSE_MAX_RATIO = 32, 8


def expert_auto(rows: int, groups: int, dtype: DTypeLike, fused: bool, top_k: int | None = None) -> str:
    """`auto` for the grouped expert products on this platform and shape (rows: tokens x top_k where top_k is
    given): on a CPU the XLA path, or dense for a few tokens (CPU_DENSE_MAX_TOKENS); on a GPU, the backend the
    last GPU run measured fastest for the shape class (grouped_matmul/tuning.json), else Pallas; Mosaic GPU only
    for 16-bit operands (it would run float32 as TF32); never ragged_dot (XLA GPU runs it as a dense masked
    product)."""
    if not on_gpu():
        few = top_k is not None and rows <= CPU_DENSE_MAX_TOKENS * top_k and groups <= CPU_DENSE_MAX_RATIO * top_k
        return "dense" if few else "xla"
    if pallas_unavailable() is not None:
        return "mosaic" if _mosaic_usable(dtype) else "xla"
    fastest = tuning.fastest_backend(rows, groups, fused)
    if fastest == "mosaic" and _mosaic_usable(dtype):
        return "mosaic"
    return "pallas"


def _mosaic_usable(dtype: DTypeLike) -> bool:
    return mosaic_unavailable() is None and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
