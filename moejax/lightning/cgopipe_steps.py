"""CGOPipe's executor (MoE-Lightning §4.1, Alg. 1): the Engine's steps layer by layer, each layer's attention split
between the accelerator (projections, FFN) and the host (the KV cache and attention over it), over micro-batches
whose tasks are launched in moejax.lightning.schedule's order. Every task is dispatched asynchronously: the device's
work, the host's (JAX's CPU backend, its own thread pool) and the copies each way run side by side as their data
dependencies allow, which is what the order is for.

Where a layer's KV lives decides how its attention runs: a cache on the host device runs the split (PREATTN on the
device, OFFLOADQKV, CPUATTN on the host, LOADH); a cache on the device (the r_c share of the layers, or every layer
under A_g = 1 with r_c = 1) runs attention on the device inside PREATTN; under A_g = 1 with r_c < 1 the layers
past the share keep theirs on the host and attend on the device over a copy swapped in each pass
(moejax.lightning.kv_swap). A chunk that starts every row's sequence (prefill) attends over its own keys on the device
and only stores them on the host (§4 fn. 7: the prefill runs on the GPU and offloads its KV). Caches are the
continuous-batching pool (PagedCache, per layer {name: [N, BLOCK, ...]}, on the host or the device) or, for
Engine.generate, per-row caches with slot = position (one micro-batch).

Steps without a cache (logits, scoring) run LayeredSteps' own loop with the paged experts (PagedExperts.moe). Under
F_g = 0 the experts past the resident share stay on the host and run there (moejax.lightning.host_ffn.HostFFN)."""
from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.kernels.backends import Kernels
from moejax.lightning import kv_swap, layer_parts
from moejax.lightning.balance import balance
from moejax.lightning.host_ffn import HostFFN
from moejax.lightning.host_kv import host_device
from moejax.lightning.pages import PagedExperts
from moejax.lightning.schedule import ATTN, LOAD, OFFLOAD, ORDERS, PAGE, POST, PRE, Task
from moejax.lightning.trace import Timeline, busy
from moejax.models import kv_pool
from moejax.models.attention import AttentionCore, Cache, Positions
from moejax.models.kv_pool import PagedCache
from moejax.offload.layered_steps import LayeredSteps, _phase
from moejax.steps import paged_phases
from moejax.steps.rows import ChunkRows, PagedDecodeRows, PrefillRows

KVLayer = dict[str, jax.Array]


@dataclasses.dataclass
class PipelineStats:
    """Counters since load or reset: passes (one per decode step or chunk) and the wall time of dispatching them,
    tasks run, bytes each way across the link (pages are counted per layer in PagedExperts.stats), the time the host
    thread waited for a decode step's result (its early-exit check), and, while traced (LightningSteps.trace), the
    time each resource was busy."""
    passes: int = 0
    micro_batches: int = 0
    pass_s: float = 0.0
    tasks: dict = dataclasses.field(default_factory=dict)
    bytes_d2h: int = 0  # OFFLOADQKV: queries and new KV to the host
    bytes_h2d: int = 0  # LOADH: attention outputs back
    bytes_kv_swap: int = 0  # A_g = 1, r_c < 1: host KV copied to the device for attention there (kv_swap)
    wait_s: float = 0.0
    traced_passes: int = 0
    busy_s: dict = dataclasses.field(default_factory=dict)  # resource -> seconds, over the traced passes

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        if self.traced_passes:
            out["busy_s_per_step"] = {r: b / self.traced_passes for r, b in self.busy_s.items()}
        return out


@dataclasses.dataclass
class LightningSettings:
    """What the executor needs of a policy: μ (rows per micro-batch), the layers whose KV stays on the device
    (the first `device_kv_layers`: the r_c share), whether the other layers attend on the device over their KV
    swapped in (A_g = 1) or on the host, the host's attention kernel, whether to record the tasks, and the launch
    order (moejax.lightning.schedule.ORDERS: CGOPipe's, or FlexGen's for the §6.1 ablation)."""
    micro_batch: int
    device_kv_layers: int = 0
    host_backend: str = "cpu"
    record: bool = False
    swap_kv: bool = False
    schedule: str = "cgopipe"


class LightningSteps(LayeredSteps):
    def __init__(self, graphdef: nnx.GraphDef, params: nnx.State, kernels: Kernels,
                 experts: PagedExperts | HostFFN, settings: LightningSettings, host: jax.Device | None = None
                 ) -> None:
        super().__init__(graphdef, params, kernels, experts)
        if settings.micro_batch < 1:
            raise ValueError(f"lightning: the micro-batch size must be >= 1, got {settings.micro_batch}")
        if settings.schedule not in ORDERS:
            raise ValueError(f"lightning: schedule must be one of {', '.join(ORDERS)}, got {settings.schedule!r}")
        self.experts, self.settings = experts, settings
        self.host = host or host_device()
        self.device = next(iter(jax.tree.leaves(params)[0].devices()))
        self.stats = PipelineStats()
        self.log: list[Task] = []  # the tasks run, in order, while settings.record
        self.timeline: Timeline | None = None  # set (moejax.lightning.trace) to time every task
        model = nnx.merge(graphdef, params)
        self._model = model  # for its caches' shapes
        self.cores: list[AttentionCore] = [jax.device_put(layer.attn.core, self.host) for layer in model.layers]
        self._attention_backend = kernels.attention
        phase = lambda fn, **kw: jax.jit(functools.partial(_phase, fn, graphdef), **kw)  # noqa: E731
        self._token_inputs = phase(paged_phases.token_inputs, static_argnames=("num_blocks",))
        self._next_loop = phase(paged_phases.next_loop)
        self._chunk_inputs = phase(paged_phases.chunk_inputs, static_argnames=("num_blocks",))
        self._chunk_tokens = phase(paged_phases.chunk_tokens)
        self._embed = phase(lambda model, tokens, positions: model.embed_inputs(tokens, positions))
        self._first = phase(_first_tokens)

    def trace(self, on: bool = True) -> None:
        """Time every task from now on (moejax.lightning.trace; a polling thread, which costs host CPU) and add each
        resource's busy time to the stats; off: stop, counting what ran."""
        if on and self.timeline is None:
            self.timeline, self._traced_from = Timeline().start(), self.stats.passes
        elif not on and self.timeline is not None:
            timeline, self.timeline = self.timeline, None
            for resource, seconds in busy(timeline.stop()).items():
                self.stats.busy_s[resource] = self.stats.busy_s.get(resource, 0.0) + seconds
            self.stats.traced_passes += self.stats.passes - self._traced_from

    # -- where the KV lives -----------------------------------------------------------------------------------------
    def kv_device(self, layer: int) -> jax.Device:
        return self.device if layer < self.settings.device_kv_layers else self.host

    def decode_pool(self, params: nnx.State, num_blocks: int, /) -> list[KVLayer]:
        """The continuous-batching pool, zeroed: each layer's on the host, the first device_kv_layers' on the
        device."""
        return self._zeroed(num_blocks, kv_pool.BLOCK)

    def _zeroed(self, batch: int, length: int) -> list[KVLayer]:
        """Per layer, init_cache(batch, length) zeroed where the layer keeps its KV (kv_device)."""
        shapes = jax.eval_shape(lambda: self._model.init_cache(batch, length))
        return [{n: jnp.zeros(a.shape, a.dtype, device=self.kv_device(i)) for n, a in layer.items()}
                for i, layer in enumerate(shapes)]

    # -- the Engine's steps ---------------------------------------------------------------------------------------
    def run_layers(self, x: jax.Array, at: Positions, cache: Sequence[Cache] | None = None, read_cache: bool = True,
                   prior: Sequence[kv_pool.Layer] | None = None, valid: jax.Array | None = None
                   ) -> tuple[jax.Array, list[Cache]]:
        """Static decode (Engine.generate) through the pipeline; steps without a cache (logits, scoring) through
        LayeredSteps' loop with the paged experts."""
        if cache is None or prior is not None or at.tree is not None:
            return super().run_layers(x, at, cache, read_cache, prior, valid)
        return self._pipeline(x, at, list(cache), read_cache, None)

    def prefill(self, state: nnx.State, pool: list[kv_pool.Layer] | None, rows: PrefillRows, *, cache_len: int
                ) -> tuple[list[KVLayer], jax.Array, list[kv_pool.Layer] | None]:
        """Engine.generate's prefill (one micro-batch): the KV goes straight into per-row caches on the host."""
        if rows.prior_ids is not None or rows.store_ids is not None:
            raise ValueError("lightning: a prefix pool in a static prefill is not supported; the batch runner runs "
                             "lightning under continuous batching, where shared prompt blocks are reused")
        x, at = self._embed(state, rows.tokens, rows.positions)
        x, out = self._pipeline(x, at, list(self._zeroed(rows.tokens.shape[0], cache_len)), False, None)
        first = self._first(state, x, rows)
        caches = cast("list[KVLayer]", out)  # per-row caches in, per-row caches out
        if rows.expand is not None:
            caches = [{n: a[jax.device_put(rows.expand, next(iter(a.devices())))] for n, a in c.items()}
                      for c in caches]
        return caches, first, pool

    def chunk(self, state: nnx.State, pool: list[kv_pool.Layer], carry: jax.Array, rows: ChunkRows, *, fresh: bool
              ) -> tuple[list[kv_pool.Layer], jax.Array, jax.Array]:
        x, at, slots = self._chunk_inputs(state, rows, num_blocks=_pool_blocks(pool))
        lengths = np.asarray(rows.start) + np.asarray(rows.n)
        # Rows of one sequence must store their keys in order before the later ones attend: a chunk that reads the
        # cache runs as one micro-batch (a fresh one holds one row per sequence; MoE-Lightning pipelines decode only)
        x, pool = self._paged_pass(x, at, pool, rows.table, slots, not fresh, lengths, split=fresh)
        carry, tok = self._chunk_tokens(state, x, carry, rows)
        return pool, carry, tok

    def paged_decode(self, state: nnx.State, pool: list[kv_pool.Layer], carry: jax.Array, rows: PagedDecodeRows, *,
                     steps: int) -> tuple[list[kv_pool.Layer], jax.Array, jax.Array]:
        loop = self._paged_start(carry, rows, steps)
        start = np.asarray(rows.start)
        for i in range(steps):  # the resident loop's condition, checked on the host
            t0 = time.perf_counter()
            live = bool(np.any(np.asarray(loop.live)))
            self.stats.wait_s += time.perf_counter() - t0
            if not live:
                break
            x, at, slots = self._token_inputs(state, loop, rows, num_blocks=_pool_blocks(pool))
            x, pool = self._paged_pass(x, at, pool, rows.table, slots, True, start + i + 1)
            loop = self._next_loop(state, x, loop, rows)
        return pool, self._paged_finish(carry, rows.slot, loop.out), loop.out

    def _paged_pass(self, x: jax.Array, at: Positions, pool: list[kv_pool.Layer], table: Any, slots: jax.Array,
                    read_cache: bool, lengths: np.ndarray, split: bool = True) -> tuple[jax.Array, list[kv_pool.Layer]]:
        """One pass over the layers with the pool, its rows in micro-batches of balanced context (Alg. 2's greedy;
        split False: one) -> (hidden states, pool)."""
        B = x.shape[0]
        count = -(-B // self.settings.micro_batch) if split else 1
        groups = balance([(int(n), 0) for n in lengths], count, -(-B // count), None).micro_batches
        caches: list[Cache] = [PagedCache(layer, table, slots) for layer in pool]
        x, caches = self._pipeline(x, at, caches, read_cache, [np.sort(g) for g in groups])
        return x, [c.pool for c in cast("list[PagedCache]", caches)]  # paged caches in, paged caches out

    # -- the pipeline -------------------------------------------------------------------------------------------------
    def _pipeline(self, x: jax.Array, at: Positions, caches: list[Cache], read_cache: bool,
                  groups: list[np.ndarray] | None) -> tuple[jax.Array, list[Cache]]:
        t0 = time.perf_counter()
        paged = isinstance(caches[0], PagedCache)
        if not paged or not groups or len(groups) == 1:
            groups = [np.arange(x.shape[0])]  # per-row caches run as one micro-batch
        run, s = _Pass(self, x, at, caches, read_cache, groups), self.stats
        self.experts.begin_pass(self)
        for task in ORDERS[self.settings.schedule](len(self.layers), len(groups)):
            out = run.do(task)
            if out is None:
                continue
            if self.settings.record:
                self.log.append(task)
            if self.timeline is not None:
                self.timeline.record(task, out)
            s.tasks[task.op] = s.tasks.get(task.op, 0) + 1
        s.passes += 1
        s.micro_batches += len(groups)
        s.pass_s += time.perf_counter() - t0
        self.passes += 1
        return run.output(), run.caches()


class _Pass:
    """One pass's state: per micro-batch its rows' hidden states, Positions and cache views; per (layer, micro-
    batch) the query, new KV and attention output in flight; per layer its pool (threaded through the host's
    tasks, which donate it) or its per-row cache."""

    def __init__(self, steps: LightningSteps, x: jax.Array, at: Positions, caches: list[Cache], read_cache: bool,
                 groups: list[np.ndarray]) -> None:
        self.steps, self.read, self.groups = steps, read_cache, groups
        self.single = len(groups) == 1
        device, host = steps.device, steps.host
        rows = [jax.device_put(g.astype(np.int32), device) for g in groups]
        self.x = [x] if self.single else [x[r] for r in rows]
        self.at = [at] if self.single else [jax.tree.map(lambda a, r=r: a[r], at) for r in rows]
        self.host_positions = [jax.device_put(a.positions, host) for a in self.at]
        first = caches[0]
        self.paged = isinstance(first, PagedCache)
        self.kv: list[Any] = [c.pool if isinstance(c, PagedCache) else c for c in caches]
        if self.paged:
            assert isinstance(first, PagedCache)
            tables = [first.table] if self.single else [first.table[r] for r in rows]
            slots = [first.slots] if self.single else [first.slots[r] for r in rows]
            self.table = {d: [jax.device_put(t, d) for t in tables] for d in {device, host}}
            self.slots = {d: [jax.device_put(s, d) for s in slots] for d in {device, host}}
            self._table, self._slots = first.table, first.slots
        self.q: dict[tuple[int, int], Any] = {}
        self.new: dict[tuple[int, int], Any] = {}
        self.o: dict[tuple[int, int], Any] = {}
        self.swapped: dict[int, Any] = {}  # layer -> its KV copied to the device this pass (settings.swap_kv)
        # split attention (host tasks) for every layer past the r_c share, also when the host is the device
        self.on_host = [i >= steps.settings.device_kv_layers for i in range(len(steps.layers))]

    def view(self, layer: int, j: int, where: jax.Device, kv: Any = None) -> Cache:
        kv = self.kv[layer] if kv is None else kv
        if not self.paged:
            return cast("Cache", kv)
        return PagedCache(kv, self.table[where][j], self.slots[where][j])

    def swaps(self, i: int) -> bool:
        """Whether layer i attends on the device over its host KV swapped in (read passes under A_g = 1)."""
        return self.read and self.steps.settings.swap_kv and 0 <= i < len(self.on_host) and self.on_host[i]

    def swap_in(self, i: int) -> Any:
        """Start copying layer i's host KV to the device unless it is on its way -> the copy, or None."""
        if not self.swaps(i) or i in self.swapped:
            return None
        st = self.steps
        self.swapped[i] = kv_swap.swap_in(self.kv[i], st.device)
        st.stats.bytes_kv_swap += _nbytes(self.kv[i])
        return self.swapped[i]

    def do(self, task: Task) -> Any:
        """Run one task -> what it made (its arrays, for the timeline), or None when it had nothing to do (a layer
        without host attention skips the transfers; a page already on its way)."""
        st, (op, i, j) = self.steps, task
        if op == PAGE:  # page j; a pass with fewer micro-batches than pages moves the rest with its last
            last = j == len(self.groups) - 1
            moved = [st.experts.fetch_page(st.experts.next_layer(i - 1), p)
                     for p in range(j, st.experts.store.pages if last else j + 1)]
            if j == 0:  # the next layer's KV swap-in, a layer ahead of its attention as its pages are
                moved.append(self.swap_in(i))
            return [m for m in moved if m is not None] or None
        layer, host = st.layers[i], self.on_host[i]
        backend = st._attention_backend
        if op == PRE:
            if self.swaps(i):
                self.swap_in(i)  # already on its way unless it is the pass's first layer
                self.o[i, j], copy, self.new[i, j] = layer(kv_swap.swapped_attention, self.x[j], self.at[j],
                                                           self.view(i, j, st.device, self.swapped[i]),
                                                           backend=backend)
                self.swapped[i] = kv_swap.pool_of(copy)
                if j == len(self.groups) - 1:
                    del self.swapped[i]  # the layer's last micro-batch has it: the copy goes when it is done
                return self.o[i, j], self.new[i, j]
            if not host:
                self.o[i, j], cache = layer(layer_parts.local_attention, self.x[j], self.at[j],
                                            self.view(i, j, st.device), backend=backend)
                self.kv[i] = cache.pool if isinstance(cache, PagedCache) else cache
                return self.o[i, j], self.kv[i]
            if self.read:
                self.q[i, j], self.new[i, j] = layer(layer_parts.pre_attention, self.x[j], self.at[j])
                return self.q[i, j], self.new[i, j]
            self.o[i, j], self.new[i, j] = layer(layer_parts.own_attention, self.x[j], self.at[j], backend=backend)
            return self.o[i, j], self.new[i, j]
        if op == OFFLOAD:
            if not host:
                return None
            q = self.q.pop((i, j), None)  # None: attention ran on the device (a fresh chunk's own, or swapped)
            self.q[i, j], self.new[i, j] = moved = jax.device_put((q, self.new[i, j]), st.host)
            st.stats.bytes_d2h += _nbytes(moved)
            return moved
        if op == ATTN:
            if not host:
                return None
            paged = (self.table[st.host][j], self.slots[st.host][j]) if self.paged else None
            o, self.kv[i] = layer_parts.host_attend(self.kv[i], self.q.pop((i, j), None), self.new.pop((i, j)),
                                                    self.host_positions[j], paged, st.cores[i],
                                                    backend=st.settings.host_backend,
                                                    store_only=not self.read or self.swaps(i))
            if o is not None:
                self.o[i, j] = o
            return o, self.kv[i]
        if op == LOAD:
            if not host or not self.read or self.swaps(i):
                return None
            self.o[i, j] = jax.device_put(self.o[i, j], st.device)
            st.stats.bytes_h2d += self.o[i, j].nbytes
            return self.o[i, j]
        assert op == POST
        o = self.o.pop((i, j))
        if i in st.moe_layers:
            x, y, idx, weights = layer(layer_parts.post_route, self.x[j], o)
            self.x[j] = st.experts.run_moe(layer, x, y, idx, weights)
            if j == len(self.groups) - 1:
                st.experts.release(i)
        else:
            self.x[j] = layer(layer_parts.post_dense, self.x[j], o)
        return self.x[j]

    def output(self) -> jax.Array:
        if self.single:
            return self.x[0]
        order = np.concatenate(self.groups)
        inverse = jax.device_put(np.argsort(order).astype(np.int32), self.steps.device)
        return jnp.concatenate(self.x)[inverse]

    def caches(self) -> list[Cache]:
        if not self.paged:
            return list(self.kv)
        return [PagedCache(kv, self._table, self._slots) for kv in self.kv]


def _first_tokens(model: Any, x: jax.Array, rows: PrefillRows) -> jax.Array:
    logits = model.head(x, rows.last)
    if rows.expand is not None:
        logits = logits[rows.expand]
    return rows.sampling.next_tokens(logits)


def _pool_blocks(pool: list[kv_pool.Layer]) -> int:
    return jax.tree.leaves(pool)[0].shape[0]


def _nbytes(tree: Any) -> int:
    return sum(a.nbytes for a in jax.tree.leaves(tree))

