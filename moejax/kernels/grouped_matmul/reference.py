"""Grouped GEMM reference in plain JAX: every row through every group's weights, then each row keeps its own
group's result. G times the FLOPs; obviously right, and the "all experts" baseline of the benchmark."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.kernels.grouped_matmul.groups import group_of_rows
from moejax.kernels.precision import f32_einsum


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """x [M, K], w [G, K, N] -> float32 [M, N]."""
    gid = group_of_rows(group_sizes, x.shape[0])
    y = f32_einsum("mk,gkn->mgn", x, w)
    mine = jnp.take_along_axis(y, jnp.minimum(gid, w.shape[0] - 1)[:, None, None], axis=1)[:, 0]
    return jnp.where((gid < w.shape[0])[:, None], mine, 0.0)
