"""Routed expert FFN, dropless: tokens x top-k assignments -> sum_j w[n,j] * down_e(glu(gate_up_e(x_n))).

Backends:
- `pallas` (GPU) / `pallas_interpret` (CPU tests): dispatch, one grouped kernel for gate/up with the activation
  fused (the [M, 2I] intermediate never reaches HBM), one grouped kernel for down, combine.
- `mosaic` (Hopper GPU, 16-bit weights): dispatch into the group-aligned layout, Mosaic GPU grouped kernels for
  gate/up and down, the activation in XLA between them, combine.
- `auto` (grouped_matmul.auto.expert_auto): `xla` on CPU (`dense` for a few tokens); on a GPU what the last GPU run
  measured fastest for the shape.
- `xla` (CPU): dispatch; up to 32 rows per expert on average, C static slots per expert and one batched matmul
  (C the smallest of a few static sizes that holds the busiest expert), else per non-empty expert a few row
  windows (grouped_matmul.xla).
- `tiled`: each expert's rows padded to whole tiles, one batched matmul over tiles with their experts' weights
  gathered; differentiable, so training uses it (expert_ffn.tiled).
- `ragged_dot`: `jax.lax.ragged_dot` for both projections (baseline); `ragged_dot_cudnn` the same through XLA's
  cuDNN ragged-dot fusion on a GPU (grouped_matmul.ragged_cudnn: needs its XLA flag set at start-up).
- `dense`: every token through every expert, masked by the routing weights (E/k times the FLOPs; baseline).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from moejax.kernels.expert_ffn import baselines, grouped, tiled
from moejax.kernels.grouped_matmul.auto import expert_auto
from moejax.kernels.platform import resolve

BACKENDS = ("pallas", "pallas_interpret", "mosaic", "xla", "tiled", "ragged_dot", "ragged_dot_cudnn", "dense")


def expert_ffn(x: ArrayLike, idx: ArrayLike, weights: ArrayLike, w_gate_up: ArrayLike, w_down: ArrayLike,
               b_gate_up: ArrayLike | None = None, b_down: ArrayLike | None = None, *, act: str = "silu",
               limit: float = 7.0, alpha: float = 1.702, backend: str = "auto") -> jax.Array:
    """x [N, D]; idx, weights [N, k]; w_gate_up [E, D, 2I] ([gate | up]); w_down [E, I, D]; biases [E, 2I],
    [E, D] -> [N, D] in x.dtype (float32 accumulation)."""
    x, idx, weights, w_gate_up, w_down = (jnp.asarray(a) for a in (x, idx, weights, w_gate_up, w_down))
    b_gate_up, b_down = (None if b is None else jnp.asarray(b) for b in (b_gate_up, b_down))
    backend = resolve("expert_ffn", backend, BACKENDS,
                      auto=expert_auto(idx.size, w_gate_up.shape[0], w_gate_up.dtype, fused=True, top_k=idx.shape[1]))
    fn = {"pallas": grouped.pallas, "pallas_interpret": grouped.pallas_interpret, "mosaic": grouped.mosaic,
          "xla": grouped.xla,
          "tiled": tiled.tiled, "ragged_dot": baselines.ragged_dot, "ragged_dot_cudnn": baselines.ragged_dot_cudnn,
          "dense": baselines.dense}[backend]
    y = fn(x, idx, weights.astype(jnp.float32), w_gate_up, w_down, b_gate_up, b_down, act, limit, alpha)
    return y.astype(x.dtype)
