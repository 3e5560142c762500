"""Padding shared by the Pallas attention kernels: Triton wants power-of-two tiles, and the interpreter clamps
dynamic slice starts (a slice past the end would silently shift data), so inputs are padded to whole tiles. (The
grouped GEMM masks its loads and stores instead.)"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def pad_axis(a: jax.Array, axis: int, size: int) -> jax.Array:
    """Zero-pad `axis` of `a` up to `size` (no copy when it already has that size)."""
    if a.shape[axis] == size:
        return a
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, size - a.shape[axis])
    return jnp.pad(a, widths)

