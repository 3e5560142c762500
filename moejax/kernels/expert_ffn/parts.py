"""The GPU expert FFN backends (`pallas`, `mosaic`) as a list of parts, each one step of the call (route the tokens,
each product, the activation where it is not fused, combine), so that `python -m launch.bench kernels` can time
each part alone on the previous parts' outputs and say where a call's time goes beyond its kernels. The backends
run the same parts in order (expert_ffn.grouped), so what is timed is what runs.

A part takes the state so far (a dict of arrays) and returns only the entries it adds."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from moejax.kernels.activation import glu_of
from moejax.kernels.grouped_matmul import mosaic as mosaic_gmm
from moejax.kernels.grouped_matmul import pallas as gmm
from moejax.kernels.grouped_matmul import tuning
from moejax.kernels.grouped_matmul.aligned import aligned_layout
from moejax.kernels.routing import combine, dispatch, gather_rows

_f32 = jnp.float32
State = dict[str, Any]
Part = tuple[str, Callable[[State], State]]


def start(x: jax.Array, idx: jax.Array, weights: jax.Array, wgu: jax.Array, wd: jax.Array, bgu: jax.Array | None,
          bd: jax.Array | None) -> State:
    return dict(x=x, idx=idx, weights=weights, wgu=wgu, wd=wd, bgu=bgu, bd=bd)


def run(parts: list[Part], state: State) -> jax.Array:
    for _, part in parts:
        state = {**state, **part(state)}
    return state["out"]


def pallas_parts(s: State, act: str, limit: float, alpha: float, interpret: bool,
                 gather_in_kernel: bool = False) -> list[Part]:
    """Two kernel calls on the rows as they are (the kernels mask their loads and stores: nothing is padded or
    sliced around them). The down product's rows come out in x.dtype, rounded once per expert as transformers'
    experts round theirs, and `combine` sums the k of each token in float32: in bfloat16 that halves the bytes
    of the largest pass outside the kernels (its write and combine's read of [N*k, D]).

    gather_in_kernel: the gate/up kernel reads each row from the tokens by index instead of from a copy of them
    in expert order (no [N*k, D] write and read before it); the bench times it beside the default, which stays
    the copy until a GPU run says the gathered loads keep the kernel's rate."""
    x, idx, wgu, wd = s["x"], s["idx"], s["wgu"], s["wd"]
    M, E, k = idx.size, wgu.shape[0], idx.shape[1]
    up, down = gmm.config_for(M, wgu, fused=True), gmm.config_for(M, wd, fused=False)

    def route(s: State) -> State:
        routing = dispatch(s["idx"], E)
        if gather_in_kernel:
            return dict(routing=routing, tokens=routing.order // k)
        return dict(routing=routing, xs=gather_rows(s["x"], routing, k))

    def gate_up(s: State) -> State:
        xs, tokens = (s["x"], s["tokens"]) if gather_in_kernel else (s["xs"], None)
        return dict(a=gmm.grouped_call(xs, s["wgu"], s["bgu"], s["routing"].group_sizes, cfg=up, out_dtype=x.dtype,
                                       act=act, limit=limit, alpha=alpha, interpret=interpret, rows=tokens))

    def down_(s: State) -> State:
        return dict(y=gmm.grouped_call(s["a"], s["wd"], s["bd"], s["routing"].group_sizes, cfg=down,
                                       out_dtype=x.dtype, interpret=interpret))

    def combine_(s: State) -> State:
        return dict(out=combine(s["y"], s["routing"], s["weights"]))

    return [("route", route), ("gate_up", gate_up), ("down", down_), ("combine", combine_)]


def mosaic_parts(s: State, act: str, limit: float, alpha: float) -> list[Part]:
    """Gate/up and down as Mosaic GPU grouped GEMMs over the group-aligned layout; the activation and biases in
    XLA between them (one elementwise pass over [M, 2I]). Tokens are gathered straight into the aligned layout
    and the outputs read straight from it, so the layout costs no pass of its own."""
    x, idx, wgu = s["x"], s["idx"], s["wgu"]
    N, D = x.shape
    k, E, I2 = idx.shape[1], wgu.shape[0], wgu.shape[2]
    M = N * k
    mosaic_gmm.check_operands(x, wgu)
    cfg = tuning.mosaic_config(M, E, min(D, I2))

    def route(s: State) -> State:
        routing = dispatch(s["idx"], E)
        layout = aligned_layout(routing.group_sizes, M, cfg.bm)
        token = jnp.where(layout.source < M, routing.order[jnp.minimum(layout.source, M - 1)] // k, N)
        xs = jnp.take(s["x"], token, axis=0, mode="fill", fill_value=0)  # padding rows: token N -> zeros
        return dict(routing=routing._replace(inverse=layout.position[routing.inverse]), xs=xs,
                    tile_group=layout.tile_group)

    def product(a: jax.Array, w: jax.Array, b: jax.Array | None, tile_group: jax.Array,
                out_dtype: DTypeLike) -> jax.Array:
        ap, wp = mosaic_gmm.pad_k_n(a, w, cfg)
        y = mosaic_gmm.aligned_call(ap, wp, tile_group, cfg, out_dtype)[:, :w.shape[2]]
        if b is None:
            return y
        group = jnp.repeat(jnp.maximum(tile_group, 0), cfg.bm)  # padding rows: any group, never read back
        return y.astype(_f32) + b.astype(_f32)[group]

    def gate_up(s: State) -> State:
        return dict(h=product(s["xs"], s["wgu"], s["bgu"], s["tile_group"], _f32 if s["bgu"] is not None else x.dtype))

    def activation(s: State) -> State:
        return dict(a=glu_of(s["h"].astype(_f32), act, limit, alpha).astype(x.dtype))

    def down(s: State) -> State:
        return dict(y=product(s["a"], s["wd"], s["bd"], s["tile_group"], _f32))

    def combine_(s: State) -> State:
        return dict(out=combine(s["y"], s["routing"], s["weights"]))

    return [("route", route), ("gate_up", gate_up), ("activation", activation), ("down", down),
            ("combine", combine_)]
