"""Routed expert FFN: tokens x top-k assignments -> weighted sum of expert outputs, dropless.

Three plain-JAX paths compute the same function:
- "sorted": rows sorted by expert; a loop over the non-empty experts runs each expert's rows as a few
  row windows of the sorted array (whole tiles, then one remainder window whose size is picked from a
  small set of static sizes). Work is ~ the routed FLOPs; the default on CPU.
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


def _window_sizes(rows: int, experts: int, quantum: int = 8) -> list[int]:
    """Static window sizes for the sorted path, largest last: multiples of `quantum` up to 8 quanta, then
    8 steps per doubling (at most ~12% padding per window) up to the tile, ~2x the mean rows per expert."""
    tile = min(max(bucket(2 * rows // max(experts, 1)), quantum), 256, bucket(rows, quantum))
    sizes, m = [], quantum
    while m < tile:
        sizes.append(m)
        m += max(quantum, (1 << (m.bit_length() - 1)) // 8)
    return sizes + [tile]


def expert_ffn(x, idx, weights, w_gate_up, w_down, b_gate_up=None, b_down=None, *,
               act="silu", limit=7.0, alpha=1.702, impl="sorted"):
    """x [N, D]; idx, weights [N, k]; w_gate_up [E, D, 2I]; w_down [E, I, D] -> [N, D] (x.dtype)."""
    fn = {"sorted": _sorted, "ragged": _ragged, "dense": _dense}.get(impl)
    if fn is None:
        raise ValueError(f"expert impl {impl!r} is not one of {EXPERT_IMPLS}")
    # numpy inputs would be indexed by traced expert ids inside the loops: make them jax arrays first
    x, idx, weights, w_gate_up, w_down, b_gate_up, b_down = (
        None if a is None else jnp.asarray(a) for a in (x, idx, weights, w_gate_up, w_down, b_gate_up, b_down))
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
    # On CPU a matmul's cost is ~ a fixed part (streaming the expert's weights) + a part per row, so each
    # expert should cost one weight pass on barely padded rows. Each expert's rows are a contiguous
    # range of the sorted array: whole tiles, then one window of the smallest static size that covers
    # the rest. A window may run past the expert's rows into the next experts' rows (or the zero
    # padding at the end); experts run in ascending order, so those rows are rewritten later.
    N, D = x.shape
    k = idx.shape[1]
    E = wgu.shape[0]
    R = N * k
    sizes = _window_sizes(R, E)
    tile = sizes[-1]
    flat, order, counts = _sort(idx, E)
    starts = jnp.cumsum(counts) - counts
    xs = jnp.concatenate([x[order // k], jnp.zeros((tile, D), x.dtype)])
    active = jnp.nonzero(counts > 0, size=E, fill_value=0)[0]  # ascending expert ids
    size_of = jnp.asarray(sizes, jnp.int32)

    def expert(i, ys):
        e = active[i]
        c, s0 = counts[e], starts[e]
        w1, w2 = wgu[e], wd[e]
        b1, b2 = (None if bgu is None else bgu[e]), (None if bd is None else bd[e])

        def window(size, off):
            return _ffn(jax.lax.dynamic_slice_in_dim(xs, off, size), w1, w2, b1, b2, act, limit, alpha)

        full = c // tile
        ys = jax.lax.fori_loop(0, full, lambda t, ys: jax.lax.dynamic_update_slice_in_dim(
            ys, window(tile, s0 + t * tile), s0 + t * tile, 0), ys)
        off, rest = s0 + full * tile, c - full * tile
        # Branch 0 (nothing left) writes zeros past this expert: harmless, as above. Every branch
        # returns a full tile so that the update of `ys` stays outside the switch (in place).
        branches = [lambda: jnp.zeros((tile, D), _f32)] + [
            (lambda s=s: jnp.pad(window(s, off), ((0, tile - s), (0, 0)))) for s in sizes]
        which = jnp.where(rest == 0, 0, 1 + jnp.sum(size_of < rest))
        return jax.lax.dynamic_update_slice_in_dim(ys, jax.lax.switch(which, branches), off, 0)

    ys = jax.lax.fori_loop(0, jnp.sum(counts > 0), expert, jnp.zeros((R + tile, D), _f32))
    y = ys[jnp.argsort(order)].reshape(N, k, D)  # sorted row -> assignment (n, j)
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
