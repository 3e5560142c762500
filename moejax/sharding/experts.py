"""Routed experts as shard_map programs over a 1-D mesh (axis "x"); every variant computes the single-device
expert FFN. Tokens arrive split by rows over the devices (data parallel); `local_ffn(x, idx, weights, experts)`
is the single-device routed FFN (moejax.models.moe.MoEBlock.routed) applied to whatever each device holds.

- replicated: every device holds all experts and runs its own tokens.
- async_ep (MoE-Prefill §6.2): weights stored split by expert as for ep, but each layer's full expert set is
  all-gathered (shard_map reshards the P("x") weights to replicated) and every device runs its own tokens
  locally: the gather depends only on the weights, so XLA may run it ahead, under earlier layers' compute.
- tp: every expert's width (I) split over the devices ([gate | up] columns interleaved per device at load,
  `tp_columns`); each device runs all tokens through its slice. Under attn=dp the tokens are all-gathered first
  and a reduce-scatter sums the partial outputs back onto the tokens' devices (Table 1's DP+TP row); under
  attn=tp every device already holds every token and a psum adds the partial outputs.
- ep, exchange=gather: all-gather the tokens, each device runs the choices that fall on its E/P experts
  (the rest weigh 0), a reduce-scatter sums the partial outputs back onto the tokens' devices.
- ep, exchange=all_to_all: each (token, choice) row goes to the device owning its expert in padded, dropless
  buffers (P x n*k rows: any device may receive every row), the owner runs its experts (top-1, unweighted),
  and a second all-to-all brings the rows back for the weighted sum.
Under attn=tp every device holds every token: the programs that split tokens take each device's rows of the
replicated input and all-gather their outputs back."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from moejax.layout import Layout
from moejax.models.moe import ExpertFFN, MoEBlock

AXIS = "x"
ArrayT = TypeVar("ArrayT", np.ndarray, jax.Array)  # a checkpoint's numpy array or a jax one
_f32 = jnp.float32


def sharded_routed(layout: Layout, mesh: Mesh, local_ffn: ExpertFFN, x2: jax.Array, idx: jax.Array | None,
                   weights: jax.Array | None, experts: dict[str, jax.Array],
                   route: Callable[[jax.Array], tuple[jax.Array, jax.Array]] | None = None) -> jax.Array:
    """x2 [N, D], idx / weights [N, k] -> [N, D] in x2.dtype, as local_ffn on one device would give.
    With `route` (x2 -> idx, weights) instead of idx/weights, routing runs inside the program on each device's
    tokens (a top-k over tokens split across devices would otherwise be gathered by the partitioner)."""
    n_dev = mesh.shape[AXIS]
    N = x2.shape[0]
    replicate = layout.attn == "tp" and layout.experts != "tp"  # tokens replicated outside, split inside
    if replicate:  # keeps the program's row split from spreading back into head-split attention
        x2 = jax.lax.with_sharding_constraint(x2, NamedSharding(mesh, P()))
    pad = -N % n_dev  # shard_map splits rows evenly: pad with tokens of weight 0
    if pad:
        x2 = jnp.pad(x2, ((0, pad), (0, 0)))
        if route is None:
            assert idx is not None and weights is not None  # given when routing is not
            idx, weights = jnp.pad(idx, ((0, pad), (0, 0))), jnp.pad(weights, ((0, pad), (0, 0)))
    names = sorted(experts)
    token_spec = P(AXIS)
    if layout.experts in ("replicated", "async_ep"):
        body, expert_spec = (lambda x, i, w, *ws: local_ffn(x, i, w, dict(zip(names, ws, strict=True)))), P()
    elif layout.experts == "tp":
        split = layout.attn == "dp"
        body, token_spec = _tp_body(local_ffn, names, split), (P(AXIS) if split else P())
        expert_spec = None  # per array below
    elif layout.exchange == "gather":
        body, expert_spec = _gather_body(local_ffn, names, n_dev), P(AXIS)
    else:
        body, expert_spec = _all_to_all_body(local_ffn, names, n_dev), P(AXIS)
    specs = [TP_SPECS[k] for k in names] if expert_spec is None else [expert_spec] * len(names)
    out_spec = token_spec
    if replicate:  # outputs back to every device (an all-gather): head-split attention holds every token
        body, out_spec = _gathered_outputs(body), P()
    if route is None:
        run = jax.shard_map(body, mesh=mesh, in_specs=(token_spec,) * 3 + tuple(specs), out_specs=out_spec,
                            check_vma=False)
        out = run(x2, idx, weights, *(experts[k] for k in names))
    else:  # padded rows are routed too: they only ever meet their own (sliced-off) output rows
        run = jax.shard_map(lambda x, *ws: body(x, *route(x), *ws), mesh=mesh,
                            in_specs=(token_spec,) + tuple(specs), out_specs=out_spec, check_vma=False)
        out = run(x2, *(experts[k] for k in names))
    return out[:N] if pad else out


# a shard_map body: (x, idx, weights, *the experts' arrays in `names` order) -> this device's output rows
Body = Callable[..., jax.Array]


def _gathered_outputs(body: Body) -> Body:
    return lambda *args: jax.lax.all_gather(body(*args), AXIS, tiled=True)


TP_SPECS = {"we_gate_up": P(None, None, AXIS), "be_gate_up": P(None, AXIS), "we_down": P(None, AXIS, None),
            "be_down": P()}


def tp_columns(array: ArrayT, devices: int) -> ArrayT:
    """[..., 2I] laid out [gate | up] -> [gate_0 | up_0 | gate_1 | up_1 | ...]: device p's contiguous
    1/devices slice is then its own [gate_p | up_p], which the local GLU splits in half."""
    *lead, two_i = array.shape
    i_local = two_i // 2 // devices
    return array.reshape(*lead, 2, devices, i_local).swapaxes(-3, -2).reshape(*lead, two_i)


def _tp_body(local_ffn: ExpertFFN, names: Sequence[str], split_tokens: bool) -> Body:
    def body(x: jax.Array, idx: jax.Array, weights: jax.Array, *ws: jax.Array) -> jax.Array:
        experts = dict(zip(names, ws, strict=True))
        if "be_down" in experts:  # added once, not once per width slice
            experts["be_down"] = jnp.where(jax.lax.axis_index(AXIS) == 0, experts["be_down"], 0)
        if not split_tokens:
            return jax.lax.psum(local_ffn(x, idx, weights, experts).astype(_f32), AXIS).astype(x.dtype)
        x_all, idx_all, w_all = (jax.lax.all_gather(a, AXIS, tiled=True) for a in (x, idx, weights))
        partial = local_ffn(x_all, idx_all, w_all, experts).astype(_f32)
        return jax.lax.psum_scatter(partial, AXIS, scatter_dimension=0, tiled=True).astype(x.dtype)
    return body


def owned_choices(idx: jax.Array, per_device: int) -> tuple[jax.Array, jax.Array]:
    """Which choices fall on this device's experts, and their local expert ids (inside a shard_map over AXIS)."""
    me = jax.lax.axis_index(AXIS)
    return idx // per_device == me, idx % per_device


def _gather_body(local_ffn: ExpertFFN, names: Sequence[str], n_dev: int) -> Body:
    def body(x: jax.Array, idx: jax.Array, weights: jax.Array, *ws: jax.Array) -> jax.Array:
        experts = dict(zip(names, ws, strict=True))
        per_device = ws[0].shape[0]
        x_all, idx_all, w_all = (jax.lax.all_gather(a, AXIS, tiled=True) for a in (x, idx, weights))
        mine, local = owned_choices(idx_all, per_device)
        partial = local_ffn(x_all, jnp.where(mine, local, 0), jnp.where(mine, w_all, 0.0), experts)
        return jax.lax.psum_scatter(partial.astype(_f32), AXIS, scatter_dimension=0, tiled=True).astype(x.dtype)
    return body


def _all_to_all_body(local_ffn: ExpertFFN, names: Sequence[str], n_dev: int) -> Body:
    def body(x: jax.Array, idx: jax.Array, weights: jax.Array, *ws: jax.Array) -> jax.Array:
        experts = dict(zip(names, ws, strict=True))
        per_device = ws[0].shape[0]
        n, k = idx.shape
        rows = n * k
        dest = (idx // per_device).reshape(rows)
        order = jnp.argsort(dest, stable=True)  # rows grouped by destination device
        sorted_dest = dest[order]
        starts = jnp.searchsorted(sorted_dest, jnp.arange(n_dev), side="left")
        slot = jnp.arange(rows) - starts[sorted_dest]  # position inside its destination's block
        token = order // k
        send_x = jnp.zeros((n_dev, rows, x.shape[1]), x.dtype).at[sorted_dest, slot].set(x[token])
        send_e = jnp.zeros((n_dev, rows), jnp.int32).at[sorted_dest, slot].set(
            (idx.reshape(rows) % per_device)[order])
        send_ok = jnp.zeros((n_dev, rows), _f32).at[sorted_dest, slot].set(1.0)
        recv_x, recv_e, recv_ok = (jax.lax.all_to_all(a, AXIS, 0, 0) for a in (send_x, send_e, send_ok))
        out = local_ffn(recv_x.reshape(n_dev * rows, -1), recv_e.reshape(-1, 1), recv_ok.reshape(-1, 1), experts)
        back = jax.lax.all_to_all(out.reshape(n_dev, rows, -1), AXIS, 0, 0)  # back[d, s]: my row sent to d at s
        y = back[sorted_dest, slot]  # [rows, D] in sorted order
        y = jnp.zeros_like(y).at[order].set(y).reshape(n, k, -1)  # (token, choice) order
        return jnp.einsum("nkd,nk->nd", y.astype(_f32), weights.astype(_f32)).astype(x.dtype)
    return body


class ShardedExperts:
    """A MoE block's experts runner under a parallel layout (MoEBlock's experts_runner): routes and runs the
    experts as one program over the mesh (sharded_routed), routing inside it so top-k stays on each device's own
    tokens. One object serves every block: the graphdefs of equal layers stay equal."""

    def __init__(self, layout: Layout, mesh: Mesh) -> None:
        self.layout, self.mesh = layout, mesh

    def __call__(self, block: MoEBlock, x2: jax.Array, backend: str) -> jax.Array:
        return sharded_routed(self.layout, self.mesh, block._local_ffn(backend), x2, None, None,
                              block.expert_weights(), route=block.route_tokens)
