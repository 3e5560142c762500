"""DEP (FinDEP §2-4): disaggregated expert parallelism. An attention group of A devices runs attention, norms,
routers and shared experts (data parallel: each device its own sequences); an expert group of B devices holds the
routed experts split by expert index and runs them as EP inside the group (moejax.sharding.experts). Each MoE
layer sends its normalized hidden states with their routing A -> E and the routed outputs E -> A.

The two groups run different programs, so DEP is driven from Python like the offloaded steps
(moejax.offload.layered_steps): each group's work is a jit on its own mesh, the transfers are `device_put`s between the
meshes, and JAX's asynchronous dispatch lets both groups and the copies run at once. The batch is split into r1
micro-batches (rows) and each expert step into r2 token chunks; the order of the attention group's work in a layer
is ASAS (attention i, shared expert i, attention i+1, ...) or AASS (every attention, then every shared expert),
the dispatch order each device then executes in; PPPipe (FinDEP's baseline, MegaScale-Infer's ping-pong pipeline)
runs the shared expert with attention, before the micro-batch is sent, and sends it whole (r2 = 1).

Several processes (jax.distributed, moejax.sharding.multihost): every process runs this same driver; a process
without devices in a group dispatches that group's jits too and gets arrays without local data, and the transfers
are cross-process `device_put`s (JAX copies between the processes' devices: natively where the backend can, e.g.
NVLink or the network on GPUs, otherwise through the socket transfers that `multihost.initialize(transfer_address=)`
starts, as on CPU). Such a copy keeps every shard's shape and does not mix local and remote shards, so each group
is whole processes and both have as many devices (`check_group_processes`); in one process the groups may differ."""
from __future__ import annotations

import dataclasses
import functools
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from moejax.config import ModelConfig
from moejax.kernels.backends import Kernels
from moejax.layout import Layout
from moejax.models.attention import Cache, Positions
from moejax.models.kv_pool import PagedCache
from moejax.models.moe import local_expert_ffn
from moejax.offload import layered_steps
from moejax.plan.findep_costs import A2E_DEFAULT, A2E_ROUTES
from moejax.plan.findep_online import OnlineDep
from moejax.sharding import multihost
from moejax.sharding.experts import AXIS, owned_choices, sharded_routed
from moejax.sharding.mesh import make_mesh
from moejax.steps.rows import DecodeRows


class ExpertGroup:
    """The routed experts of a DEP model: per MoE layer, arrays split by expert index over the expert group. The
    model's parameters keep 0-d stand-ins on the attention group (its jits never see the expert group's arrays)."""
    per_expert = False

    def __init__(self, attn_mesh: Mesh, expert_mesh: Mesh) -> None:
        self.attn_mesh, self.expert_mesh = attn_mesh, expert_mesh
        self._layers: dict[int, dict] = defaultdict(dict)

    def add(self, path: tuple, array: jax.Array | np.ndarray) -> jax.Array:
        """('layers', i, 'mlp', name) -> placed on the expert group; returns the stand-in for the parameters."""
        placed = multihost.place(array, NamedSharding(self.expert_mesh, P(AXIS)))  # none outside the group
        self._layers[int(path[1])][path[3]] = placed
        return jax.device_put(jnp.zeros((), array.dtype), NamedSharding(self.attn_mesh, P()))

    def fetch(self, layer: int) -> dict:
        return dict(self._layers[layer])

    @property
    def layers(self) -> list[int]:
        return sorted(self._layers)


@dataclasses.dataclass
class TransferStats:
    """Bytes between the groups, per MoE layer (all devices together; padding rows included)."""
    a2e_bytes: dict = dataclasses.field(default_factory=lambda: defaultdict(int))
    e2a_bytes: dict = dataclasses.field(default_factory=lambda: defaultdict(int))
    chunks: dict = dataclasses.field(default_factory=lambda: defaultdict(int))

    def as_dict(self, extra: dict | None = None) -> dict:
        layers = {layer: dict(a2e_bytes=self.a2e_bytes[layer], e2a_bytes=self.e2a_bytes[layer],
                              chunks=self.chunks[layer]) for layer in sorted(self.chunks)}
        total = {name: sum(v[name] for v in layers.values()) for name in ("a2e_bytes", "e2a_bytes", "chunks")}
        return {"total": total | (extra or {}), "layers": layers}


class Disaggregated(layered_steps.LayerRuntime):
    """The expert group's side of DEP: its experts program, the transfers to and from it, and their counters.

    `a2e` says how a chunk reaches the experts' owners (A2E_DEFAULT, regroup, measured faster on 8 simulated CPU
    devices by `python -m launch.bench dep-a2e`; FinDEP's time model follows the route, moejax.plan.findep_costs):
    - straight (FinDEP's A2E): each attention device sends its rows, with their routing, straight to every expert
      device; each runs the choices that fall on its own experts (the rest weigh 0) and sends its weighted partial
      outputs straight back, where the attention device adds the B partials of its rows. Shapes are static and
      dropless, so the buffer for one owner must hold all of a sender's rows: the bytes equal a broadcast.
    - regroup: the rows land on the expert group split by rows, an all-to-all (or all-gather, `exchange`) inside
      the group routes them to their owners and back (EP inside the group), and the outputs return split by rows."""
    name = "dep"

    def __init__(self, store: ExpertGroup, layout: Layout, cfg: ModelConfig, backend: str, *,
                 online: OnlineDep | None = None, a2e: str = A2E_DEFAULT) -> None:
        if a2e not in A2E_ROUTES:
            raise ValueError(f"DEP: a2e must be one of {', '.join(A2E_ROUTES)}, got {a2e!r}")
        self.store, self.layout, self.a2e = store, layout, a2e
        self.online = online  # FinDEP's online phase: r1, r2, order per step shape (None: the layout's, always)
        self.has_shared = bool(cfg.shared_expert_size)  # MoEBlock.shared exists
        self.stats: TransferStats = TransferStats()
        self.attn_rows = NamedSharding(store.attn_mesh, P(AXIS))
        self.expert_rows = NamedSharding(store.expert_mesh, P(AXIS))
        self.expert_all = NamedSharding(store.expert_mesh, P())
        self.attn_partials = NamedSharding(store.attn_mesh, P(None, AXIS))  # [B, N, D]: rows split, all B partials
        inner = Layout(attn="dp", experts="ep", devices=layout.expert_devices, exchange=layout.exchange)
        local = local_expert_ffn(cfg, backend)
        # Both ends of a transfer split rows over their group: a copy between processes needs the same split.
        self._experts = jax.jit(functools.partial(sharded_routed, inner, store.expert_mesh, local),
                                out_shardings=self.expert_rows)
        self._owned = jax.jit(functools.partial(owned_experts, store.expert_mesh, local))

    def route(self) -> tuple[NamedSharding, Callable[..., jax.Array], NamedSharding]:
        """The A2E route's (where a chunk is sent on the expert group, the expert program, where its output goes back
        on the attention group): what `run` does, and what the micro-benchmarks (moejax.measure.dep) and the
        layouts benchmark time and compile."""
        if self.a2e == "straight":
            if jax.process_count() > 1:  # a copy between processes keeps every shard's shape; straight reshapes
                raise ValueError("DEP: a2e=straight runs in one process only (its copies change the shards' shapes, "
                                 "which a copy between processes cannot); use a2e=regroup")
            return self.expert_all, self._owned, self.attn_partials
        return self.expert_rows, self._experts, self.attn_rows

    def run(self, layer: int, y2: jax.Array, idx: jax.Array, weights: jax.Array) -> jax.Array:
        """One token chunk: A -> E, the routed experts over the expert group, E -> A (all dispatched, none waited).
        -> the routed output [N, D] (regroup) or its B partial outputs [B, N, D] (straight), split by rows over the
        attention group; `combine` adds the partials (add_partials)."""
        target, program, home = self.route()
        sent = jax.device_put((y2, idx, weights), target)
        back = jax.device_put(program(*sent, self.store.fetch(layer)), home)
        copies = (self.layout.expert_devices or 1) if self.a2e == "straight" else 1  # the chunk to every device
        self.stats.a2e_bytes[layer] += copies * sum(a.nbytes for a in sent)
        self.stats.e2a_bytes[layer] += back.nbytes
        self.stats.chunks[layer] += 1
        return back

    def begin_pass(self, steps: layered_steps.LayeredSteps) -> None:
        pass  # DisaggregatedSteps runs the layers and sends each chunk itself (run)

    def moe(self, handle: layered_steps.Layer, x: jax.Array, y: jax.Array, idx: jax.Array | None,
            weights: jax.Array | None) -> jax.Array:
        raise NotImplementedError("DEP's layers run through DisaggregatedSteps, which calls run() per token chunk")

    def describe(self) -> str:
        lay = self.layout
        assert lay.devices is not None and lay.attn_devices is not None and lay.expert_devices is not None, \
            "resolve the layout first"
        route = ("A->E sends its hidden state and routing straight to every expert device (each runs the choices "
                 "on its experts), E->A each expert device's weighted partial output, added on the attention device"
                 if self.a2e == "straight" else
                 f"A->E sends its hidden state and routing split by rows, EP inside the expert group (exchange "
                 f"{lay.exchange}) routes them to their owners, E->A its routed output")
        return (f"dep: attention group devices 0..{lay.attn_devices - 1}, expert group devices {lay.attn_devices}.."
                f"{lay.devices - 1}; r1={lay.r1} micro-batches, r2={lay.r2} token chunks per expert step, order "
                f"{lay.order}; per token and MoE layer {route} (a2e={self.a2e}; chunks padded to a multiple of "
                f"lcm(A, B) = {math.lcm(lay.attn_devices, lay.expert_devices)} rows)"
                + (f"; {', '.join(lay.online)} as above for the load's planned workload, re-solved for each step "
                   "shape (online FinDEP)" if self.online else ""))


def owned_experts(mesh: Mesh, local_ffn: Callable, x2: jax.Array, idx: jax.Array, weights: jax.Array,
                  experts: dict[str, jax.Array]) -> jax.Array:
    """Straight A2E's expert program: x2 [N, D], idx / weights [N, k] whole on every expert device -> [B, N, D],
    expert device b's weighted output of the choices on its own experts (0 for the others)."""
    names = sorted(experts)

    def body(x: jax.Array, i: jax.Array, w: jax.Array, *ws: jax.Array) -> jax.Array:
        mine, local = owned_choices(i, ws[0].shape[0])
        return local_ffn(x, jnp.where(mine, local, 0), jnp.where(mine, w, 0), dict(zip(names, ws, strict=True)))[None]
    run = jax.shard_map(body, mesh=mesh, in_specs=(P(),) * 3 + (P(AXIS),) * len(names), out_specs=P(AXIS),
                        check_vma=False)
    return run(x2, idx, weights, *(experts[k] for k in names))


def add_partials(out: jax.Array) -> jax.Array:
    """A chunk's routed output as Disaggregated.run returns it -> [N, D]: straight A2E's [B, N, D] partial outputs
    added in float32 (as the one-device FFN adds its k choices), regroup's [N, D] as it is."""
    return out.astype(jnp.float32).sum(0).astype(out.dtype) if out.ndim == 3 else out


# -- the attention group's per-layer jits (graphdef, state, ...) as layered_steps.Layer runs them ----------------------
def attend_chunks(graphdef: nnx.GraphDef, state: nnx.State, x: jax.Array, at: Positions, cache: Cache,
                  prior: dict[str, jax.Array] | None, *, kernels: Kernels, read_cache: bool,
                  chunks: Sequence[tuple[int, int]], split: Callable[[jax.Array], jax.Array]
                  ) -> tuple[jax.Array, jax.Array, Cache, list[tuple[jax.Array, ...]]]:
    """Attention + router, then the MoE input cut into token chunks [(y2, idx, weights)] padded as `chunks` says,
    each split by rows over the group (what a transfer to the expert group starts from)."""
    x, y, cache, idx, weights = layered_steps.attend_route(graphdef, state, x, at, cache, prior, kernels=kernels,
                                                     read_cache=read_cache)
    y2 = y.reshape(-1, y.shape[-1])
    out, start = [], 0
    for real, padded in chunks:
        pad = ((0, padded - real), (0, 0))
        out.append(tuple(split(jnp.pad(a[start:start + real], pad)) for a in (y2, idx, weights)))
        start += real
    return x, y, cache, out


def shared_expert(graphdef: nnx.GraphDef, state: nnx.State, y: jax.Array) -> jax.Array:
    """The shared expert's output [N, D] (what MoEBlock.with_shared adds to the routed output)."""
    y2 = y.reshape(-1, y.shape[-1])
    return nnx.merge(graphdef, state).mlp.with_shared(y2, jnp.zeros_like(y2))


def combine(graphdef: nnx.GraphDef, state: nnx.State, x: jax.Array, shared: jax.Array | None,
            outs: Sequence[jax.Array], *, chunks: Sequence[tuple[int, int]], split: Callable[[jax.Array], jax.Array]
            ) -> jax.Array:
    """The layer's output: residual + routed (chunks unpadded, in order) + shared, split by rows over the group."""
    routed = jnp.concatenate([add_partials(o)[:real] for o, (real, _) in zip(outs, chunks, strict=True)])
    y = routed if shared is None else routed + shared
    return split(x + y.reshape(x.shape))


def _split(tree: Any, *, sizes: tuple[int, ...]) -> tuple[Any, ...]:  # any pytree, split by rows
    bounds = np.cumsum((0,) + sizes)
    return tuple(jax.tree.map(lambda a, s=s, e=e: a[s:e], tree) for s, e in zip(bounds[:-1], bounds[1:], strict=True))


def _concat(trees: Sequence[Any]) -> Any:  # pytrees of one structure, joined by rows
    return jax.tree.map(lambda *parts: jnp.concatenate(parts), *trees)


class MicroBatched(list):
    """Per-micro-batch caches, kept split between the decode steps (so no step copies the whole KV cache)."""


class SharedPool:
    """A paged step's KV pool (moejax.models.kv_pool: one per layer, shared by every row) as its micro-batches use it:
    each reads and writes it through its own rows' block tables and slots, in turn, so that micro-batch m + 1 of a layer
    reads what micro-batch m wrote there (a prompt cut into consecutive rows of one chunk step reads its earlier
    rows' keys; the micro-batches keep the rows' order)."""

    def __init__(self, caches: Sequence[PagedCache]) -> None:
        self.layers = [c.pool for c in caches]
        self.table, self.slots = caches[0].table, caches[0].slots  # the same rows for every layer

    def caches(self) -> list[PagedCache]:
        """The step's caches after every micro-batch wrote: the whole rows' view of each layer's pool."""
        return [PagedCache(pool, self.table, self.slots) for pool in self.layers]


class PoolRows:
    """One micro-batch's view of a SharedPool: `rows[i]` is layer i's cache for its rows (the pool as written so
    far); `wrote(i, cache)` passes what this micro-batch wrote on to the next."""

    def __init__(self, shared: SharedPool, table: jax.Array, slots: jax.Array) -> None:
        self.shared, self.table, self.slots = shared, table, slots

    def __getitem__(self, layer: int) -> PagedCache:
        return PagedCache(self.shared.layers[layer], self.table, self.slots)

    def wrote(self, layer: int, cache: PagedCache) -> None:
        self.shared.layers[layer] = cache.pool


class DisaggregatedSteps(layered_steps.LayeredSteps):
    """The Engine's steps under DEP: begin and end on the attention group, the layers as FinDEP's pipeline."""

    placement: Disaggregated

    def __init__(self, graphdef: nnx.GraphDef, params: nnx.State, kernels: Kernels, placement: Disaggregated) -> None:
        super().__init__(graphdef, params, kernels, placement)
        self._split_jit = jax.jit(_split, static_argnames=("sizes",))
        self._concat_jit = jax.jit(_concat)
        split = functools.partial(jax.lax.with_sharding_constraint, shardings=placement.attn_rows)
        self._combine = functools.partial(combine, split=split)
        self.attend = functools.partial(attend_chunks, split=split)  # the attention jit, its rows split
        # The last pass's dispatch order: ("attn" | "shared" | "combine", layer, micro-batch) and
        # ("experts", layer, micro-batch, chunk), for --explain and tests.
        self.schedule: list[tuple] = []
        self.layout = placement.layout  # the last step's: the load's, or as online FinDEP solved its shape

    def step_layout(self, rows: int, tokens_per_row: int, *, count: bool = True) -> Layout:
        """The layout a step of this shape runs: the load's, or with (r1, r2, order) from online FinDEP (count: as
        a step served from its cache; False for a look ahead)."""
        online = self.placement.online
        return self.placement.layout if online is None else online.layout_for(rows, tokens_per_row, count=count)

    def run_layers(self, x: jax.Array, at: Positions, cache: Sequence[Cache] | None = None, read_cache: bool = True,
                   prior: Sequence[dict[str, jax.Array]] | None = None, valid: jax.Array | None = None
                   ) -> tuple[jax.Array, list[Cache]]:
        self.valid = valid
        self.layout = lay = self.step_layout(x.shape[0], x.shape[1])
        sizes = lay.micro_batches(x.shape[0])
        split_cache = isinstance(cache, MicroBatched)
        paged = [c for c in cache if isinstance(c, PagedCache)] if cache else []  # a paged step's: every layer's
        assert not paged or len(paged) == len(self.layers), "a paged step gives every layer a PagedCache"
        pool = SharedPool(paged) if paged else None
        inputs = dict(x=x, at=at, prior=prior, cache=None if split_cache or pool else cache)
        parts = [dict(p) for p in self._split_jit(inputs, sizes=sizes)]
        if isinstance(cache, MicroBatched):  # split_cache, spelled out for the type checker
            for part, c in zip(parts, cache, strict=True):
                part["cache"] = c
        if pool is not None:  # the pool whole, the rows' tables and slots split
            for part, (table, slots) in zip(parts, self._split_jit((pool.table, pool.slots), sizes=sizes), strict=True):
                part["cache"] = PoolRows(pool, table, slots)
        parts = self._pipeline(parts, read_cache, lay)
        self.passes += 1
        x = self._concat_jit([p["x"] for p in parts])
        if pool is not None:
            return x, list(pool.caches())
        new = [p["cache"] for p in parts]
        return x, (MicroBatched(new) if split_cache else self._concat_jit(new))

    def _pipeline(self, parts: list[dict[str, Any]], read_cache: bool, lay: Layout) -> list[dict[str, Any]]:
        """Every layer for every micro-batch, dispatched in FinDEP's order; parts[i]["cache"] becomes the list of
        the micro-batch's new per-layer caches (or keys).

        Micro-batch m's combine of MoE layer t is dispatched just before its attention of the next layer, not with
        the other combines of layer t: the attention group runs its work in dispatch order, so combining every
        micro-batch first would make layer t+1's first attention wait for layer t's last expert chunk to come
        back. Interleaved, attention of micro-batch m at layer t+1 overlaps the expert group's work on micro-batch
        m+1 at layer t (FinDEP §4 offsets consecutive layers the same way).

        A paged step's micro-batches (PoolRows) pass each layer's pool on in micro-batch order."""
        has_shared = self.placement.has_shared
        old = [p["cache"] for p in parts]
        for p in parts:
            p["cache"] = []
        self.schedule = []
        log = self.schedule.append
        pending: list = [None] * len(parts)  # per micro-batch: its last MoE layer, waiting to be combined

        def keep(m: int, i: int, c: Cache) -> None:
            parts[m]["cache"].append(c)
            if isinstance(old[m], PoolRows):
                old[m].wrote(i, c)

        def combine(m: int) -> None:
            if pending[m] is not None:
                w = pending[m]
                parts[m]["x"] = w["layer"](self._combine, w["x"], w["shared"], w["outs"], chunks=w["chunks"])
                log(("combine", w["index"], m))
                pending[m] = None

        for i, layer in enumerate(self.layers):
            for m, (p, c) in enumerate(zip(parts, old, strict=True)):
                combine(m)
                a = (p["x"], p["at"], None if c is None else c[i], None if p["prior"] is None else p["prior"][i])
                if i not in self.moe_layers:
                    p["x"], c = layer(layered_steps.whole_layer, *a, kernels=self.kernels, read_cache=read_cache)
                    keep(m, i, c)
                    continue
                chunks = lay.token_chunks(a[0].shape[0] * a[0].shape[1])
                x, y, c, sends = layer(self.attend, *a, kernels=self.kernels, read_cache=read_cache, chunks=chunks)
                log(("attn", i, m))
                keep(m, i, c)
                shared = None
                if lay.order == "pppipe" and has_shared:  # PPPipe: the shared expert is part of attention
                    shared = layer(shared_expert, y)
                    log(("shared", i, m))
                outs = []
                for j, send in enumerate(sends):
                    outs.append(self.placement.run(i, *send))
                    log(("experts", i, m, j))
                if lay.order == "asas" and has_shared:
                    shared = layer(shared_expert, y)
                    log(("shared", i, m))
                pending[m] = dict(layer=layer, index=i, x=x, y=y, outs=outs, chunks=chunks, shared=shared)
            if i in self.moe_layers and lay.order == "aass" and has_shared:
                for m, w in enumerate(pending):
                    w["shared"] = layer(shared_expert, w["y"])
                    log(("shared", i, m))
        for m in range(len(parts)):
            combine(m)
        return parts

    def host_value(self, x: jax.Array) -> np.ndarray:
        """A value the decode loop reads: on the attention group, which may leave out this process."""
        return multihost.to_host(x) if jax.process_count() > 1 else np.asarray(x)

    def decode(self, state: nnx.State, cache: Sequence[Cache], rows: DecodeRows, **static: Any
               ) -> tuple[jax.Array, jax.Array]:
        # run_layers' split, looked up ahead (its steps count themselves)
        sizes = self.step_layout(rows.first.shape[0], 1, count=False).micro_batches(rows.first.shape[0])
        parts = MicroBatched(self._split_jit(cache, sizes=sizes))
        return super().decode(state, parts, rows, **static)


def check_group_processes(layout: Layout) -> None:
    """DEP over several processes: each process's devices in one group at most, groups of equal size, and a way to
    copy between processes (ValueError naming the numbers and the option to change)."""
    a, b = layout.attn_devices, layout.expert_devices
    assert a is not None and b is not None, "resolve the layout first"
    devices, processes = jax.devices(), jax.process_count()
    local = sorted({sum(d.process_index == p for d in devices) for p in range(processes)})
    where = (f"{processes} processes of {local[0]} devices each" if len(local) == 1
             else f"{processes} processes of {'/'.join(map(str, local))} devices")
    fix = (f" (e.g. attn_devices={processes // 2 * local[0]},expert_devices={processes // 2 * local[0]})"
           if len(local) == 1 and processes % 2 == 0 else "")
    owners = [sorted({d.process_index for d in group}) for group in (devices[:a], devices[a:a + b])]
    shared = sorted(set(owners[0]) & set(owners[1]))
    if shared:
        raise ValueError(
            f"experts=dep over {where} runs each group on whole processes, but the attention group "
            f"(attn_devices={a}: devices 0..{a - 1}, processes {owners[0]}) and the expert group (expert_devices={b}: "
            f"devices {a}..{a + b - 1}, processes {owners[1]}) share process(es) {shared}: make attn_devices and "
            f"expert_devices multiples of the devices per process{fix}")
    if a != b:
        raise ValueError(
            f"experts=dep over {where} needs attn_devices = expert_devices, got {a} and {b}: a copy between "
            f"processes keeps every shard's shape, so both groups split a token chunk over as many devices{fix}")
    if not multihost.transfers_between_processes():
        raise ValueError(
            f"experts=dep over {where} copies activations between the processes with jax.device_put, which the "
            f"{devices[0].platform} backend does only through JAX's socket transfers: pass transfer_address="
            "'HOST:PORT' (this process's address and a free port) to moejax.sharding.multihost.initialize")


def group_meshes(layout: Layout) -> tuple[Mesh, Mesh]:
    """-> (attention group mesh, expert group mesh) of a resolved DEP layout."""
    assert layout.attn_devices is not None and layout.expert_devices is not None, "resolve the layout first"
    return make_mesh(layout.attn_devices), make_mesh(layout.expert_devices, first=layout.attn_devices)
