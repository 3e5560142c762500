"""grouped_matmul(x [M, K], w [G, K, N], group_sizes [G]) -> [M, N]: rows grouped in order, group g's rows
times w[g]; rows past sum(group_sizes) are 0. float32 accumulation, output in x.dtype.

Backends: `pallas` (Triton GPU kernel), `pallas_interpret` (the same kernel interpreted, CPU tests), `mosaic`
(Mosaic GPU kernel for Hopper, 16-bit operands), `xla` (plain JAX for CPU), `ragged_dot` (`jax.lax.ragged_dot`, a
baseline), `ragged_dot_cudnn` (the same through XLA's cuDNN ragged-dot fusion on a GPU: ragged_cudnn.py),
`reference` (dense masked, G times the FLOPs). `auto`: see grouped_matmul.auto.expert_auto.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from moejax.kernels.grouped_matmul import mosaic, pallas, ragged_cudnn, reference, xla
from moejax.kernels.grouped_matmul.auto import expert_auto
from moejax.kernels.grouped_matmul.groups import zero_rows_of_no_group
from moejax.kernels.platform import resolve
from moejax.kernels.precision import for_operands

BACKENDS = ("pallas", "pallas_interpret", "mosaic", "xla", "ragged_dot", "ragged_dot_cudnn", "reference")


def _ragged_dot(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    y = jax.lax.ragged_dot(x, w, group_sizes.astype(jnp.int32), preferred_element_type=jnp.float32,
                           precision=for_operands(x.dtype))
    return zero_rows_of_no_group(y, group_sizes)


def grouped_matmul(x: ArrayLike, w: ArrayLike, group_sizes: ArrayLike, *, backend: str = "auto") -> jax.Array:
    x, w, group_sizes = jnp.asarray(x), jnp.asarray(w), jnp.asarray(group_sizes)
    if x.ndim != 2 or w.ndim != 3 or group_sizes.shape != (w.shape[0],) or x.shape[1] != w.shape[1]:
        raise ValueError(f"grouped_matmul: need x [M, K], w [G, K, N], group_sizes [G]; got x {x.shape}, "
                         f"w {w.shape}, group_sizes {group_sizes.shape}")
    backend = resolve("grouped_matmul", backend, BACKENDS,
                      auto=expert_auto(x.shape[0], w.shape[0], x.dtype, fused=False))
    if backend == "mosaic":
        return mosaic.grouped_matmul(x, w, group_sizes)
    if backend in ("pallas", "pallas_interpret"):
        return pallas.grouped_matmul(x, w, group_sizes, interpret=backend == "pallas_interpret")
    fn = {"xla": xla.grouped_matmul, "ragged_dot": _ragged_dot, "ragged_dot_cudnn": ragged_cudnn.grouped_matmul,
          "reference": reference.grouped_matmul}[backend]
    return fn(x, w, group_sizes).astype(x.dtype)
