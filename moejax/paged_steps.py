"""The steps of continuous batching (moejax.sched.continuous): every sequence's KV lives in one paged block pool
(per layer {name: [N, BLOCK, ...]}, moejax.kv_pool) and each row reads and writes it through its block table.

- chunk: a prompt chunk per row (chunked prefill; a preempted sequence's prompt + tokens so far on resume),
  sampling the next token after each row's last chunk token.
- decode: up to `steps` new tokens per row in one call (a device loop; a row stops at a stop token or its
  budget, and writes nothing after).

Both steps also thread `carry` [S]: each sequence's last sampled token by its scheduler slot (-1: none), so
the scheduler can dispatch a decode step before reading the step that samples its rows' input tokens (a `chain`
row takes its input from carry[slot] on the device; one whose token there is -1 or a stop makes nothing).

Token i of a sequence is sampled with fold_in(row key, i), as Engine.generate does, so a sequence's tokens do not
depend on which rows share its steps or on being preempted and resumed. Like moejax.steps, each step is a begin,
the layers and an end, so an offloaded model runs the same phases layer by layer (moejax.offload.layered)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.kv_pool import PagedCache, slots_of
from moejax.sampling import sample
from moejax.steps import is_stop, model_of


def _paged(pool, table, slots):
    return [PagedCache(layer, table, slots) for layer in pool]


def _pool_blocks(pool) -> int:
    return jax.tree.leaves(pool)[0].shape[0]


def _fold(keys, index):
    """Each row's key folded with its token index; keys typed, or raw key data (the scheduler sends raw data: it
    crosses to the device with the other host inputs)."""
    if not jax.dtypes.issubdtype(keys.dtype, jax.dtypes.prng_key):
        keys = jax.random.wrap_key_data(keys)
    return jax.vmap(jax.random.fold_in)(keys, index.astype(jnp.uint32))


# -- a prompt chunk per row ----------------------------------------------------------------------------------
def chunk_begin(model, pool, carry, slot, tokens, start, n, table, temperature, top_p, keys, count, *, fresh):
    """tokens [B, T]: row b's tokens at positions start[b].. (its first n[b] are real; n = 0: an idle row).
    fresh (static): every row starts at position 0, so attention reads only this call's keys."""
    T = tokens.shape[1]
    positions = start[:, None] + jnp.arange(T, dtype=jnp.int32)
    valid = jnp.arange(T, dtype=jnp.int32)[None, :] < n[:, None]
    slots = slots_of(table, positions, valid, _pool_blocks(pool))
    x, cos, sin = model.embed_inputs(tokens, positions)
    return dict(x=x, positions=positions, cos=cos, sin=sin, cache=_paged(pool, table, slots)), None


def chunk_end(model, x, caches, context, pool, carry, slot, tokens, start, n, table, temperature, top_p, keys,
              count, *, fresh):
    """-> (pool, carry, the token after each row's last real token, sampled as token count[b] of its sequence).
    carry[slot[b]] takes row b's token (slot[b] = S: it does not; a prompt's rows but its last)."""
    logits = model.head(x, jnp.maximum(n - 1, 0))
    tok = sample(logits, temperature, top_p, _fold(keys, count))
    return [c.pool for c in caches], carry.at[slot].set(tok, mode="drop"), tok


def chunk(graphdef, kernels, state, pool, carry, slot, tokens, start, n, table, temperature, top_p, keys, count, *,
          fresh):
    model = model_of(graphdef, state)
    args = (pool, carry, slot, tokens, start, n, table, temperature, top_p, keys, count)
    inputs, context = chunk_begin(model, *args, fresh=fresh)
    x, caches = model.run_layers(**inputs, read_cache=not fresh, kernels=kernels)
    return chunk_end(model, x, caches, context, *args, fresh=fresh)


# -- decode: several tokens per call ----------------------------------------------------------------------------
def decode_start(carry, slot, chain, last, budget, stops, steps):
    """The loop's state before the first token: (i, out [B, steps] (-1: not made), live rows, last). A chain row's
    input is carry[slot] (made by a step the host has not read); it is live only if that is a token, not a stop."""
    prev = carry[jnp.minimum(slot, carry.shape[0] - 1)]
    last = jnp.where(chain, prev, last)
    live = (budget > 0) & ~(chain & ((prev < 0) | is_stop(prev, stops)))
    return jnp.int32(0), jnp.full((budget.shape[0], steps), -1, jnp.int32), live, last


def decode_finish(carry, slot, out):
    """carry[slot[b]]: row b's last token (a stop if it ended on one), or -1 where it made none."""
    made = (out >= 0).sum(axis=1)
    last = jnp.take_along_axis(out, jnp.maximum(made - 1, 0)[:, None], axis=1)[:, 0]
    return carry.at[slot].set(jnp.where(made > 0, last, -1), mode="drop")


def token_begin(model, pool, i, last, live, start, table):
    """Row b's input `last` at position start[b] + i (written only while the row is live)."""
    positions = (start + i)[:, None]
    slots = slots_of(table, positions, live[:, None], _pool_blocks(pool))
    x, cos, sin = model.embed_inputs(last[:, None], positions)
    return dict(x=x, positions=positions, cos=cos, sin=sin, cache=_paged(pool, table, slots))


def token_end(model, x, caches, i, out, live, last, budget, temperature, top_p, keys, count, stops):
    """-> (pool, i + 1, out, live, last): this token sampled as token count[b] + i of row b's sequence."""
    tok = sample(model.head(x, jnp.zeros((x.shape[0],), jnp.int32)), temperature, top_p, _fold(keys, count + i))
    tok = jnp.where(live, tok, last)
    out = out.at[:, i].set(jnp.where(live, tok, -1))
    live = live & ~is_stop(tok, stops) & (i + 1 < budget)
    return [c.pool for c in caches], i + 1, out, live, tok


def decode(graphdef, kernels, state, pool, carry, slot, chain, last, start, budget, table, temperature, top_p, keys,
           count, stops, *, steps):
    """Up to min(steps, budget[b]) tokens per row, ending a row after a stop token (stops [B, S], -1 pads).
    -> (pool, carry, tokens [B, steps], -1 after a row's last)."""
    model = model_of(graphdef, state)

    def cond(loop):
        _, i, _, live, _ = loop
        return (i < steps) & jnp.any(live)

    def body(loop):
        pool, i, out, live, last = loop
        inputs = token_begin(model, pool, i, last, live, start, table)
        x, caches = model.run_layers(**inputs, read_cache=True, kernels=kernels)
        return token_end(model, x, caches, i, out, live, last, budget, temperature, top_p, keys, count, stops)

    i, out, live, last = decode_start(carry, slot, chain, last, budget, stops, steps)
    pool, _, out, _, _ = jax.lax.while_loop(cond, body, (pool, i, out, live, last))
    return pool, decode_finish(carry, slot, out), out
