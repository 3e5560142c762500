"""Grouped GEMM as a Pallas Mosaic GPU kernel (Hopper: TMA tile copies, warpgroup MMA, pipelined stages).

JAX 0.11 deprecates Pallas's Triton lowering; Mosaic GPU is its successor on Hopper. The kernel runs over the
group-aligned layout (aligned.py): every `bm`-row tile belongs to one group, so a tile is one TMA copy and one
weight matrix, and whole tiles are stored. A persistent grid of one program per multiprocessor walks the work
items (row tile, column block) of the tiles that hold rows (a dynamic count: the rest are never visited).

Operands must be 16-bit (bfloat16 or float16): warpgroup MMA on float32 operands rounds them to TF32, which
moejax never does silently (kernels/precision.py). Compiled only for NVIDIA Hopper GPUs; on other machines it
lowers (tests check that) but does not run.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.typing import DTypeLike

try:
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # a JAX without Mosaic GPU: mosaic_unavailable() says so
    plgpu = None  # type: ignore[assignment]  # a module or None: checked before use

from moejax.kernels.grouped_matmul import tuning
from moejax.kernels.grouped_matmul.aligned import aligned_layout, from_aligned, to_aligned
from moejax.kernels.grouped_matmul.groups import zero_rows_of_no_group
from moejax.kernels.grouped_matmul.mosaic_plan import MosaicConfig, fitted_stages, work_items
from moejax.kernels.grouped_matmul.mosaic_ws import warp_specialized_body
from moejax.kernels.padding import pad_axis, round_up

HOPPER_SMS = 132  # H100 SXM / H200: the grid when lowering on a machine without the GPU


def _multiprocessors() -> int:
    dev = jax.devices()[0]
    count = getattr(dev, "core_count", None) if dev.platform == "gpu" else None
    return count or HOPPER_SMS


def check_operands(x: jax.Array, w: jax.Array) -> None:
    for name, a in (("x", x), ("w", w)):
        if jnp.dtype(a.dtype) not in (jnp.bfloat16, jnp.float16):
            raise ValueError(f"grouped_matmul backend 'mosaic': {name} is {jnp.dtype(a.dtype)}; the Mosaic GPU "
                             "kernel takes bfloat16 or float16 operands (float32 would run as TF32): use pallas or xla")
    if x.dtype != w.dtype:
        raise ValueError(f"grouped_matmul backend 'mosaic': x is {x.dtype} and w is {w.dtype}; they must match")


def aligned_call(xa: jax.Array, w: jax.Array, tile_group: jax.Array, cfg: MosaicConfig,
                 out_dtype: DTypeLike) -> jax.Array:
    """xa [tiles * bm, K] in the aligned layout, w [G, K, N], tile_group [tiles] (the used tiles first, then -1)
    -> [tiles * bm, N]; K a multiple of bk, N of cfg.block_n. Rows of unused tiles are left unwritten."""
    rows, K = xa.shape
    N = w.shape[2]
    if rows % cfg.bm or K % cfg.bk or N % cfg.block_n:
        raise ValueError(f"mosaic grouped GEMM: rows {rows}, K {K}, N {N} must be multiples of {cfg.bm}, {cfg.bk}, "
                         f"{cfg.block_n}")
    threads: dict[str, Any]  # plgpu.kernel's thread keywords
    if cfg.compute_wgs == 2:
        body, threads = warp_specialized_body(cfg, K, N, out_dtype), dict(num_threads=3, thread_name="wg")
    elif cfg.compute_wgs == 1:
        body, threads = _one_warpgroup_body(cfg, K, N, out_dtype), {}
    else:
        raise ValueError(f"mosaic grouped GEMM: compute_wgs is 1 or 2, not {cfg.compute_wgs}")
    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((rows, N), out_dtype),
        grid=(_multiprocessors(),),
        grid_names=("sm",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        **threads,
    )
    used = jnp.sum(tile_group >= 0, dtype=jnp.int32)[None]  # the used tiles come first (aligned_layout)
    return kernel(tile_group, used, xa, w)


def _one_warpgroup_body(cfg: MosaicConfig, K: int, N: int, out_dtype: DTypeLike) -> Callable[..., None]:
    """One warpgroup per program issues the copies and the MMAs (emit_pipeline keeps `stages` copies in flight)."""
    bm, bn, bk = cfg.bm, cfg.bn, cfg.bk

    def body(group_gmem, used_gmem, x_gmem, w_gmem, o_gmem):
        loop, tile_and_block = work_items(cfg, used_gmem[0], N // bn)  # only tiles that hold rows

        @loop
        def _item(info):
            t, j = tile_and_block(info.index)
            g = group_gmem[t]

            def accumulate(acc_ref):
                plgpu.emit_pipeline(
                    lambda _, x_smem, w_smem: plgpu.wgmma(acc_ref, x_smem, w_smem),
                    grid=(K // bk,),
                    in_specs=[plgpu.BlockSpec((bm, bk), lambda k: (t, k), delay_release=1),
                              plgpu.BlockSpec((bk, bn), lambda k: (k, j), delay_release=1)],
                    max_concurrent_steps=fitted_stages(cfg, x_gmem.dtype, out_dtype),
                )(x_gmem, w_gmem.at[g])
                return acc_ref[...]

            acc = pl.run_scoped(accumulate, plgpu.ACC((bm, bn)))

            @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((bm, bn), out_dtype))
            def _store(o_smem):
                o_smem[...] = acc.astype(out_dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[pl.ds(t * bm, bm), pl.ds(j * bn, bn)])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    return body


def pad_k_n(x: jax.Array, w: jax.Array, cfg: MosaicConfig) -> tuple[jax.Array, jax.Array]:
    K, N = w.shape[1], w.shape[2]
    Kp, Np = round_up(K, cfg.bk), round_up(N, cfg.block_n)
    return pad_axis(x, 1, Kp), pad_axis(pad_axis(w, 1, Kp), 2, Np)


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, cfg: MosaicConfig | None = None,
                   out_dtype: DTypeLike | None = None) -> jax.Array:
    """x [M, K] rows grouped in order, w [G, K, N] -> [M, N] (float32 accumulation, out_dtype default x.dtype);
    rows past sum(group_sizes) are 0."""
    check_operands(x, w)
    M, N = x.shape[0], w.shape[2]
    cfg = cfg or tuning.mosaic_config(M, w.shape[0], N)
    layout = aligned_layout(group_sizes, M, cfg.bm)
    xp, wp = pad_k_n(x, w, cfg)
    y = aligned_call(to_aligned(xp, layout), wp, layout.tile_group, cfg, out_dtype or x.dtype)
    return zero_rows_of_no_group(from_aligned(y, layout)[:, :N], group_sizes)
