"""Steps: what the Engine calls to run a forward, whichever way the placement runs it. Every implementation has
these methods with these signatures, and the Engine (and through it the schedulers and moejax.eval) calls nothing
else on them:

- WholeModelSteps (moejax.steps.whole_model): each step one jit over the whole model;
- LayeredSteps (moejax.offload.layered_steps): begin and end jitted, the layers run one by one from Python so a
  placement can move routed experts between them (DisaggregatedSteps in moejax.sharding.dep drives them its way);
- LightningSteps (moejax.lightning.cgopipe_steps): the layer loop with MoE-Lightning's CGOPipe schedule;
- PipelineSteps (moejax.sharding.pipeline_steps): the stages of the pipeline layout in one jit, prefill only (its
  steps that keep a KV cache raise a ValueError that says so).

Arguments before `/` are positional (implementations name them as they like); keywords after `*` are static (they
shape the compiled program). A step may donate the pool and carry it is given: use the ones it returns."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import jax
from flax import nnx

from moejax.models.attention import Cache
from moejax.models.kv_pool import Layer
from moejax.steps.rows import ChunkRows, DecodeRows, PagedDecodeRows, PrefillRows

Pool = list[Layer]  # a KV pool: per layer {name: [blocks, BLOCK, ...]} (moejax.models.kv_pool)
Span = tuple[int | None, ...]  # a packed batch's TreeSpan (head, window): which keys attention reads


@runtime_checkable
class Steps(Protocol):
    def logits(self, params: nnx.State, tokens: jax.Array, /) -> jax.Array:
        """tokens [B, T] -> float32 logits [B, T, vocab] at every position."""
        ...

    def logprobs(self, params: nnx.State, tokens: jax.Array, /, *, k: int
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """tokens [B, T] -> (log-probability of token t+1 at each position t [B, T], the k most likely next tokens
        there: log-probabilities and ids [B, T, k])."""
        ...

    def score(self, params: nnx.State, pool: Pool | None, batch: dict[str, jax.Array], /, *, span: Span
              ) -> tuple[jax.Array, Pool | None]:
        """Packed-tree scoring (moejax.steps.phases.score_begin names the batch's arrays) -> (log-probabilities of
        the target tokens [B, G] float32, the prefix pool with the batch's blocks stored)."""
        ...

    def greedy_score(self, params: nnx.State, pool: Pool | None, batch: dict[str, jax.Array], /, *, span: Span
                     ) -> tuple[tuple[jax.Array, jax.Array], Pool | None]:
        """`score` that also says whether each target token is its position's argmax (lm-eval's is_greedy) ->
        ((log-probabilities [B, G], greedy [B, G]), pool)."""
        ...

    def prefill(self, params: nnx.State, pool: Pool | None, rows: PrefillRows, /, *, cache_len: int
                ) -> tuple[Sequence[Cache], jax.Array, Pool | None]:
        """Static batching's prefill -> (per-row caches of cache_len slots, the first new token per row, pool)."""
        ...

    def decode(self, params: nnx.State, cache: Sequence[Cache], rows: DecodeRows, /, *, steps: int
               ) -> tuple[jax.Array, jax.Array]:
        """Static batching's decode from prefill's caches -> (tokens [B, steps], how many each row made)."""
        ...

    def chunk(self, params: nnx.State, pool: Pool, carry: jax.Array, rows: ChunkRows, /, *, fresh: bool
              ) -> tuple[Pool, jax.Array, jax.Array]:
        """Continuous batching's prompt chunk per row (moejax.steps.paged_phases) -> (pool, carry, next tokens)."""
        ...

    def paged_decode(self, params: nnx.State, pool: Pool, carry: jax.Array, rows: PagedDecodeRows, /, *, steps: int
                     ) -> tuple[Pool, jax.Array, jax.Array]:
        """Continuous batching's decode, up to `steps` tokens per row -> (pool, carry, tokens [B, steps])."""
        ...

    def decode_pool(self, params: nnx.State, num_blocks: int, /) -> Pool:
        """Continuous batching's KV pool of num_blocks blocks, zeroed where these steps keep it (params may be
        abstract: only their shapes are read)."""
        ...

    def logits_hlo(self, params: nnx.State, tokens: jax.ShapeDtypeStruct, /) -> str | None:
        """The compiled `logits` step's HLO text for tokens of this shape (Engine.explain counts its collectives),
        or None where no one program runs the step (the layers run from Python)."""
        ...
