"""Pipeline parallelism for prefill (layout attn=pp,experts=pp, MoE-Prefill Table 1's PP+PP): the decoder layers
split contiguously over P devices (stages, moejax.sharding.stages), a step's rows split into M micro-batches that
flow through the stages GPipe-style, all in one jit: a shard_map over the stage axis in which each device runs its
own layers (`lax.switch` on its stage index) and hands its micro-batch's hidden states to the next stage with a
`ppermute` (a collective-permute in the compiled HLO, which moejax.sharding.hlo_comm counts).

Schedule: tick t = 0 .. M+P-2; at tick t stage s runs micro-batch t-s when 0 <= t-s < M (else it idles: the
pipeline's fill and drain bubbles), then every stage passes its output on (ticks 0 .. M+P-3, one
collective-permute each). Stage 0 embeds its micro-batch, the last stage keeps its outputs and runs the head.
The ticks that send are one loop (`fori_loop`: each stage's layers compile once, whatever M; XLA knows its trip
count, which moejax.sharding.hlo_comm multiplies), the last tick follows it.
The embedding, final norm and head are on every device (replicated, small next to the layers); each stage's
layers are stacked by kind (moejax.sharding.stages) into arrays sharded over the stages, so a device holds its
stage's layers only. The outputs come back from the last stage's device.

Prefill-only: full logits, token log-probabilities and packed-tree scoring without a prefix KV pool
(Engine.logits, Engine.token_logprobs, Engine.score_packed with pool=None: what launch.serve's scoring runs with
--prefix-cache-mb 0). Scoring with a prefix pool, generation (prefill into a KV cache, decode) and the paged steps
are refused with a clear error: each stage would keep its layers' caches, which this does not implement."""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from moejax.kernels.backends import Kernels
from moejax.layout import Layout
from moejax.models.decoder import MoEModel
from moejax.sharding.experts import AXIS
from moejax.sharding.stages import slots, stage_layers
from moejax.steps import phases
from moejax.steps.protocol import Pool, Steps

PREFILL_ONLY = ("layout attn=pp,experts=pp runs prefill-only scoring (Engine.logits, Engine.token_logprobs, "
                "packed-tree scoring without a prefix cache: serve with --prefix-cache-mb 0); {what} would keep each "
                "stage's KV cache on its device, which the pipeline does not implement")


class StageStore:
    """The decoder layers' tensors, kept on the host as loading gives them until PipelineSteps stacks them by stage
    (the params hold 0-d stand-ins for them)."""

    def __init__(self) -> None:
        self.arrays: dict[tuple, np.ndarray] = {}

    def add(self, path: tuple, array: Any) -> jax.Array:
        self.arrays[path] = np.asarray(array)
        return jnp.zeros((), self.arrays[path].dtype)


class _Layer:
    """How one decoder layer is rebuilt inside the stage program: its graphdef, its state's tree structure, and
    where its arrays sit in the stacked weights (kind index, slot on its stage)."""

    def __init__(self, graphdef: nnx.GraphDef, treedef: Any, kind: int, slot: int) -> None:
        self.graphdef, self.treedef, self.kind, self.slot = graphdef, treedef, kind, slot


class PipelineSteps(Steps):
    """The Steps protocol (moejax.steps.protocol) for the pipeline layout: `logits`, `logprobs`, `score` and
    `greedy_score` (without a prefix pool); the steps that keep a KV cache raise. Each stage program has
    `.lower(params, rows, **static)` for the compiled HLO (Engine.explain)."""
    logits: _Step
    logprobs: _Step

    def __init__(self, graphdef: nnx.GraphDef, params: nnx.State, kernels: Kernels, store: StageStore,
                 layout: Layout, mesh: Mesh) -> None:
        assert layout.devices is not None and layout.microbatches is not None  # resolved
        self.layout, self.mesh, self.kernels, self.graphdef = layout, mesh, kernels, graphdef
        model = phases.model_of(graphdef, params)
        self.stages = stage_layers(len(model.layers), layout.devices)
        splits = [nnx.split(layer) for layer in model.layers]
        layer_arrays, kinds = [], []
        for i, (_, standin) in enumerate(splits):
            arrays = [store.arrays.pop(("layers", i, *path)) for path, _ in nnx.to_flat_state(standin)]
            treedef = jax.tree.structure(standin)
            layer_arrays.append(arrays)
            kinds.append((treedef, tuple((a.shape, a.dtype.name) for a in arrays)))
        counts, where = slots(kinds, layout.devices)
        kind_list = list(counts)
        self.layers = [_Layer(g, kinds[i][0], kind_list.index(where[i][0]), where[i][1])
                       for i, (g, _) in enumerate(splits)]
        self.weights = [self._stack(kind, counts[kind], [i for i in range(len(kinds)) if kinds[i] == kind],
                                    layer_arrays) for kind in kind_list]
        self.logits = _Step(self, _logits)
        self.logprobs = _Step(self, _logprobs)
        self._score = _Step(self, _score)
        self._greedy_score = _Step(self, _greedy_score)

    def _stack(self, kind: tuple, n: int, members: list[int], layer_arrays: list[list[np.ndarray]]
               ) -> list[jax.Array]:
        """One kind's arrays, [stages, n slots, *shape] each, sharded by stage: each device's block built from its
        own stage's layers (zeros in unused slots)."""
        sharding = NamedSharding(self.mesh, P(AXIS))
        stages = self.layout.devices
        assert stages is not None  # resolved

        def blocks(leaf: int, shape: tuple, dtype: str) -> Callable[[Any], np.ndarray]:
            def block(index: Any) -> np.ndarray:  # index: this device's slices of the stacked array
                stage = index[0].start or 0
                arr = np.zeros((1, n, *shape), dtype)
                for i in members:
                    if i in self.stages[stage]:
                        arr[0, self.layers[i].slot] = layer_arrays[i][leaf]
                return arr
            return block
        out: list[jax.Array] = []
        for leaf, (shape, dtype) in enumerate(kind[1]):
            out.append(jax.make_array_from_callback((stages, n, *shape), sharding, blocks(leaf, shape, dtype)))
        return out

    def program(self, begin: Callable, end: Callable) -> Any:
        """The jitted step (params, weights, rows) -> per-stage outputs stacked [stages, ...] (the last stage's are
        the step's). rows: a pytree of [B, ...] arrays, split into micro-batches of B/M rows; begin(model, a
        micro-batch's rows) -> (hidden states, Positions); end(model, last hidden states [B, T, D], rows) -> the
        step's outputs."""
        layout = self.layout
        S, M = layout.devices, layout.microbatches
        assert S is not None and M is not None  # resolved

        def run_stage(stage: int, weights: list, x: jax.Array, at: Any) -> jax.Array:
            for i in self.stages[stage]:
                spec = self.layers[i]
                leaves = [a[0, spec.slot] for a in weights[spec.kind]]
                layer = nnx.merge(spec.graphdef, jax.tree.unflatten(spec.treedef, leaves))
                x, _ = layer(x, at, None, None, read_cache=True, kernels=self.kernels)
            return x

        def per_device(params: nnx.State, weights: list, rows: Any) -> Any:
            model: MoEModel = phases.model_of(self.graphdef, params)
            stage = jax.lax.axis_index(AXIS)
            micro = jax.tree.map(lambda a: a.reshape(M, a.shape[0] // M, *a.shape[1:]), rows)
            branches = [functools.partial(run_stage, s, weights) for s in range(S)] + [lambda x, at: x]

            def tick(t: Any, held: jax.Array, finished: jax.Array) -> tuple[jax.Array, jax.Array]:
                m = jnp.clip(t - stage, 0, M - 1)  # the micro-batch this stage runs at tick t (stage 0: t)
                x, at = begin(model, jax.tree.map(lambda a: a[m], micro))
                held = jnp.where((stage == 0) & (t < M), x, held)  # stage 0 starts micro-batch t
                busy = (t >= stage) & (t - stage < M)
                held = jax.lax.switch(jnp.where(busy, stage, S), branches, held, at)
                done = t - (S - 1)  # the last stage finished this micro-batch
                finished = jnp.where((stage == S - 1) & (done >= 0),
                                     jax.lax.dynamic_update_index_in_dim(finished, held, jnp.maximum(done, 0), 0),
                                     finished)
                return held, finished

            def tick_and_send(t: jax.Array, carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
                held, finished = tick(t, *carry)
                if S > 1:
                    held = jax.lax.ppermute(held, AXIS, [(s, s + 1) for s in range(S - 1)])
                return held, finished
            shape = jax.eval_shape(lambda: begin(model, jax.tree.map(lambda a: a[0], micro))[0])
            carry = (jnp.zeros(shape.shape, shape.dtype), jnp.zeros((M, *shape.shape), shape.dtype))
            # one program for every tick but the last (a loop: each stage's layers compile once), which sends nothing
            carry = jax.lax.fori_loop(0, M + S - 2, tick_and_send, carry)
            _, finished = tick(M + S - 2, *carry)
            x = finished.reshape(-1, *shape.shape[1:])

            def head() -> Any:
                return end(model, x, rows)
            shapes = jax.eval_shape(head)
            out = jax.lax.cond(stage == S - 1, head,
                               lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes))
            return jax.tree.map(lambda a: a[None], out)

        def step(params: nnx.State, weights: list, rows: Any) -> Any:
            B = jax.tree.leaves(rows)[0].shape[0]
            if B % M:
                raise ValueError(f"pipeline: the batch's {B} rows do not split into {M} micro-batches (pad rows to "
                                 "a multiple of Layout.row_multiple)")
            return jax.shard_map(per_device, mesh=self.mesh, in_specs=(P(), P(AXIS), P()), out_specs=P(AXIS),
                                 check_vma=False)(params, weights, rows)
        return jax.jit(step)

    def last_stage(self, out: Any) -> Any:
        """The last stage's block of each stacked output, as an array on that stage's device."""
        last = self.mesh.devices.flat[-1]

        def take(a: jax.Array) -> jax.Array:
            (shard,) = [s for s in a.addressable_shards if s.device == last]
            return shard.data[0]
        return jax.tree.map(take, out)

    def score(self, params: nnx.State, pool: Pool | None, batch: dict, *, span: tuple = (0, None)
              ) -> tuple[jax.Array, None]:
        """moejax.steps.phases.score without a prefix KV pool -> (target log-probabilities [B, G], None)."""
        _refuse_a_pool(pool, batch)
        return self._score(params, batch, span=span), None

    def greedy_score(self, params: nnx.State, pool: Pool | None, batch: dict, *, span: tuple = (0, None)
                     ) -> tuple[tuple[jax.Array, jax.Array], None]:
        """moejax.steps.phases.greedy_score without a prefix KV pool -> ((log-probabilities, greedy) [B, G], None)."""
        _refuse_a_pool(pool, batch)
        return self._greedy_score(params, batch, span=span), None

    @property
    def score_step(self) -> _Step:
        """The packed-tree scoring step (`score`'s), for its compiled HLO."""
        return self._score

    def logits_hlo(self, params: nnx.State, tokens: jax.ShapeDtypeStruct, /) -> str | None:
        return self.logits.lower(params, tokens).compile().as_text()

    # -- the steps a pipeline does not run -------------------------------------------------------------------------
    def decode_pool(self, params: nnx.State, num_blocks: int, /) -> Pool:
        raise ValueError(PREFILL_ONLY.format(what="continuous batching's KV pool"))

    def prefill(self, *args: Any, **kwargs: Any) -> Any:
        raise ValueError(PREFILL_ONLY.format(what="generation's prefill"))

    def decode(self, *args: Any, **kwargs: Any) -> Any:
        raise ValueError(PREFILL_ONLY.format(what="decode"))

    def chunk(self, *args: Any, **kwargs: Any) -> Any:
        raise ValueError(PREFILL_ONLY.format(what="continuous batching's chunked prefill"))

    def paged_decode(self, *args: Any, **kwargs: Any) -> Any:
        raise ValueError(PREFILL_ONLY.format(what="continuous batching's decode"))


# begin(model, rows, **static) -> (hidden states, Positions) of a micro-batch; end(model, x, rows, **static) -> outputs
def _logits_begin(model: MoEModel, tokens: jax.Array, **static: Any) -> tuple[jax.Array, Any]:
    inputs, _ = phases.logits_begin(model, tokens)  # static: logprobs' k, not needed here
    return inputs["x"], inputs["at"]


def _score_begin(model: MoEModel, batch: dict, *, span: tuple) -> tuple[jax.Array, Any]:
    inputs, _ = phases.score_begin(model, [], batch, span=span)
    return inputs["x"], inputs["at"]


_logits = (_logits_begin, lambda model, x, tokens: phases.logits_end(model, x, [], None, tokens))
_logprobs = (_logits_begin, lambda model, x, tokens, *, k: phases.logprobs_end(model, x, [], None, tokens, k=k))
_score = (_score_begin, lambda model, x, batch, *, span: phases.score_end(model, x, [], None, [], batch, span=span)[0])
_greedy_score = (_score_begin, lambda model, x, batch, *, span: phases.greedy_score_end(model, x, [], None, [], batch,
                                                                                       span=span)[0])


def _refuse_a_pool(pool: Pool | None, batch: dict) -> None:
    if pool is not None or "prior_ids" in batch or "store_ids" in batch:
        raise ValueError(PREFILL_ONLY.format(what="packed-tree scoring with a prefix KV pool (prefix cache)"))


class _Step:
    """One pipelined step: called as the Engine's jitted steps are (params, rows, **static); `lower` gives the
    jit's Lowered for the same arguments. begin_end: (begin, end) as PipelineSteps.program takes them, with the
    static keywords."""

    def __init__(self, pipeline: PipelineSteps, begin_end: tuple[Callable, Callable]) -> None:
        self.pipeline, self.begin_end = pipeline, begin_end
        self._jits: dict[tuple, Any] = {}

    def _jit(self, static: dict) -> Any:  # a jax.jit
        key = tuple(sorted(static.items()))
        if key not in self._jits:
            begin, end = self.begin_end
            self._jits[key] = self.pipeline.program(functools.partial(begin, **static),
                                                    functools.partial(end, **static))
        return self._jits[key]

    def __call__(self, params: nnx.State, rows: Any, **static: Any) -> Any:
        return self.pipeline.last_stage(self._jit(static)(params, self.pipeline.weights, rows))

    def lower(self, params: nnx.State, rows: Any, **static: Any) -> Any:
        return self._jit(static).lower(params, self.pipeline.weights, rows)
