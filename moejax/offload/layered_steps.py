"""The Engine's steps run layer by layer from Python, so a placement can move routed expert weights between
layers: begin and end of each step (moejax.steps.phases) are jits as in the resident model, each decoder layer is two
jits (attention + router, then experts + shared expert + residual) that all MoE layers of one shape share, and
between them the placement's layer runtime (LayerRuntime) supplies the experts.

The parameters given to these steps hold 0-d stand-ins for the routed expert arrays: those live in a HostStore."""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.kernels.backends import Kernels
from moejax.models import kv_pool
from moejax.models.attention import Cache, Positions
from moejax.models.moe import MoEBlock
from moejax.steps import paged_phases, phases
from moejax.steps.protocol import Pool, Steps
from moejax.steps.rows import ChunkRows, DecodeRows, PagedDecodeRows, PrefillRows

T = TypeVar("T")


class RuntimeStats(Protocol):
    """A layer runtime's counters (moejax.offload.stats.OffloadStats, DEP's TransferStats)."""

    def as_dict(self, extra: dict | None = None) -> dict: ...


class LayerRuntime(Protocol):
    """What supplies each MoE layer's routed experts to LayeredSteps: a placement's layer runtime (streamed's, the
    cached ones, AsyncEP's gathered stream, lightning's pages, DEP's transfers) or a wrapper that times or records
    one. Runtimes subclass it and take the defaults of needs_router, cache_stats and reset_stats."""

    name: str  # the placement it runs, as Engine.stats() reports it
    stats: RuntimeStats  # counters since load or the last reset_stats

    def begin_pass(self, steps: LayeredSteps) -> None:
        """A forward pass through the layers starts (copies ahead of the first MoE layers may start here)."""
        ...

    def moe(self, handle: Layer, x: jax.Array, y: jax.Array, idx: jax.Array | None, weights: jax.Array | None
            ) -> jax.Array:
        """The MoE layer's output from its attention output x and normed y, routed by (idx, weights) (None: the
        runtime skipped the router, needs_router)."""
        ...

    def describe(self) -> str:
        """A line for Engine.explain()."""
        ...

    def needs_router(self, layer: int) -> bool:
        """Whether layer `layer` runs its router (False: the runtime routes it itself, router-free speculation)."""
        return True

    def cache_stats(self) -> dict | None:
        """The expert cache's own bookkeeping, or None: no cache."""
        return None

    def reset_stats(self) -> None:
        self.stats = type(self.stats)()


class Layer:
    """One decoder layer of the layer-wise steps: its index, weights, and `layer(fn, *arrays, **static)`, which runs
    `fn(graphdef, state, *arrays, **static)` jitted (keywords are static). Layers of one structure share the
    compiled functions, and no call hashes the graphdef (an nnx GraphDef hash took ~0.15 ms here, per call)."""

    def __init__(self, index: int, graphdef: nnx.GraphDef, state: nnx.State,
                 shared: dict[tuple[Callable, nnx.GraphDef], Callable]) -> None:
        self.index, self.graphdef, self.state = index, graphdef, state
        self._shared = shared
        self._mine: dict[Callable, Callable] = {}  # fn -> its jit for this layer's structure

    def __call__(self, fn: Callable[..., T], *args: Any, **static: Any) -> T:
        jitted = self._mine.get(fn)
        if jitted is None:
            key = (fn, self.graphdef)
            if key not in self._shared:
                self._shared[key] = jax.jit(functools.partial(fn, self.graphdef), static_argnames=tuple(static))
            jitted = self._mine[fn] = self._shared[key]
        return jitted(self.state, *args, **static)

    def ran(self, fn: Callable) -> bool:
        """Whether this layer has run `fn` (e.g. attend_route: its router)."""
        return fn in self._mine


def whole_layer(graphdef: nnx.GraphDef, state: nnx.State, x: jax.Array, at: Positions, cache: Cache,
                prior: kv_pool.Layer | None, *, kernels: Kernels, read_cache: bool) -> tuple[jax.Array, Cache]:
    """The decoder layer on x at Positions `at`, with its cache and prior keys (None: none)."""
    return nnx.merge(graphdef, state)(x, at, cache, prior, read_cache=read_cache, kernels=kernels)


def attend(graphdef: nnx.GraphDef, state: nnx.State, x: jax.Array, at: Positions, cache: Cache,
           prior: kv_pool.Layer | None, *, kernels: Kernels, read_cache: bool
           ) -> tuple[jax.Array, jax.Array, Cache]:
    """-> (residual after attention, normalized MoE input, cache): attend_route without the router, for a layer
    whose placement runs experts it already chose (router-free speculation)."""
    return nnx.merge(graphdef, state).attend(x, at, cache, prior, read_cache=read_cache, kernels=kernels)


def attend_route(graphdef: nnx.GraphDef, state: nnx.State, x: jax.Array, at: Positions, cache: Cache,
                 prior: kv_pool.Layer | None, *, kernels: Kernels, read_cache: bool
                 ) -> tuple[jax.Array, jax.Array, Cache, jax.Array, jax.Array]:
    """-> (residual after attention, normalized MoE input, cache, router's expert ids [N, k], weights [N, k])."""
    layer = nnx.merge(graphdef, state)
    x, y, cache = layer.attend(x, at, cache, prior, read_cache=read_cache, kernels=kernels)
    idx, weights = layer.mlp.route_tokens(y.reshape(-1, y.shape[-1]))
    return x, y, cache, idx, weights


def routed(graphdef: nnx.GraphDef, state: nnx.State, y: jax.Array, idx: jax.Array, weights: jax.Array,
           experts: dict[str, jax.Array], *, backend: str) -> jax.Array:
    """Routed experts' output [N, D] for experts given as arrays [E', ...] (idx numbers them)."""
    return nnx.merge(graphdef, state).mlp.routed(y.reshape(-1, y.shape[-1]), idx, weights, experts, backend)


def finish(graphdef: nnx.GraphDef, state: nnx.State, x: jax.Array, y: jax.Array, routed_out: jax.Array) -> jax.Array:
    """Add the shared expert and the residual: the layer's output."""
    y2 = y.reshape(-1, y.shape[-1])
    return x + nnx.merge(graphdef, state).mlp.with_shared(y2, routed_out).reshape(x.shape)


def run_moe(layer: Layer, x: jax.Array, y: jax.Array, idx: jax.Array, weights: jax.Array,
            experts: dict[str, jax.Array], backend: str) -> jax.Array:
    """The experts half of a MoE layer, given its experts' arrays: routed experts, shared expert, residual."""
    return layer(finish, x, y, layer(routed, y, idx, weights, experts, backend=backend))


def _phase(fn: Callable[..., T], graphdef: nnx.GraphDef, state: nnx.State, *args: Any, **static: Any) -> T:
    return fn(phases.model_of(graphdef, state).unstacked(), *args, **static)


@jax.jit
def _prefill_valid(rows: PrefillRows) -> jax.Array:
    """[B, T]: each request row's prompt tokens (up to its last), no padding row's."""
    valid = jnp.arange(rows.tokens.shape[1])[None, :] <= rows.last[:, None]
    return valid if rows.requests is None else valid & rows.requests[:, None]


@jax.jit
def _chunk_valid(tokens: jax.Array, n: jax.Array) -> jax.Array:
    """[B, T]: each row's first n real tokens (an idle row, n = 0, has none)."""
    return jnp.arange(tokens.shape[1])[None, :] < n[:, None]


@jax.jit
def _rows_valid(live: jax.Array) -> jax.Array:
    """A decode step's [B, 1]: the rows still making tokens (finished and padding rows are not)."""
    return live[:, None]


class LayeredSteps(Steps):
    """The Steps protocol (moejax.steps.protocol) run layer by layer; `placement` runs the
    routed experts of every MoE layer (`placement.moe(layer: Layer, x, y, idx, weights) -> x`). A placement with
    `needs_router(layer index) -> bool` may skip a layer's router: its `moe` then gets idx = weights = None."""

    def __init__(self, graphdef: nnx.GraphDef, params: nnx.State, kernels: Kernels, placement: LayerRuntime) -> None:
        # a resident model's stacks walked layer by layer (recording traces): each layer's weights sliced out
        self.graphdef = graphdef
        model = phases.model_of(graphdef, params).unstacked()
        shared: dict = {}
        self.layers = [Layer(i, *nnx.split(layer), shared) for i, layer in enumerate(model.layers)]
        self.moe_layers = [i for i, layer in enumerate(model.layers) if isinstance(layer.mlp, MoEBlock)]
        self.kernels, self.placement = kernels, placement
        self.passes = 0  # forward passes through the layers so far (predictors key their state on it)
        self.valid: jax.Array | None = None  # the pass's valid tokens (run_layers)
        jit = lambda fn, **kw: jax.jit(functools.partial(_phase, fn, graphdef), **kw)  # noqa: E731
        self._logits = jit(phases.logits_begin), jit(phases.logits_end)
        self._logprobs = (jit(phases.logprobs_begin, static_argnames=("k",)),
                          jit(phases.logprobs_end, static_argnames=("k",)))
        self._score = (jit(phases.score_begin, static_argnames=("span",)),
                       jit(phases.score_end, donate_argnums=(4,), static_argnames=("span",)))
        self._greedy_score = (self._score[0],
                              jit(phases.greedy_score_end, donate_argnums=(4,), static_argnames=("span",)))
        self._prefill = (jit(phases.prefill_begin, static_argnames=("cache_len",)),
                         jit(phases.prefill_end, static_argnames=("cache_len",), donate_argnums=(4,)))
        self._decode_start = jax.jit(phases.decode_start, static_argnums=(1,))
        self._decode = jit(phases.decode_begin), jit(phases.decode_end)
        self._chunk = (jit(paged_phases.chunk_begin, static_argnames=("fresh",)),
                       jit(paged_phases.chunk_end, static_argnames=("fresh",)))
        self._token = jit(paged_phases.token_begin), jit(paged_phases.token_end)
        self._paged_start = jax.jit(paged_phases.decode_start, static_argnums=(2,))
        self._paged_finish = jax.jit(paged_phases.decode_finish, donate_argnums=(0,))

    def run_layers(self, x: jax.Array, at: Positions, cache: Sequence[Cache] | None = None, read_cache: bool = True,
                   prior: Sequence[kv_pool.Layer] | None = None, valid: jax.Array | None = None
                   ) -> tuple[jax.Array, list[Cache]]:
        """valid [B, T] bool: the pass's tokens that are requests' (not padding; None: all of them)."""
        self.inputs = x  # the pass's input embeddings: expert-map predictors search on them (fMoE §4.2)
        self.valid = valid  # predictors that learn from the pass (expert maps) skip its padding
        self.placement.begin_pass(self)
        needs_router = self.placement.needs_router
        new = []
        for i, layer in enumerate(self.layers):
            args = (x, at, None if cache is None else cache[i], None if prior is None else prior[i])
            if i in self.moe_layers and needs_router(i):
                x, y, c, idx, weights = layer(attend_route, *args, kernels=self.kernels, read_cache=read_cache)
                x = self.placement.moe(layer, x, y, idx, weights)
            elif i in self.moe_layers:
                x, y, c = layer(attend, *args, kernels=self.kernels, read_cache=read_cache)
                x = self.placement.moe(layer, x, y, None, None)
            else:
                x, c = layer(whole_layer, *args, kernels=self.kernels, read_cache=read_cache)
            new.append(c)
        self.passes += 1
        return x, new

    def host_value(self, x: jax.Array) -> np.ndarray:
        """A value the loops below read on the host (DEP's steps read it from the devices of other processes)."""
        return np.asarray(x)

    def _run(self, phases: tuple[Callable, Callable], state: nnx.State, *args: Any, read_cache: bool = True,
             valid: jax.Array | None = None, **static: Any) -> Any:
        begin, end = phases
        inputs, context = begin(state, *args, **static)
        x, new = self.run_layers(**inputs, read_cache=read_cache, valid=valid)
        return end(state, x, new, context, *args, **static)

    # -- the Engine's steps ----------------------------------------------------------------------------------
    def logits(self, state: nnx.State, tokens: jax.Array) -> jax.Array:
        return self._run(self._logits, state, tokens)

    def logprobs(self, state: nnx.State, tokens: jax.Array, *, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
        return self._run(self._logprobs, state, tokens, k=k)

    def score(self, state: nnx.State, pool: list[kv_pool.Layer] | None, batch: dict[str, jax.Array], *,
              span: tuple = (0, None)) -> tuple[jax.Array, list[kv_pool.Layer] | None]:
        return self._run(self._score, state, pool, batch, span=span)

    def greedy_score(self, state: nnx.State, pool: list[kv_pool.Layer] | None, batch: dict[str, jax.Array], *,
                     span: tuple = (0, None)) -> tuple[tuple[jax.Array, jax.Array], list[kv_pool.Layer] | None]:
        return self._run(self._greedy_score, state, pool, batch, span=span)

    def prefill(self, state: nnx.State, pool: list[kv_pool.Layer] | None, rows: PrefillRows, *, cache_len: int
                ) -> tuple[Sequence[Cache], jax.Array, list[kv_pool.Layer] | None]:
        read_cache = phases.prefill_reads_cache(pool, rows)
        return self._run(self._prefill, state, pool, rows, read_cache=read_cache, valid=_prefill_valid(rows),
                         cache_len=cache_len)

    def decode(self, state: nnx.State, cache: Sequence[Cache], rows: DecodeRows, *, steps: int
               ) -> tuple[jax.Array, jax.Array]:
        begin, end = self._decode
        loop = self._decode_start(rows, steps)
        limit = int(np.max(np.asarray(rows.max_new)))
        for _ in range(1, limit):  # the resident loop's condition, checked on the host
            if bool(np.all(self.host_value(loop.done))):
                break
            x, cache = self.run_layers(**begin(state, loop, rows), cache=cache, valid=_rows_valid(~loop.done))
            loop = end(state, x, loop, rows)
        return loop.out, loop.counts

    # -- the paged steps of continuous batching (moejax.steps.paged_phases) ----------------------------------------
    def chunk(self, state: nnx.State, pool: list[kv_pool.Layer], carry: jax.Array, rows: ChunkRows, *, fresh: bool
              ) -> tuple[list[kv_pool.Layer], jax.Array, jax.Array]:
        return self._run(self._chunk, state, pool, carry, rows, read_cache=not fresh,
                         valid=_chunk_valid(rows.tokens, rows.n), fresh=fresh)

    def paged_decode(self, state: nnx.State, pool: list[kv_pool.Layer], carry: jax.Array, rows: PagedDecodeRows, *,
                     steps: int) -> tuple[list[kv_pool.Layer], jax.Array, jax.Array]:
        begin, end = self._token
        loop = self._paged_start(carry, rows, steps)
        for _ in range(steps):  # the resident loop's condition, checked on the host
            if not bool(np.any(self.host_value(loop.live))):
                break
            x, caches = self.run_layers(**begin(state, pool, loop, rows), valid=_rows_valid(loop.live))
            pool, loop = end(state, x, caches, loop, rows)
        return pool, self._paged_finish(carry, rows.slot, loop.out), loop.out

    def decode_pool(self, params: nnx.State, num_blocks: int, /) -> Pool:
        return phases.zeroed_pool(self.graphdef, params, num_blocks)

    def logits_hlo(self, params: nnx.State, tokens: jax.ShapeDtypeStruct, /) -> str | None:
        return None  # the layers run from Python: no one program
