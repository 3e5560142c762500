"""The two plain alternatives the grouped paths must beat (`python -m launch.bench kernels`)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.kernels.activation import glu_of
from moejax.kernels.grouped_matmul import ragged_cudnn
from moejax.kernels.precision import f32_einsum, for_operands
from moejax.kernels.routing import combine, dispatch, gather_rows

_f32 = jnp.float32


def ragged_dot(x: jax.Array, idx: jax.Array, weights: jax.Array, wgu: jax.Array, wd: jax.Array, bgu: jax.Array | None,
               bd: jax.Array | None, act: str, limit: float, alpha: float) -> jax.Array:
    routing = dispatch(idx, wgu.shape[0])
    xs = gather_rows(x, routing, idx.shape[1])
    e = routing.expert_of_row
    h = jax.lax.ragged_dot(xs, wgu, routing.group_sizes, preferred_element_type=_f32,
                           precision=for_operands(xs.dtype))
    if bgu is not None:
        h = h + bgu[e].astype(_f32)
    y = jax.lax.ragged_dot(glu_of(h, act, limit, alpha).astype(x.dtype), wd, routing.group_sizes,
                           preferred_element_type=_f32, precision=for_operands(xs.dtype))
    if bd is not None:
        y = y + bd[e].astype(_f32)
    return combine(y, routing, weights)


def ragged_dot_cudnn(x: jax.Array, idx: jax.Array, weights: jax.Array, wgu: jax.Array, wd: jax.Array,
                     bgu: jax.Array | None, bd: jax.Array | None, act: str, limit: float, alpha: float) -> jax.Array:
    """ragged_dot through XLA's cuDNN ragged-dot fusion (grouped_matmul.ragged_cudnn: refused on a GPU without
    its flag)."""
    why = ragged_cudnn.unavailable()
    if why:
        raise ValueError(why)
    return ragged_dot(x, idx, weights, wgu, wd, bgu, bd, act, limit, alpha)


def dense(x: jax.Array, idx: jax.Array, weights: jax.Array, wgu: jax.Array, wd: jax.Array, bgu: jax.Array | None,
          bd: jax.Array | None, act: str, limit: float, alpha: float) -> jax.Array:
    E = wgu.shape[0]
    # Tokens broadcast over experts make it a batched matmul over the weights as stored; "nd,edf->enf" had XLA
    # transpose every expert's weights on each call (each decode step: 15 ms a layer here).
    h = f32_einsum("end,edf->enf", jnp.broadcast_to(x, (E, *x.shape)), wgu)
    if bgu is not None:
        h = h + bgu.astype(_f32)[:, None]
    y = f32_einsum("enf,efd->end", glu_of(h, act, limit, alpha).astype(x.dtype), wd)
    if bd is not None:
        y = y + bd.astype(_f32)[:, None]
    mix = jnp.zeros((x.shape[0], E), _f32).at[jnp.arange(x.shape[0])[:, None], idx].add(weights)
    return jnp.einsum("end,ne->nd", y, mix)
