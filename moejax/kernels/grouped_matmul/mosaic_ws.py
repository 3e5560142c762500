"""The warp-specialized Mosaic GPU grouped GEMM body (MosaicConfig.compute_wgs == 2), after the structure of JAX's
Hopper matmul example: per program, one warpgroup only issues TMA copies into a ring of `stages` shared-memory
slots, and two warpgroups only issue warpgroup MMAs, each into its own (bm, bn) accumulator, the two side by side
over a (bm, 2 bn) block. Copies never wait behind MMAs of the same warpgroup, which is what keeps a single
warpgroup's pipeline (mosaic.py) short of a dense matmul's rate.

Work items, the group-aligned layout and the used-tile count are mosaic.py's.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.typing import DTypeLike

try:
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # a JAX without Mosaic GPU: mosaic_unavailable() says so (mosaic.py imports this module)
    plgpu = None  # type: ignore[assignment]  # a module or None: checked before use

from moejax.kernels.grouped_matmul.mosaic_plan import MosaicConfig, fitted_stages, work_items

COPY_REGISTERS = 40  # registers per thread left to the copy warpgroup (JAX's Hopper matmul: "reasonable on H100")
def _swizzled(minor_elems: int, dtype: DTypeLike) -> tuple:
    """Shared-memory transforms for tiles whose minor dimension holds `minor_elems` elements of `dtype`."""
    swizzle = plgpu.find_swizzle(minor_elems * jnp.dtype(dtype).itemsize * 8)
    return plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle)


def warp_specialized_body(cfg: MosaicConfig, K: int, N: int, out_dtype: DTypeLike) -> Callable[..., None]:
    bm, bn, bk = cfg.bm, cfg.bn, cfg.bk
    block_n = 2 * bn

    def body(group_gmem, used_gmem, x_gmem, w_gmem, o_gmem):
        dtype = x_gmem.dtype
        transforms = _swizzled(bk, dtype)
        stages = fitted_stages(cfg, dtype, out_dtype)

        def pipeline(mma, context):
            return plgpu.emit_pipeline_warp_specialized(
                mma,
                grid=(K // bk,),
                memory_registers=COPY_REGISTERS,
                in_specs=[plgpu.BlockSpec((bm, bk), lambda k: (0, k), transforms=transforms,
                                          memory_space=plgpu.SMEM),
                          plgpu.BlockSpec((bk, block_n), lambda k: (k, 0), transforms=transforms,
                                          memory_space=plgpu.SMEM)],
                wg_axis="wg",
                num_compute_wgs=2,
                max_concurrent_steps=stages,
                compute_context=context,
            )

        ignore = lambda *_, **__: None  # noqa: E731  (the allocations do not depend on the bodies)

        @functools.partial(
            pl.run_scoped,
            allocations=pipeline(ignore, ignore).get_allocations(x_gmem, w_gmem.at[0]),
            out_smem=plgpu.SMEM((2, bm, bn), out_dtype, transforms=_swizzled(bn, out_dtype)),
            collective_axes="wg",
        )
        def _scope(allocations, out_smem):
            wg = lax.axis_index("wg")
            loop, tile_and_block = work_items(cfg, used_gmem[0], N // block_n)

            @loop
            def _item(info):
                t, j = tile_and_block(info.index)
                g = group_gmem[t]

                def context(run_pipeline):
                    @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((bm, bn), jnp.float32))
                    def _acc(acc_ref):
                        run_pipeline(acc_ref)
                        acc = acc_ref[...].astype(out_dtype)
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous item's store left smem
                        out_smem[wg] = acc
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(out_smem.at[wg],
                                                o_gmem.at[pl.ds(t * bm, bm), pl.ds(j * block_n + wg * bn, bn)])

                def mma(_, x_smem, w_smem, acc_ref):
                    plgpu.wgmma(acc_ref, x_smem, w_smem.at[:, pl.ds(wg * bn, bn)])
                    plgpu.wgmma_wait(0)
                    return acc_ref

                pipeline(mma, context)(x_gmem.at[pl.ds(t * bm, bm), :],
                                       w_gmem.at[g].at[:, pl.ds(j * block_n, block_n)], allocations=allocations)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    return body
