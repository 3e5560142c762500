"""Engine: a loaded model with jit-compiled full-sequence, packed-scoring, prefill and decode steps."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import DTypeLike
from numpy.typing import ArrayLike
from tokenizers import Tokenizer

from moejax.buckets import bucket, rows_bucket
from moejax.chat import ChatTemplate
from moejax.config import ModelConfig
from moejax.costs import Transfer, by_kind, layout_comm
from moejax.kernels.backends import AUTO_KERNELS, Kernels
from moejax.layout import Layout
from moejax.models.decoder import MoEModel
from moejax.models.kv_pool import BLOCK, Layer
from moejax.offload.layered_steps import LayeredSteps
from moejax.offload.memory_budget import MemoryBudget, size
from moejax.placements.base import Placement, Store
from moejax.plan.engine_plan import EnginePlan
from moejax.plan.theta import Theta
from moejax.sampling import Sampling, SamplingParams
from moejax.sharding import hlo_comm
from moejax.sharding.mesh import make_mesh
from moejax.sharding.multihost import group_rows, shard_rows, to_host
from moejax.steps.phases import zeroed_pool
from moejax.steps.protocol import Steps
from moejax.steps.rows import ChunkRows, DecodeRows, PagedDecodeRows, PrefillRows

MIN_SEQ_BUCKET = 16


class Engine:
    """Serve one model. Weights are created lazily: a full-shape preset costs nothing until it runs."""

    def __init__(self, config: ModelConfig, graphdef: nnx.GraphDef, abstract_state: nnx.State,
                 materialize: Callable[[], tuple], tokenizer: Tokenizer | None = None, *, placement: Placement,
                 dtype: DTypeLike = jnp.float32, kernels: Kernels = AUTO_KERNELS, name: str = "",
                 chat_template: ChatTemplate | None = None, plan: EnginePlan | None = None,
                 decisions: Sequence[str] = (), saturation: Theta | None = None) -> None:
        """materialize() -> (the weights as an nnx.State, the placement's store or None). placement: where the
        routed experts live and which steps run (moejax.placements). plan: the moejax.plan.engine_plan.EnginePlan
        it was loaded with (auto choices made); decisions: what the planners chose for `auto` and why;
        saturation: Θ (moejax.plan.theta.ThetaEstimate, or a measured moejax.offload.saturation.Saturation), or None.
        chat_template: moejax.chat.ChatTemplate, or None when the model has none."""
        self.config = config
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.dtype = jnp.dtype(dtype)
        self.kernels = kernels
        self.name = name
        self._graphdef = graphdef
        self.abstract_params = abstract_state
        self._materialize = materialize
        self._state: nnx.State | None = None
        self.store: Store = None  # the placement's store (HostStore, DEP's expert group), once the weights are loaded
        self.placement = placement
        self.plan = plan
        self.decisions = list(decisions)
        self.saturation = saturation
        # layer-by-layer placements build their loop with the weights (first use of `steps`), as the pipeline its stages
        self._steps: Steps | None = None if placement.steps_need_weights else \
            placement.make_steps(graphdef, kernels, config)

    # -- weights ---------------------------------------------------------------------------------
    @property
    def params(self) -> nnx.State:
        """The weights (an offloaded model's routed experts are 0-d stand-ins here: they are in `store`)."""
        if self._state is None:
            self._state, self.store = self._materialize()
        return self._state

    @property
    def graphdef(self) -> nnx.GraphDef:
        return self._graphdef

    @property
    def memory_budget(self) -> MemoryBudget:
        return self.placement.memory_budget

    @property
    def layout(self) -> Layout | None:
        """The moejax.sharding.Layout, or None: one device."""
        return self.placement.layout

    @property
    def layer_by_layer(self) -> bool:
        """Whether the steps run layer by layer from Python (an offloaded placement driving the experts)."""
        return self.placement.layer_by_layer

    @property
    def steps(self) -> Steps:
        """The steps a forward runs (moejax.steps.protocol.Steps): whole-model jits, the placement's layer loop or
        the pipeline's stage programs (built with the weights)."""
        if self._steps is None:
            params = self.params
            self._steps = self.placement.make_steps(self._graphdef, self.kernels, self.config, params, self.store)
        return self._steps

    @property
    def layered_steps(self) -> LayeredSteps:
        """The layer loop of a layer-by-layer placement (moejax.offload.layered_steps.LayeredSteps)."""
        if not self.layer_by_layer:
            raise AttributeError(f"placement {self.placement.name} runs whole-model jits, not the layer loop")
        return cast("LayeredSteps", self.steps)  # a layer-by-layer placement's steps are its layer loop

    def use_theta(self, saturation: Theta) -> None:
        """Replace the load-time Θ by one measured on this engine (moejax.measure.saturation.profile_saturation)."""
        self.saturation = saturation

    def layer_experts(self, layer: int) -> dict:
        """Routed expert arrays of one MoE layer on the device, wherever they live ([E, ...] by name)."""
        if self.store is None:
            return nnx.merge(self._graphdef, self.params).layer(layer).mlp.expert_weights()
        if not self.store.per_expert:
            return self.store.fetch(layer)
        experts = [self.store.fetch_expert(layer, e) for e in range(self.store.num_experts(layer))]
        return {name: jnp.stack([e[name] for e in experts]) for name in experts[0]}

    def stats(self) -> dict:
        """Offloading counters since load or `reset_stats`: per MoE layer and in total, hits, misses, prefetches,
        bytes moved host -> device, seconds waited on transfers (and, speculative, mispredicted tokens)."""
        return self.placement.stats(self.layered_steps if self.layer_by_layer else None)

    def reset_stats(self) -> None:
        if self.layer_by_layer:
            self.placement.reset_stats(self.layered_steps)

    def explain(self, comm_shape: tuple[int, int] | None = None) -> str:
        """The memory budget, the placement and (when profiled) the saturation threshold, as text. For a
        layer-by-layer placement this builds it, which loads the weights. With a layout, also the communication
        per device per layer for a forward over `comm_shape` = (batch, seq) tokens (default: one row of 128
        tokens per device; the pipeline: per micro-batch): the analytic figures (moejax.costs.layout_comm, as
        implemented and MoE-Prefill Table 1's) next to the collectives of the compiled full-logits step, which
        this compiles (loading the weights first if they are not yet: the compiled step depends on how they are
        placed)."""
        lines = [f"model {self.name}: {self.config.num_layers} layers, {size(self.param_bytes())} of weights "
                 f"({self.dtype.name})"]
        lines += self.decisions
        if self.layout is not None:
            lines.append(f"layout {self.layout}")
            lines += self._explain_comm(comm_shape)
        lines.append(self.memory_budget.describe())
        placement = self.placement.describe(self.layered_steps if self.layer_by_layer else None)
        if placement is not None:
            lines.append(placement)
        if self.saturation is not None:
            lines.append(self.saturation.describe())
        return "\n".join(lines)

    def _explain_comm(self, shape: tuple[int, int] | None) -> list[str]:
        """explain(): a layout's communication, analytic next to measured (moejax.sharding.hlo_comm; split into
        the routed experts' programs and the rest by op metadata). DEP: its transfer counters instead, if a
        forward has run since load or reset_stats (they cover every forward since, of whatever shape)."""
        lay = self.layout
        assert lay is not None and lay.devices is not None  # explain() asks with a layout, resolved at load
        default_batch = {"dep": lay.attn_devices, "pp": lay.microbatches}.get(lay.experts, lay.devices)
        assert default_batch is not None  # DEP's groups are resolved with the layout
        B, T = shape or (default_batch, min(128, self.config.max_position_embeddings))
        comm = layout_comm(self.config, lay, B, T, self.dtype.itemsize)

        def kinds(totals: dict, per: int = 1) -> str:
            return ", ".join(f"{kind} {size(v / per)}" for kind, v in sorted(totals.items())) or "none"

        def analytic(transfers: Sequence[Transfer]) -> str:
            detail = " + ".join(f"{t.what} {size(t.bytes_sent)}" for t in transfers)
            return kinds(by_kind(transfers)) + (f" = {detail}" if detail else "")
        head = (f"communication per device per layer (attention) and MoE layer (routed experts), forward of batch "
                f"{B} x {T} tokens, bytes sent by ring convention")
        if self.layer_by_layer:
            lines = [head + "; measured: " + ("DEP's transfer counters" if lay.experts == "dep" else
                                             "not for a layer-by-layer placement")]
            lines.append(f"  experts (x{comm.moe_layers}): analytic {analytic(comm.experts)}; useful "
                         f"{size(comm.ideal_experts)}")
            stats = self.stats()
            if lay.experts == "dep" and stats["layers"]:
                a2e, e2a = (stats["total"][k] / len(stats["layers"]) for k in ("a2e_bytes", "e2a_bytes"))
                lines.append(f"  measured since load/reset, per MoE layer: A->E {size(a2e / lay.attn_devices)} per "
                             f"attention device, E->A {size(e2a / lay.expert_devices)} per expert device (the sum "
                             "of every forward since, of its own shape)")
            return lines
        ids = jax.ShapeDtypeStruct((B, T), jnp.int32)
        hlo = self.steps.logits_hlo(self.params, ids)
        assert hlo is not None  # not layer by layer (above): one program runs the step
        found = hlo_comm.collectives(hlo)
        lines = [head + f"; measured: the {len(found)} collectives of the compiled full-logits step"]
        for part, per, transfers, ideal in (("attention", comm.layers, comm.attention, comm.ideal_attention),
                                            ("experts", comm.moe_layers, comm.experts, comm.ideal_experts)):
            # the pipeline's stage program is one shard_map: its sends count as attention's (moejax.costs)
            inside = (part == "experts") if lay.attn != "pp" else (None if part == "attention" else False)
            measured = hlo_comm.bytes_by_kind(found, in_shard_map=inside)
            lines.append(f"  {part} (x{per}): analytic {analytic(transfers)}; Table 1 {size(ideal)}; "
                         f"measured {kinds(measured, max(per, 1))}")
        if comm.first_experts != comm.experts:
            lines.append(f"  first MoE layer's experts: analytic {analytic(comm.first_experts)} (whole on every "
                         "device: the measured mean above includes it)")
        if self.dtype.itemsize < 4 and jax.devices()[0].platform == "cpu":
            lines.append("  (XLA:CPU widens 16-bit collectives to float32: measured exceeds analytic here)")
        return lines

    def padded_rows(self, rows: int) -> int:
        """The rows a step over `rows` rows computes (its compiled shape's batch)."""
        return rows_bucket(rows, self.row_multiple)

    def padded_length(self, tokens: int) -> int:
        """The sequence length a whole-batch step over rows of at most `tokens` tokens computes."""
        return bucket(tokens, MIN_SEQ_BUCKET)

    @property
    def row_multiple(self) -> int:
        """Batches are padded to a multiple of this many rows (Layout.row_multiple; 1 on one device)."""
        return 1 if self.layout is None else self.layout.row_multiple

    def param_shapes(self) -> dict[tuple, jax.ShapeDtypeStruct]:
        """Every weight's abstract array by its per-layer path (('layers', i, 'mlp', 'we_down'), ...), whether the
        model holds its layers one by one or as stacked runs: what memory budgets and layouts account by."""
        model = nnx.eval_shape(lambda: MoEModel(self.config, self.dtype))
        return {path: var.get_value() for path, var in nnx.to_flat_state(nnx.state(model))}

    def param_bytes(self) -> int:
        """Bytes of all weights (from abstract shapes; allocates nothing)."""
        return sum(int(np.prod(v.shape)) * jnp.dtype(v.dtype).itemsize
                   for v in jax.tree.leaves(self.abstract_params))

    # -- public API --------------------------------------------------------------------------------
    def logits(self, token_ids: ArrayLike) -> np.ndarray:
        """token_ids int [B, T] -> float32 logits [B, T, vocab] at every position."""
        ids = np.asarray(token_ids)
        if ids.ndim != 2 or ids.shape[1] == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"token_ids must be a non-empty int array of shape (B, T); got {ids.dtype} {ids.shape}")
        self._check_ids(ids.reshape(-1), "token_ids")
        B, T = ids.shape
        if T > self.config.max_position_embeddings:
            raise ValueError(f"token_ids: {T} tokens exceed the model's context of "
                             f"{self.config.max_position_embeddings}")
        padded = np.zeros((rows_bucket(B, self.row_multiple), bucket(T, MIN_SEQ_BUCKET)), np.int32)
        padded[:B, :T] = ids
        out = self.steps.logits(self.params, self._token_rows(padded))
        return _to_host(out)[:B, :T] if self._rows_span_processes else np.asarray(out[:B, :T])

    @property
    def _rows_span_processes(self) -> bool:
        return self.layout is not None and jax.process_count() > 1

    def _token_rows(self, padded: np.ndarray) -> jax.Array:
        """Host token ids [B, T] as a step's input. Several processes: the ids (the same in every process) as one
        global array split by rows over the layout's devices (moejax.sharding.multihost); the outputs come back
        through _to_host."""
        if not self._rows_span_processes:
            return jnp.asarray(padded)
        assert self.layout is not None and self.layout.devices is not None  # _rows_span_processes: a resolved layout
        if self.layout.experts == "dep":  # the rows go to the attention group, which may leave out processes
            assert self.layout.attn_devices is not None  # resolved
            return group_rows(padded, make_mesh(self.layout.attn_devices))
        return shard_rows(padded, make_mesh(self.layout.devices))

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                 stop_token_ids: Sequence[int] | None = None, sampling: SamplingParams | None = None,
                 **fields: Any) -> list[list[int]]:
        """New tokens for each prompt (greedy when temperature is 0). A sequence ends after
        `max_new_tokens` or after emitting one of `stop_token_ids` (kept as its last token).
        How tokens are drawn: `sampling`, with any of its fields given by keyword instead (temperature=0.7,
        top_p, top_k, min_p, seed; moejax.sampling.SamplingParams). Row r samples with the key
        fold_in(key(seed), r), seed 0 when none is given."""
        if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0; got {max_new_tokens!r}")
        params = dataclasses.replace(sampling or SamplingParams(), **fields)  # checks each (ValueError naming it)
        seed = 0 if params.seed is None else params.seed
        prompts = [list(p) for p in prompts]
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompts[{i}] is empty")
            self._check_ids(np.asarray(p), f"prompts[{i}]")
            if len(p) + max_new_tokens > self.config.max_position_embeddings:
                raise ValueError(f"prompts[{i}]: {len(p)} tokens + max_new_tokens {max_new_tokens} exceed the "
                                 f"model's context of {self.config.max_position_embeddings}")
        if not prompts or max_new_tokens == 0:
            return [[] for _ in prompts]
        n = len(prompts)
        keys = jax.vmap(lambda r: jax.random.fold_in(jax.random.key(seed), r))(jnp.arange(n, dtype=jnp.uint32))
        out, _ = self.generate_rows(prompts, [max_new_tokens] * n, sampling=[params] * n, keys=keys,
                                    stop_token_ids=[stop_token_ids or ()] * n)
        return out

    def generate_rows(self, prompts: Sequence[Sequence[int]], max_new: Sequence[int], *,
                      sampling: Sequence[SamplingParams], keys: jax.Array,
                      stop_token_ids: Sequence[Sequence[int]], pool: list[Layer] | None = None,
                      prior_blocks: Sequence[Sequence[int]] | None = None,
                      store_blocks: Sequence[Sequence[tuple[int, int]]] | None = None,
                      expand: Sequence[int] | None = None) -> tuple[list[list[int]], list[Layer] | None]:
        """Per-row generation for the batch runner (inputs already validated). keys: PRNG keys [n].
        With a prefix pool: prior_blocks[r] = pool blocks holding prompt r's first 16*len tokens (the prefill
        starts after them); store_blocks[r] = [(block id, first position)] of prompt blocks to keep in the pool.
        expand[j]: the prompt that output row j continues (several choices share one prefill); then max_new,
        sampling, keys and stop_token_ids are per output row (sampling's seeds unused: keys are the rows'). Returns
        (new tokens per row, pool)."""
        n = len(prompts)
        m = n if expand is None else len(expand)
        B, Bm = self.padded_rows(n), self.padded_rows(m)
        skip = [BLOCK * len(p) for p in prior_blocks] if prior_blocks else [0] * n
        T = self.padded_length(max(len(p) - s for p, s in zip(prompts, skip, strict=True)))
        tokens = np.zeros((B, T), np.int32)
        positions = np.tile(np.arange(T, dtype=np.int32), (B, 1))
        last = np.zeros((B,), np.int32)
        for i, (p, s) in enumerate(zip(prompts, skip, strict=True)):
            tokens[i, : len(p) - s] = p[s:]
            positions[i] += s
            last[i] = len(p) - s - 1
        source = list(range(n)) if expand is None else list(expand)
        lengths = np.ones((Bm,), np.int32)
        lengths[:m] = [len(prompts[i]) for i in source]
        steps = bucket(max(max_new), MIN_SEQ_BUCKET)
        cache_len = bucket(int(lengths.max()), MIN_SEQ_BUCKET) + steps
        extra = {}
        if prior_blocks and max(map(len, prior_blocks)):
            extra["prior_ids"] = _pad_rows(prior_blocks, B, bucket(max(map(len, prior_blocks))), 0)
        if store_blocks and max(map(len, store_blocks)):
            width = bucket(max(map(len, store_blocks)))
            extra["store_ids"] = _pad_rows([[b for b, _ in r] for r in store_blocks], B, width, _pool_size(pool))
            starts = _pad_rows([[p for _, p in r] for r in store_blocks], B, width, 0)
            extra["store_src"] = starts[:, :, None] + np.arange(BLOCK, dtype=np.int32)
        if expand is not None:
            extra["expand"] = np.array(source + [0] * (Bm - m), np.int32)
        if B > n:  # padding rows: expert predictors neither match nor store them
            extra["requests"] = np.arange(B) < n
        stops = _pad_rows([list(s) for s in stop_token_ids], Bm, bucket(max(map(len, stop_token_ids), default=0), 4),
                          -1)
        row_keys = jnp.concatenate([keys, jnp.broadcast_to(keys[:1], (Bm - m,))]) if Bm > m else keys
        row_sampling = jax.tree.map(jnp.asarray, Sampling.of(sampling, row_keys, np.zeros((Bm,), np.int32), Bm))
        maxn = np.ones((Bm,), np.int32)
        maxn[:m] = max_new
        prefill = PrefillRows(jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(last), row_sampling,
                              **{k: jnp.asarray(v) for k, v in extra.items()})
        cache, first, pool = self.steps.prefill(self.params, pool, prefill, cache_len=cache_len)
        decode = DecodeRows(first, jnp.asarray(lengths), jnp.asarray(stops), jnp.asarray(maxn), row_sampling)
        out, count = (_to_host(a) for a in self.steps.decode(self.params, cache, decode, steps=steps))
        return [out[i, : count[i]].tolist() for i in range(m)], pool

    def token_logprobs(self, sequences: Sequence[Sequence[int]], k: int, *, max_batch_tokens: int = 4096
                       ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """For each token sequence s: (logprob of s[t+1] after s[:t+1] for t < len(s) - 1, and the k most likely
        next tokens there as (logprobs [len-1, k], ids [len-1, k])), as numpy. Rows are batched up to
        `max_batch_tokens` padded tokens (the step holds [rows, T, vocab] float32 log-probabilities)."""
        out: list[tuple[np.ndarray, np.ndarray, np.ndarray] | None] = [None] * len(sequences)
        order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))
        while order:
            T = bucket(len(sequences[order[0]]), MIN_SEQ_BUCKET)
            take = max(1, min(len(order), max_batch_tokens // T))
            rows, order = order[:take], order[take:]
            B = rows_bucket(len(rows), self.row_multiple)
            ids = np.zeros((B, T), np.int32)
            for r, i in enumerate(rows):
                ids[r, : len(sequences[i])] = sequences[i]
            chosen, top, top_ids = (_to_host(a) for a in self.steps.logprobs(self.params, self._token_rows(ids), k=k))
            for r, i in enumerate(rows):
                L = len(sequences[i]) - 1
                out[i] = (chosen[r, :L], top[r, :L], top_ids[r, :L])
        return cast("list[tuple[np.ndarray, np.ndarray, np.ndarray]]", out)  # every sequence's is filled

    # -- packed scoring and the prefix pool ----------------------------------------------------------------
    def init_pool(self, num_blocks: int, *, decode: bool = False) -> list[Layer]:
        """A zeroed prefix-KV pool of `num_blocks` blocks of BLOCK tokens (cache layout, per layer). decode: the
        continuous-batching pool, which a placement may keep elsewhere (lightning: in host memory)."""
        if decode:
            return self.steps.decode_pool(self.abstract_params, num_blocks)
        return zeroed_pool(self._graphdef, self.abstract_params, num_blocks)

    def paged_chunk(self, pool: list[Layer], carry: jax.Array, rows: ChunkRows, *, fresh: bool
                    ) -> tuple[list[Layer], jax.Array, jax.Array]:
        """moejax.steps.paged_phases.chunk (pool and carry donated) -> (pool, carry, next token per row, on device).
        Host (numpy) rows go straight into the jitted call, which copies them (measured: 9 us for nine small arrays,
        where a device_put of them took 286 us and jnp.asarray compiled a program per new shape); keys typed or
        raw."""
        return self.steps.chunk(self.params, pool, carry, rows, fresh=fresh)

    def paged_decode(self, pool: list[Layer], carry: jax.Array, rows: PagedDecodeRows, *, steps: int
                     ) -> tuple[list[Layer], jax.Array, jax.Array]:
        """moejax.steps.paged_phases.decode (pool and carry donated) -> (pool, carry, tokens [B, steps], on device);
        rows as for paged_chunk."""
        return self.steps.paged_decode(self.params, pool, carry, rows, steps=steps)

    def kv_bytes_per_token(self) -> int:
        return nnx.merge(self._graphdef, self.abstract_params).kv_bytes_per_token()

    def score_packed(self, batch: dict[str, np.ndarray], pool: list[Layer] | None = None,
                     span: Sequence[int | None] = (0, None)) -> tuple[jax.Array, list[Layer] | None]:
        """Run moejax.steps.phases.score on host arrays (span: their packing.TreeSpan); returns (logprobs [B, G] on the
        device, pool) without waiting for them: `to_host` reads them (the batch runner dispatches the next batch
        first)."""
        return self.steps.score(self.params, pool, {k: jnp.asarray(v) for k, v in batch.items()}, span=tuple(span))

    def score_packed_greedy(self, batch: dict[str, np.ndarray], pool: list[Layer] | None = None,
                            span: Sequence[int | None] = (0, None)
                            ) -> tuple[tuple[jax.Array, jax.Array], list[Layer] | None]:
        """score_packed that also says whether each target token is its position's argmax (lm-eval's is_greedy):
        -> ((logprobs [B, G], greedy [B, G]) on the device, pool)."""
        arrays = {k: jnp.asarray(v) for k, v in batch.items()}
        return self.steps.greedy_score(self.params, pool, arrays, span=tuple(span))

    @staticmethod
    def to_host(x: jax.Array) -> np.ndarray:
        """A step's output as numpy, once it is computed (with several processes, from every process's devices)."""
        return _to_host(x)

    def _check_ids(self, ids: np.ndarray, where: str) -> None:
        if ids.size and (ids.min() < 0 or ids.max() >= self.config.vocab_size):
            bad = ids[(ids < 0) | (ids >= self.config.vocab_size)][0]
            raise ValueError(f"{where}: token id {int(bad)} is outside the vocabulary [0, {self.config.vocab_size})")



def _pad_rows(rows: Sequence[Sequence[int]], B: int, width: int, fill: int) -> np.ndarray:
    out = np.full((B, width), fill, np.int32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def _pool_size(pool: list[Layer] | None) -> int:
    return jax.tree.leaves(pool)[0].shape[0] if pool is not None else 0


def _to_host(x: jax.Array) -> np.ndarray:
    """A step's output as numpy; with several processes it may span devices of other processes (multihost)."""
    if jax.process_count() == 1:
        return np.asarray(x)
    return to_host(x)

