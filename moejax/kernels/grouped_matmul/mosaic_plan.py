"""The Mosaic GPU grouped GEMM's configuration and the plan it derives from it (shared-memory stages, the persistent
loop's work items), apart from the kernels (mosaic.py, mosaic_ws.py) so that the tuning table and both kernel
bodies import it without importing each other."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

try:
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # a JAX without Mosaic GPU: mosaic_unavailable() says so
    plgpu = None  # type: ignore[assignment]  # a module or None: checked before use

from moejax.kernels.platform import SHARED_MEMORY


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
    bm: int = 128  # rows per tile: a multiple of 64 (one warpgroup MMA is 64 rows)
    bn: int = 128  # columns per block
    bk: int = 64  # depth per pipeline step (64 bf16 = one 128-byte swizzled row)
    stages: int = 4  # pipeline steps in flight (shared memory holds this many x and w blocks)
    cols_minor: bool = True  # consecutive work items take the column blocks of one row tile (x stays in L2)
    compute_wgs: int = 1  # 2: warp-specialized (mosaic_ws.py): a copy warpgroup feeds two MMA warpgroups, each
    #                       with its own bn columns of a 2*bn block

    @property
    def block_n(self) -> int:
        """Columns per work item."""
        return self.bn * self.compute_wgs


def mosaic_unavailable() -> str | None:
    if plgpu is None:
        return f"this JAX ({jax.__version__}) has no Pallas Mosaic GPU backend"
    return None


def work_items(cfg: MosaicConfig, used: jax.Array, grid_n: int) -> tuple[Callable, Callable[[tuple], tuple]]:
    """The persistent loop over (row tile, column block) items of the used tiles: its decorator, and a function
    of the loop's index giving (t, j)."""
    loop = plgpu.nd_loop((used, grid_n) if cfg.cols_minor else (grid_n, used), collective_axes="sm")
    return loop, (lambda index: index if cfg.cols_minor else index[::-1])


SHARED_BYTES = SHARED_MEMORY[(9, 0)] - 2 * 1024  # Hopper's per block, less 2 KiB for the barriers


def fitted_stages(cfg: MosaicConfig, in_dtype: DTypeLike, out_dtype: DTypeLike) -> int:
    """The ring's depth that fits in shared memory beside the output tile(s), at least 2: a float32 output (the
    expert FFN's down product) takes twice the bytes of the bfloat16 one the sweep tuned for."""
    slot = (cfg.bm * cfg.bk + cfg.bk * cfg.block_n) * jnp.dtype(in_dtype).itemsize
    out = cfg.compute_wgs * cfg.bm * cfg.bn * jnp.dtype(out_dtype).itemsize
    return max(2, min(cfg.stages, (SHARED_BYTES - out) // slot))
