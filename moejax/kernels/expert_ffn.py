"""Routed expert FFN: tokens x top-k assignments -> weighted sum of expert outputs, dropless.

Three plain-JAX paths compute the same function:
- "sorted": rows sorted by expert, each expert's rows padded to whole tiles, one small matmul per
  tile inside a loop that skips empty tiles. Work is ~ the routed FLOPs; the default on CPU.
- "ragged": `jax.lax.ragged_dot` over the sorted rows.
- "dense": every token through every expert, masked by the routing weights (E/k times the FLOPs).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.buckets import bucket

EXPERT_IMPLS = ("sorted", "ragged", "dense")
_f32 = jnp.float32


def activation(h, kind: str, limit: float, alpha: float):
    """h [..., 2I] = [gate | up] -> [..., I] in float32."""
    gate, up = jnp.split(h.astype(_f32), 2, axis=-1)
    if kind == "silu":
        return jax.nn.silu(gate) * up
    gate = jnp.minimum(gate, limit)  # GPT-OSS clamped SwiGLU
    up = jnp.clip(up, -limit, limit)
    return gate * jax.nn.sigmoid(gate * alpha) * (up + 1.0)


def _tile_rows(rows: int, experts: int) -> int:
    per_expert = max(rows // max(experts, 1), 1)
    return int(min(max(bucket(per_expert), 8), 256))


def expert_ffn(x, idx, weights, w_gate_up, w_down, b_gate_up=None, b_down=None, *,
               act="silu", limit=7.0, alpha=1.702, impl="sorted"):
    """x [N, D]; idx, weights [N, k]; w_gate_up [E, D, 2I]; w_down [E, I, D] -> [N, D] (x.dtype)."""
    fn = {"sorted": _sorted, "ragged": _ragged, "dense": _dense}.get(impl)
    if fn is None:
        raise ValueError(f"expert impl {impl!r} is not one of {EXPERT_IMPLS}")
    y = fn(x, idx, weights.astype(_f32), w_gate_up, w_down, b_gate_up, b_down, act, limit, alpha)
    return y.astype(x.dtype)


def _ffn(xs, wgu, wd, bgu, bd, act, limit, alpha):
    h = jnp.dot(xs, wgu, preferred_element_type=_f32)
    if bgu is not None:
        h = h + bgu.astype(_f32)
    a = activation(h, act, limit, alpha).astype(xs.dtype)
    y = jnp.dot(a, wd, preferred_element_type=_f32)
    return y if bd is None else y + bd.astype(_f32)


def _sort(idx, num_experts):
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # sorted row -> assignment
    counts = jnp.bincount(flat, length=num_experts)
    return flat, order, counts


def _sorted(x, idx, weights, wgu, wd, bgu, bd, act, limit, alpha):
    N, D = x.shape
    k = idx.shape[1]
    E = wgu.shape[0]
    R = N * k
    tm = _tile_rows(R, E)
    num_tiles = -(-R // tm) + min(E, R)
    flat, order, counts = _sort(idx, E)
    sorted_e = flat[order]
    tiles = -(-counts // tm)
    tile_end = jnp.cumsum(tiles)
    first_tile = tile_end - tiles
    first_row = jnp.cumsum(counts) - counts
    slot = first_tile[sorted_e] * tm + (jnp.arange(R) - first_row[sorted_e])
    src = jnp.full((num_tiles * tm,), N, jnp.int32).at[slot].set((order // k).astype(jnp.int32))
    x_tiles = jnp.concatenate([x, jnp.zeros((1, D), x.dtype)])[src].reshape(num_tiles, tm, D)
    tile_expert = jnp.searchsorted(tile_end, jnp.arange(num_tiles), side="right")

    def one_tile(args):
        xt, e = args

        def run(_):
            return _ffn(xt, wgu[e], wd[e], None if bgu is None else bgu[e], None if bd is None else bd[e],
                        act, limit, alpha)

        return jax.lax.cond(e < E, run, lambda _: jnp.zeros((tm, D), _f32), None)

    y_tiles = jax.lax.map(one_tile, (x_tiles, tile_expert)).reshape(num_tiles * tm, D)
    slot_of_assignment = jnp.zeros((R,), jnp.int32).at[order].set(slot.astype(jnp.int32))
    y = y_tiles[slot_of_assignment].reshape(N, k, D)
    return jnp.einsum("nkd,nk->nd", y, weights)


def _ragged(x, idx, weights, wgu, wd, bgu, bd, act, limit, alpha):
    N, D = x.shape
    k = idx.shape[1]
    flat, order, counts = _sort(idx, wgu.shape[0])
    xs = x[order // k]
    e = flat[order]
    h = jax.lax.ragged_dot(xs, wgu, counts, preferred_element_type=_f32)
    if bgu is not None:
        h = h + bgu[e].astype(_f32)
    a = activation(h, act, limit, alpha).astype(x.dtype)
    y = jax.lax.ragged_dot(a, wd, counts, preferred_element_type=_f32)
    if bd is not None:
        y = y + bd[e].astype(_f32)
    y = jnp.zeros((N * k, D), _f32).at[order].set(y).reshape(N, k, D)
    return jnp.einsum("nkd,nk->nd", y, weights)


def _dense(x, idx, weights, wgu, wd, bgu, bd, act, limit, alpha):
    E = wgu.shape[0]
    h = jnp.einsum("nd,edf->enf", x, wgu, preferred_element_type=_f32)
    if bgu is not None:
        h = h + bgu.astype(_f32)[:, None]
    a = activation(h, act, limit, alpha).astype(x.dtype)
    y = jnp.einsum("enf,efd->end", a, wd, preferred_element_type=_f32)
    if bd is not None:
        y = y + bd.astype(_f32)[:, None]
    combine = jnp.zeros((x.shape[0], E), _f32).at[jnp.arange(x.shape[0])[:, None], idx].add(weights)
    return jnp.einsum("end,ne->nd", y, combine)
