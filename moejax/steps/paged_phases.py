"""The steps of continuous batching (moejax.sched.continuous): every sequence's KV lives in one paged block pool
(per layer {name: [N, BLOCK, ...]}, moejax.models.kv_pool) and each row reads and writes it through its block table.

- chunk: a prompt chunk per row (chunked prefill; a preempted sequence's prompt + tokens so far on resume),
  sampling the next token after each row's last chunk token.
- decode: up to `steps` new tokens per row in one call (a device loop; a row stops at a stop token or its
  budget, and writes nothing after).

Both steps also thread `carry` [S]: each sequence's last sampled token by its scheduler slot (-1: none), so
the scheduler can dispatch a decode step before reading the step that samples its rows' input tokens (a `chain`
row takes its input from carry[slot] on the device; one whose token there is -1 or a stop makes nothing).

Each step takes its rows as one pytree (moejax.steps.rows: ChunkRows, PagedDecodeRows) with their Sampling.
Token i of a sequence is sampled with fold_in(row key, i), as Engine.generate does, so a sequence's tokens do not
depend on which rows share its steps or on being preempted and resumed. Like moejax.steps.phases, each step is a begin,
the layers and an end, so an offloaded model runs the same phases layer by layer (moejax.offload.layered_steps)."""
from __future__ import annotations

from typing import NamedTuple, cast

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.kernels.backends import Kernels
from moejax.models.attention import Positions
from moejax.models.decoder import MoEModel
from moejax.models.kv_pool import Layer, PagedCache, slots_of
from moejax.sampling import StepArray
from moejax.steps.phases import is_stop, model_of
from moejax.steps.rows import ChunkRows, PagedDecodeRows
from moejax.steps.token_loop import token_loop


def _paged(pool: list[Layer], table: StepArray, slots: jax.Array) -> list[PagedCache]:
    table = cast(jax.Array, table)  # the step traces its rows: a jax.Array here
    return [PagedCache(layer, table, slots) for layer in pool]


def _pool_blocks(pool: list[Layer], stacked: bool = False) -> int:
    """Blocks in a pool: every layer's {name: [N, BLOCK, ...]}, or a stacked model's [count, N, BLOCK, ...]."""
    return jax.tree.leaves(pool)[0].shape[1 if stacked else 0]


# -- a prompt chunk per row ----------------------------------------------------------------------------------
def chunk_begin(model: MoEModel, pool: list[Layer], carry: jax.Array, rows: ChunkRows, *, fresh: bool
                ) -> tuple[dict, None]:
    """fresh (static): every row starts at position 0, so attention reads only this call's keys."""
    x, at, slots = chunk_inputs(model, rows, num_blocks=_pool_blocks(pool, model.stacked))
    return dict(x=x, at=at, cache=_paged(pool, rows.table, slots)), None


def chunk_inputs(model: MoEModel, rows: ChunkRows, *, num_blocks: int) -> tuple[jax.Array, Positions, jax.Array]:
    """-> (the chunk's hidden states, Positions, the pool slots [B, T] its tokens write) for a pool of num_blocks."""
    T = rows.tokens.shape[1]
    positions = rows.start[:, None] + jnp.arange(T, dtype=jnp.int32)
    valid = jnp.arange(T, dtype=jnp.int32)[None, :] < rows.n[:, None]
    slots = slots_of(rows.table, positions, valid, num_blocks)
    x, at = model.embed_inputs(rows.tokens, positions)
    return x, at, slots


def chunk_end(model: MoEModel, x: jax.Array, caches: list[PagedCache], context: None, pool: list[Layer],
              carry: jax.Array, rows: ChunkRows, *, fresh: bool) -> tuple[list[Layer], jax.Array, jax.Array]:
    """-> (pool, carry, the token after each row's last real token, sampled as token count[b] of its sequence).
    carry[slot[b]] takes row b's token (slot[b] = S: it does not; a prompt's rows but its last)."""
    carry, tok = chunk_tokens(model, x, carry, rows)
    return [c.pool for c in caches], carry, tok


def chunk_tokens(model: MoEModel, x: jax.Array, carry: jax.Array, rows: ChunkRows) -> tuple[jax.Array, jax.Array]:
    """chunk_end without the pool: -> (carry, the token after each row's last real token)."""
    tok = rows.sampling.next_tokens(model.head(x, jnp.maximum(rows.n - 1, 0)))
    return carry.at[rows.slot].set(tok, mode="drop"), tok


def chunk(graphdef: nnx.GraphDef, kernels: Kernels, state: nnx.State, pool: list[Layer], carry: jax.Array,
          rows: ChunkRows, *, fresh: bool) -> tuple[list[Layer], jax.Array, jax.Array]:
    model = model_of(graphdef, state)
    inputs, context = chunk_begin(model, pool, carry, rows, fresh=fresh)
    x, caches = model.run_layers(**inputs, read_cache=not fresh, kernels=kernels)
    # paged caches in (chunk_begin), paged caches out
    return chunk_end(model, x, cast("list[PagedCache]", caches), context, pool, carry, rows, fresh=fresh)


# -- decode: several tokens per call ----------------------------------------------------------------------------
class PagedDecodeLoop(NamedTuple):
    """The device loop's state besides the pool: i, the loop step; out [B, steps], each row's tokens (-1: not
    made); live [B], whether the row makes more; last [B], its last token (the next step's input)."""
    i: jax.Array
    out: jax.Array
    live: jax.Array
    last: jax.Array


def decode_start(carry: jax.Array, rows: PagedDecodeRows, steps: int) -> PagedDecodeLoop:
    """The loop's state before the first token. A chain row's input is carry[slot] (made by a step the host has not
    read); it is live only if that is a token, not a stop."""
    prev = carry[jnp.minimum(rows.slot, carry.shape[0] - 1)]
    last = jnp.where(rows.chain, prev, rows.last)
    live = (rows.budget > 0) & ~(rows.chain & ((prev < 0) | is_stop(prev, rows.stops)))
    live = cast(jax.Array, live)  # traced rows: a jax.Array here
    return PagedDecodeLoop(jnp.int32(0), jnp.full((rows.budget.shape[0], steps), -1, jnp.int32), live, last)


def decode_finish(carry: jax.Array, slot: StepArray, out: jax.Array) -> jax.Array:
    """carry[slot[b]]: row b's last token (a stop if it ended on one), or -1 where it made none."""
    made = (out >= 0).sum(axis=1)
    last = jnp.take_along_axis(out, jnp.maximum(made - 1, 0)[:, None], axis=1)[:, 0]
    return carry.at[slot].set(jnp.where(made > 0, last, -1), mode="drop")


def token_begin(model: MoEModel, pool: list[Layer], loop: PagedDecodeLoop, rows: PagedDecodeRows) -> dict:
    """Row b's input loop.last at position start[b] + i (written only while the row is live)."""
    x, at, slots = token_inputs(model, loop, rows, num_blocks=_pool_blocks(pool, model.stacked))
    return dict(x=x, at=at, cache=_paged(pool, rows.table, slots))


def token_inputs(model: MoEModel, loop: PagedDecodeLoop, rows: PagedDecodeRows, *, num_blocks: int
                 ) -> tuple[jax.Array, Positions, jax.Array]:
    """-> (the step's hidden states, Positions, the pool slots [B, 1] its tokens write) for a pool of num_blocks."""
    positions = (rows.start + loop.i)[:, None]
    slots = slots_of(rows.table, positions, loop.live[:, None], num_blocks)
    x, at = model.embed_inputs(loop.last[:, None], positions)
    return x, at, slots


def token_end(model: MoEModel, x: jax.Array, caches: list[PagedCache], loop: PagedDecodeLoop, rows: PagedDecodeRows
              ) -> tuple[list[Layer], PagedDecodeLoop]:
    """-> (pool, the loop's next state): this token sampled as token count[b] + i of row b's sequence."""
    return [c.pool for c in caches], next_loop(model, x, loop, rows)


def next_loop(model: MoEModel, x: jax.Array, loop: PagedDecodeLoop, rows: PagedDecodeRows) -> PagedDecodeLoop:
    """token_end without the pool: this token sampled, the loop's next state."""
    i, out, live, last = loop
    tok = rows.sampling.next_tokens(model.head(x, jnp.zeros((x.shape[0],), jnp.int32)), i)
    tok = jnp.where(live, tok, last)
    out = out.at[:, i].set(jnp.where(live, tok, -1))
    live = live & ~is_stop(tok, rows.stops) & (i + 1 < rows.budget)
    return PagedDecodeLoop(i + 1, out, live, tok)


def decode(graphdef: nnx.GraphDef, kernels: Kernels, state: nnx.State, pool: list[Layer], carry: jax.Array,
           rows: PagedDecodeRows, *, steps: int) -> tuple[list[Layer], jax.Array, jax.Array]:
    """Up to min(steps, budget[b]) tokens per row, ending a row after a stop token.
    -> (pool, carry, tokens [B, steps], -1 after a row's last)."""
    model = model_of(graphdef, state)

    def cond(pool_loop: tuple[list[Layer], PagedDecodeLoop]) -> jax.Array:
        _, loop = pool_loop
        return (loop.i < steps) & jnp.any(loop.live)

    def body(pool_loop: tuple[list[Layer], PagedDecodeLoop]) -> tuple[list[Layer], PagedDecodeLoop]:
        pool, loop = pool_loop
        x, caches = model.run_layers(**token_begin(model, pool, loop, rows), read_cache=True, kernels=kernels)
        return token_end(model, x, cast("list[PagedCache]", caches), loop, rows)  # paged caches in, paged out

    pool, loop = token_loop(cond, body, (pool, decode_start(carry, rows, steps)), steps, few=True)
    return pool, decode_finish(carry, rows.slot, loop.out), loop.out
