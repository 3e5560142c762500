"""The jit-compiled steps behind Engine: full-sequence logits, packed-tree scoring, prefill and decode.

Each step is a `begin` (inputs -> the first layer's inputs), the decoder layers, and an `end` (last hidden
states -> outputs). A resident model runs all three in one jit (`resident`); an offloaded one runs begin and
end as jits and the layers one by one from Python (moejax.offload.layered), with the same begin and end.
begin(model, *args, **static) -> (layer inputs: dict of run_layers keywords, context for end);
end(model, x, new per-layer caches or keys, context, *args, **static) -> the step's outputs."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moejax import kv_pool
from moejax.models.attention import TreeMask, cache_positions, write_cache
from moejax.models.decoder import MoEModel
from moejax.sampling import sample


def model_of(graphdef, state) -> MoEModel:
    return nnx.merge(graphdef, state)


def resident(begin, end, read_cache=lambda *args, **static: True):
    """One jit-able step (graphdef, kernels, state, *args, **static) from a begin and an end."""
    def step(graphdef, kernels, state, *args, **static):
        model = model_of(graphdef, state)
        inputs, context = begin(model, *args, **static)
        x, new = model.run_layers(**inputs, read_cache=read_cache(*args, **static), kernels=kernels)
        return end(model, x, new, context, *args, **static)
    return step


# -- full-sequence logits ------------------------------------------------------------------------------------
def logits_begin(model, tokens):
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    x, cos, sin = model.embed_inputs(tokens, positions)
    return dict(x=x, positions=positions, cos=cos, sin=sin), None


def logits_end(model, x, new, context, tokens):
    return model.head(x)


# -- log-probabilities of given tokens ------------------------------------------------------------------------
def logprobs_begin(model, tokens, *, k):
    return logits_begin(model, tokens)


def logprobs_end(model, x, new, context, tokens, *, k):
    """-> (log-probability of token t+1 at each position t [B, T] (the last column is meaningless), the k most
    likely next tokens at each position: log-probabilities and ids [B, T, k])."""
    logprobs = jax.nn.log_softmax(model.head(x).astype(jnp.float32), axis=-1)
    following = jnp.concatenate([tokens[:, 1:], tokens[:, -1:]], axis=1)
    chosen = jnp.take_along_axis(logprobs, following[..., None], axis=-1)[..., 0]
    top, ids = jax.lax.top_k(logprobs, k)
    return chosen, top, ids


# -- packed-tree scoring -------------------------------------------------------------------------------------
def score_begin(model, pool, batch, *, span=(0, None)):
    """batch: tokens, positions, q_pre, q_post [B, T] (DFS spans of each token's node); read_idx [B, U] (rows whose
    next-token distribution is read); tgt_u, tgt_tok [B, G] (which read row, which token). Optional prior keys
    from the pool: prior_ids [B, NP] and prior_pos, prior_pre, prior_post [B, NP*BLOCK]; optional blocks to
    store: store_ids [B, NS], store_src [B, NS, BLOCK] (indices into prior + new keys). span (static): the
    rows' TreeSpan (head, window), which keys attention reads (moejax.sched.packing.tree_span)."""
    prior = kv_pool.gather(pool, batch["prior_ids"]) if "prior_ids" in batch else None

    def keys(name):
        new = batch["positions"] if name == "pos" else batch[f"q_{name}"]
        return new if prior is None else jnp.concatenate([batch[f"prior_{name}"], new], axis=1)

    tree = TreeMask(batch["q_pre"], keys("pre"), keys("post"), keys("pos"), *span)
    x, cos, sin = model.embed_inputs(batch["tokens"], batch["positions"])
    return dict(x=x, positions=batch["positions"], cos=cos, sin=sin, tree=tree, prior=prior), prior


def score_end(model, x, new, prior, pool, batch, *, span=(0, None)):
    """-> (log-probabilities of the target tokens [B, G] float32, pool)."""
    return scored(model.head(x, batch["read_idx"]), new, prior, pool, batch)


def scored(logits, new, prior, pool, batch):
    """From the read positions' logits [B, U, V]: (the target tokens' log-probabilities [B, G] float32, the pool
    with the batch's prompt blocks stored)."""
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logprobs, batch["tgt_u"][..., None], axis=1)  # [B, G, V]
    picked = jnp.take_along_axis(picked, batch["tgt_tok"][..., None], axis=2)[..., 0]
    if "store_ids" in batch:
        pool = kv_pool.store(pool, kv_pool.concat_keys(prior, new), batch["store_ids"], batch["store_src"])
    return picked, pool


# -- prefill -------------------------------------------------------------------------------------------------
def prefill_begin(model, pool, tokens, positions, last, temperature, top_p, keys, prior_ids=None, store_ids=None,
                  store_src=None, expand=None, *, cache_len):
    """Right-padded prompt rows. tokens/positions [B, T]: each row's prompt from its first uncached position;
    `last` [B] the index of its last prompt token. prior_ids [B, NP]: pool blocks holding positions
    [0, NP*BLOCK) of each row (a row whose prompt starts later has them all). store_ids/store_src: prompt
    blocks to copy into the pool (src = slots). Cache slot = position. expand [B2]: the prefill row each decode
    row continues (several choices of one prompt share its prefill); temperature, top_p, keys are then [B2]."""
    B = tokens.shape[0]
    cache = model.init_cache(B, cache_len)
    if prior_ids is not None:
        prior = kv_pool.gather(pool, prior_ids)
        slots = cache_positions(prior_ids.shape[1] * kv_pool.BLOCK, B)
        cache = [{name: write_cache(c[name], slots, p[name]) for name in c} for c, p in zip(cache, prior)]
    x, cos, sin = model.embed_inputs(tokens, positions)
    return dict(x=x, positions=positions, cos=cos, sin=sin, cache=cache), None


def prefill_end(model, x, cache, context, pool, tokens, positions, last, temperature, top_p, keys, prior_ids=None,
                store_ids=None, store_src=None, expand=None, *, cache_len):
    """-> (cache, first new token per row, pool); with `expand`, cache and tokens are per decode row."""
    if store_ids is not None:
        pool = kv_pool.store(pool, cache, store_ids, store_src)
    logits = model.head(x, last)
    if expand is not None:
        cache = jax.tree.map(lambda c: c[expand], cache)
        logits = logits[expand]
    step_keys = jax.vmap(lambda k: jax.random.fold_in(k, 0))(keys)
    return cache, sample(logits, temperature, top_p, step_keys), pool


def prefill_reads_cache(pool, tokens, positions, last, temperature, top_p, keys, prior_ids=None, *rest, **static):
    return prior_ids is not None  # else the cache held nothing before this call


# -- decode --------------------------------------------------------------------------------------------------
def decode_start(first, max_new, stops, steps):
    """The decode loop's carry before step 1: (step, out, done, count, last token)."""
    B = first.shape[0]
    out = jnp.zeros((B, steps), jnp.int32).at[:, 0].set(first)
    done = is_stop(first, stops) | (max_new <= 1)
    return jnp.int32(1), out, done, jnp.ones((B,), jnp.int32), first


def decode_begin(model, step, last, lengths):
    positions = (lengths + step - 1)[:, None]
    x, cos, sin = model.embed_inputs(last[:, None], positions)
    return dict(x=x, positions=positions, cos=cos, sin=sin)


def decode_end(model, x, step, out, done, count, last, temperature, top_p, keys, stops, max_new):
    """Sample this step's tokens and update the carry."""
    B = x.shape[0]
    logits = model.head(x, jnp.zeros((B,), jnp.int32))
    step_keys = jax.vmap(lambda k: jax.random.fold_in(k, step))(keys)
    tok = sample(logits, temperature, top_p, step_keys)
    tok = jnp.where(done, last, tok)
    out = out.at[:, step].set(jnp.where(done, 0, tok))
    count = count + (~done).astype(jnp.int32)
    done = done | is_stop(tok, stops) | (step + 1 >= max_new)
    return step + 1, out, done, count, tok


def decode(graphdef, kernels, state, cache, first, lengths, temperature, top_p, keys, stops, max_new, *, steps):
    """Decode until every row has max_new[row] tokens or has emitted one of its stop tokens (stops [B, S], -1
    pads). Returns (tokens, counts)."""
    model = model_of(graphdef, state)
    limit = jnp.max(max_new)

    def cond(carry):
        step, _, _, done, _, _ = carry
        return (step < limit) & ~jnp.all(done)

    def body(carry):
        step, cache, out, done, count, last = carry
        x, cache = model.run_layers(**decode_begin(model, step, last, lengths), cache=cache, kernels=kernels)
        step, out, done, count, last = decode_end(model, x, step, out, done, count, last, temperature, top_p, keys,
                                                  stops, max_new)
        return step, cache, out, done, count, last

    step, out, done, count, last = decode_start(first, max_new, stops, steps)
    _, _, out, _, count, _ = jax.lax.while_loop(cond, body, (step, cache, out, done, count, last))
    return out, count


def is_stop(tok, stops):
    return jnp.any(tok[:, None] == stops, axis=1)


full_logits = resident(logits_begin, logits_end)
token_logprobs = resident(logprobs_begin, logprobs_end)
score = resident(score_begin, score_end)
prefill = resident(prefill_begin, prefill_end, prefill_reads_cache)
