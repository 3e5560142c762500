"""The matmul precision moejax asks for: float32 operands get true float32 dots. JAX's default lets GPUs round
float32 operands to TF32 (10 mantissa bits), which moves a float32 model's logits far past float32 rounding
(transformers under torch's defaults does not); 16-bit operands take the default, which multiplies exactly."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from moejax import row_tiles


def for_operands(dtype: DTypeLike) -> jax.lax.Precision | None:
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def f32_einsum(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """jnp.einsum with a float32 result, at the precision `a`'s dtype asks for (batch_invariant: a row-wise product
    with a weight matrix in fixed row tiles)."""
    if row_tiles.active() and (out := row_tiles.einsum(spec, a, b, for_operands(a.dtype))) is not None:
        return out
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32, precision=for_operands(a.dtype))


def f32_dot(a: jax.Array, b: jax.Array) -> jax.Array:
    """jnp.dot with a float32 result, at the precision `a`'s dtype asks for (batch_invariant: in fixed row tiles)."""
    if row_tiles.active() and b.ndim == 2:
        return row_tiles.dot(a, b, for_operands(a.dtype))
    return jnp.dot(a, b, preferred_element_type=jnp.float32, precision=for_operands(a.dtype))
