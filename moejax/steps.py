"""The jit-compiled steps behind Engine: full-sequence logits, packed-tree scoring, prefill and decode.
Pure functions of (graphdef, kernels, params, arrays); the Engine binds and compiles them."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moejax import kv_pool
from moejax.models.attention import TreeMask, cache_positions, write_cache
from moejax.models.decoder import MoEModel
from moejax.sampling import sample


def _model(graphdef, state) -> MoEModel:
    return nnx.merge(graphdef, state)


def full_logits(graphdef, kernels, state, tokens):
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    logits, _ = _model(graphdef, state)(tokens, positions, kernels=kernels)
    return logits


def score(graphdef, kernels, state, pool, batch):
    """Log-probabilities of target tokens in rows of packed token trees.

    batch: tokens, positions, q_pre, q_post [B, T] (DFS spans of each token's node); read_idx [B, U] (rows whose
    next-token distribution is read); tgt_u, tgt_tok [B, G] (which read row, which token). Optional prior keys
    from the pool: prior_ids [B, NP] and prior_pos, prior_pre, prior_post [B, NP*BLOCK]; optional blocks to
    store: store_ids [B, NS], store_src [B, NS, BLOCK] (indices into prior + new keys).
    Returns (logprobs [B, G] float32, pool)."""
    model = _model(graphdef, state)
    prior = kv_pool.gather(pool, batch["prior_ids"]) if "prior_ids" in batch else None

    def keys(name):
        new = batch["positions"] if name == "pos" else batch[f"q_{name}"]
        return new if prior is None else jnp.concatenate([batch[f"prior_{name}"], new], axis=1)

    tree = TreeMask(batch["q_pre"], keys("pre"), keys("post"), keys("pos"))
    logits, new = model(batch["tokens"], batch["positions"], kernels=kernels, gather_idx=batch["read_idx"], tree=tree,
                        prior=prior)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logprobs, batch["tgt_u"][..., None], axis=1)  # [B, G, V]
    picked = jnp.take_along_axis(picked, batch["tgt_tok"][..., None], axis=2)[..., 0]
    if "store_ids" in batch:
        pool = kv_pool.store(pool, kv_pool.concat_keys(prior, new), batch["store_ids"], batch["store_src"])
    return picked, pool


def prefill(graphdef, kernels, state, pool, tokens, positions, last, temperature, top_p, keys, prior_ids=None,
            store_ids=None, store_src=None, *, cache_len):
    """Right-padded prompt rows -> (cache, first new token per row, pool). Cache slot = position.

    tokens/positions [B, T]: each row's prompt from its first uncached position; `last` [B] the index of its
    last prompt token. prior_ids [B, NP]: pool blocks holding positions [0, NP*BLOCK) of each row (a row whose
    prompt starts later has them all). store_ids/store_src: prompt blocks to copy into the pool (src = slots)."""
    model = _model(graphdef, state)
    B = tokens.shape[0]
    cache = model.init_cache(B, cache_len)
    if prior_ids is not None:
        prior = kv_pool.gather(pool, prior_ids)
        slots = cache_positions(prior_ids.shape[1] * kv_pool.BLOCK, B)
        cache = [{name: write_cache(c[name], slots, p[name]) for name in c} for c, p in zip(cache, prior)]
    logits, cache = model(tokens, positions, cache, read_cache=prior_ids is not None, kernels=kernels, gather_idx=last)
    if store_ids is not None:
        pool = kv_pool.store(pool, cache, store_ids, store_src)
    step_keys = jax.vmap(lambda k: jax.random.fold_in(k, 0))(keys)
    return cache, sample(logits, temperature, top_p, step_keys), pool


def decode(graphdef, kernels, state, cache, first, lengths, temperature, top_p, keys, stops, max_new, *, steps):
    """Decode until every row has max_new[row] tokens or has emitted one of its stop tokens (stops [B, S], -1
    pads). Returns (tokens, counts)."""
    model = _model(graphdef, state)
    B = first.shape[0]
    out = jnp.zeros((B, steps), jnp.int32).at[:, 0].set(first)
    done = _is_stop(first, stops) | (max_new <= 1)
    count = jnp.ones((B,), jnp.int32)
    limit = jnp.max(max_new)

    def cond(carry):
        step, _, _, done, _, _ = carry
        return (step < limit) & ~jnp.all(done)

    def body(carry):
        step, cache, out, done, count, last = carry
        positions = (lengths + step - 1)[:, None]
        logits, cache = model(last[:, None], positions, cache, kernels=kernels, gather_idx=jnp.zeros((B,), jnp.int32))
        step_keys = jax.vmap(lambda k: jax.random.fold_in(k, step))(keys)
        tok = sample(logits, temperature, top_p, step_keys)
        tok = jnp.where(done, last, tok)
        out = out.at[:, step].set(jnp.where(done, 0, tok))
        count = count + (~done).astype(jnp.int32)
        done = done | _is_stop(tok, stops) | (step + 1 >= max_new)
        return step + 1, cache, out, done, count, tok

    _, _, out, _, count, _ = jax.lax.while_loop(cond, body, (jnp.int32(1), cache, out, done, count, first))
    return out, count


def _is_stop(tok, stops):
    return jnp.any(tok[:, None] == stops, axis=1)
