"""Expert FFN over rows sorted by expert: the CPU windowed path and the Pallas kernels."""
from __future__ import annotations

import jax.numpy as jnp

from moejax.kernels.activation import glu_of
from moejax.kernels.expert_ffn.baselines import dense
from moejax.kernels.grouped_matmul import pallas as gmm
from moejax.kernels.grouped_matmul.xla import for_each_group
from moejax.kernels.padding import pad_to_16
from moejax.kernels.routing import combine, dispatch, gather_rows

_f32 = jnp.float32


def ffn_rows(xs, wgu, wd, bgu, bd, act, limit, alpha):
    """One expert's FFN on rows xs [m, D] -> float32 [m, D]."""
    h = jnp.dot(xs, wgu, preferred_element_type=_f32)
    if bgu is not None:
        h = h + bgu.astype(_f32)
    y = jnp.dot(glu_of(h, act, limit, alpha).astype(xs.dtype), wd, preferred_element_type=_f32)
    return y if bd is None else y + bd.astype(_f32)


DENSE_BELOW_ROWS_PER_EXPERT = 8  # measured crossover (launch.bench kernels): below it, one weight pass per expert
# over every token beats the per-group loop, whose windows are at least 8 rows anyway


def xla(x, idx, weights, wgu, wd, bgu, bd, act, limit, alpha):
    if x.shape[0] * idx.shape[1] < DENSE_BELOW_ROWS_PER_EXPERT * wgu.shape[0]:  # decode-sized: static shapes
        return dense(x, idx, weights, wgu, wd, bgu, bd, act, limit, alpha)
    routing = dispatch(idx, wgu.shape[0])
    pick = lambda b, g: None if b is None else b[g]  # noqa: E731
    ys = for_each_group(gather_rows(x, routing, idx.shape[1]), routing.group_sizes, x.shape[1],
                        lambda g, rows: ffn_rows(rows, wgu[g], wd[g], pick(bgu, g), pick(bd, g), act, limit, alpha))
    return combine(ys, routing, weights)


def _pad_halves(w, axis: int):
    """Pad each of the [gate | up] halves along `axis` to a multiple of 16 (test-sized shapes only)."""
    gate, up = jnp.split(w, 2, axis=axis)
    return jnp.concatenate([pad_to_16(gate, axis), pad_to_16(up, axis)], axis=axis)


def _pallas(x, idx, weights, wgu, wd, bgu, bd, act, limit, alpha, interpret):
    N, D = x.shape
    k = idx.shape[1]
    E = wgu.shape[0]
    routing = dispatch(idx, E)
    bm = gmm.blocks(N * k, E, 16, 16)[0]
    # Gather straight into the padded row layout; spare rows repeat real rows and are never stored.
    order = jnp.pad(routing.order, (0, gmm.padded_rows(N * k, bm) - N * k))
    xs = pad_to_16(x[order // k], 1)
    wgu_p = _pad_halves(pad_to_16(wgu, 1), 2)
    bgu_p = None if bgu is None else _pad_halves(bgu, 1)
    a = gmm.grouped_call(xs, wgu_p, bgu_p, routing.group_sizes, bm=bm, out_dtype=x.dtype, act=act, limit=limit,
                         alpha=alpha, interpret=interpret)
    wd_p = pad_to_16(pad_to_16(wd, 1), 2)
    bd_p = None if bd is None else pad_to_16(bd, 1)
    y = gmm.grouped_call(a, wd_p, bd_p, routing.group_sizes, bm=bm, out_dtype=_f32, interpret=interpret)
    return combine(y[: N * k, :D], routing, weights)


def pallas(*args):
    return _pallas(*args, interpret=False)


def pallas_interpret(*args):
    return _pallas(*args, interpret=True)
