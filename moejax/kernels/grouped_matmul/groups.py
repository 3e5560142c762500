"""Which group each row belongs to; rows past sum(group_sizes) belong to none and come back as 0."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def group_of_rows(group_sizes: jax.Array, rows: int) -> jax.Array:
    """[rows] group id of each row; rows past sum(group_sizes) get G (no group)."""
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    return jnp.searchsorted(ends, jnp.arange(rows, dtype=jnp.int32), side="right")


def zero_rows_of_no_group(y: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """y [M, N] -> y with the rows past sum(group_sizes) set to 0."""
    return jnp.where((jnp.arange(y.shape[0]) < jnp.sum(group_sizes))[:, None], y, 0)
