"""Dispatch and combine for routed experts: token x top-k assignments -> rows sorted by expert and back.

Dropless with static shapes: every one of the N*k assignments gets a row; `group_sizes` says how many rows each
expert owns, in expert order, so grouped GEMMs run over contiguous row ranges.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

_f32 = jnp.float32


class Routing(NamedTuple):
    order: jax.Array  # [N*k] sorted row -> flat assignment n*k + j
    inverse: jax.Array  # [N*k] flat assignment -> sorted row
    group_sizes: jax.Array  # [E] rows per expert (int32), sum == N*k
    expert_of_row: jax.Array  # [N*k] expert id of each sorted row


def dispatch(idx: jax.Array, num_experts: int) -> Routing:
    """idx [N, k] expert ids -> Routing. The sort is stable, so an expert's rows keep token order."""
    flat = idx.reshape(-1).astype(jnp.int32)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=jnp.int32))
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return Routing(order, inverse, sizes, flat[order])


def gather_rows(x: jax.Array, routing: Routing, k: int) -> jax.Array:
    """x [N, D] -> [N*k, D] in sorted (expert) order."""
    return x[routing.order // k]


def combine(y_sorted: jax.Array, routing: Routing, weights: jax.Array) -> jax.Array:
    """y_sorted [N*k, D] expert outputs in sorted order, weights [N, k] -> float32 [N, D] = sum_j w[n,j] y[n,j].
    A gather, not a scatter-add: each token reads its k rows, so the result is deterministic. Written as a product
    and a sum, not a dot, so that XLA fuses the gather, the conversion and the sum into one pass over the rows
    (a dot of contracting size k could go to a batched GEMM on a float32 copy of them, and to TF32 on a GPU)."""
    N, k = weights.shape
    y = y_sorted[routing.inverse].reshape(N, k, -1)
    return jnp.sum(y.astype(_f32) * weights.astype(_f32)[:, :, None], axis=1)
