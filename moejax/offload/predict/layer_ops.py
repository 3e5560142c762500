"""Small per-layer functions the predictors run through `LayeredSteps.layers[i](fn, ...)` (jitted once per layer
structure): normalize as a layer's MLP norm does, build the quasi-hidden state, route from an input or from logits."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.models.moe import route

_f32 = jnp.float32


def mlp_norm(graphdef: nnx.GraphDef, state: nnx.State, h: jax.Array) -> jax.Array:
    """h [N, D] -> this layer's MLP norm of h (its router input), float32."""
    norm = nnx.merge(graphdef, state).mlp_norm
    return norm(h.astype(norm.weight[...].dtype)).astype(_f32)


def quasi_hidden(graphdef: nnx.GraphDef, state: nnx.State, h: jax.Array, vectors: jax.Array, idx: jax.Array,
                 weights: jax.Array) -> jax.Array:
    """r_l [N, D] and MoE layer l's routing (idx, weights [N, k]) with its default vectors [E, D] -> the
    quasi-hidden state norm_next(r_l + Σ_k w_k·d_{l, idx_k}) under this (the next MoE) layer's norm."""
    h = h.astype(_f32) + jnp.einsum("nk,nkd->nd", weights, vectors[idx])
    return mlp_norm(graphdef, state, h)


def route_input(graphdef: nnx.GraphDef, state: nnx.State, y: jax.Array) -> tuple[jax.Array, jax.Array]:
    """This MoE layer's router on y [N, D] -> (expert ids [N, k], weights [N, k])."""
    return nnx.merge(graphdef, state).mlp.route_tokens(y.reshape(-1, y.shape[-1]))


def route_logits(graphdef: nnx.GraphDef, state: nnx.State, logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Router logits [N, E] (true or predicted) -> this MoE layer's choice (ids, weights), its bias included."""
    mlp = nnx.merge(graphdef, state).mlp
    bias = None if mlp.correction_bias is None else mlp.correction_bias[...]
    return route(mlp.cfg, logits.astype(_f32), bias)
