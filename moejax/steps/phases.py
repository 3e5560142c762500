"""The phases of the Engine's steps (full-sequence logits, packed-tree scoring, prefill and decode) and the whole-model
step each makes.

Each step is a `begin` (inputs -> the first layer's inputs), the decoder layers, and an `end` (last hidden
states -> outputs). A resident model runs all three in one jit (`resident`); an offloaded one runs begin and
end as jits and the layers one by one from Python (moejax.offload.layered_steps), with the same begin and end.
begin(model, *args, **static) -> (layer inputs: dict of run_layers keywords, context for end);
end(model, x, new per-layer caches or keys, context, *args, **static) -> the step's outputs.
Prefill and decode take their rows as one pytree (moejax.steps.rows)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.kernels import invariant
from moejax.kernels.backends import Kernels
from moejax.models import kv_pool
from moejax.models.attention import TreeMask, cache_positions, write_cache
from moejax.models.decoder import MoEModel
from moejax.models.kv_pool import Layer
from moejax.sampling import StepArray
from moejax.steps.rows import DecodeRows, PrefillRows
from moejax.steps.token_loop import token_loop


def model_of(graphdef: nnx.GraphDef, state: nnx.State) -> MoEModel:
    return nnx.merge(graphdef, state)


def zeroed_pool(graphdef: nnx.GraphDef, state: nnx.State, num_blocks: int) -> list[Layer]:
    """A zeroed KV pool of num_blocks blocks of kv_pool.BLOCK tokens (cache layout, per layer) on the default device;
    state may be abstract (only the model's shapes are read)."""
    return jax.tree.map(jnp.asarray, model_of(graphdef, state).init_cache(num_blocks, kv_pool.BLOCK))


def resident(begin: Callable, end: Callable, read_cache: Callable[..., bool] = lambda *args, **static: True
             ) -> Callable:
    """One jit-able step (graphdef, kernels, state, *args, **static) from a begin and an end."""
    def step(graphdef: nnx.GraphDef, kernels: Kernels, state: nnx.State, *args: Any, **static: Any) -> Any:
        with invariant.scope(kernels.invariant):  # traced batch-invariantly when asked (moejax.kernels.invariant)
            model = model_of(graphdef, state)
            inputs, context = begin(model, *args, **static)
            x, new = model.run_layers(**inputs, read_cache=read_cache(*args, **static), kernels=kernels)
            return end(model, x, new, context, *args, **static)
    return step


# -- full-sequence logits ------------------------------------------------------------------------------------
def logits_begin(model: MoEModel, tokens: jax.Array) -> tuple[dict, None]:
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    x, at = model.embed_inputs(tokens, positions)
    return dict(x=x, at=at), None


def logits_end(model: MoEModel, x: jax.Array, new: list, context: None, tokens: jax.Array) -> jax.Array:
    return model.head(x)


# -- log-probabilities of given tokens ------------------------------------------------------------------------
def logprobs_begin(model: MoEModel, tokens: jax.Array, *, k: int) -> tuple[dict, None]:
    return logits_begin(model, tokens)


def logprobs_end(model: MoEModel, x: jax.Array, new: list, context: None, tokens: jax.Array, *, k: int
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """-> (log-probability of token t+1 at each position t [B, T] (the last column is meaningless), the k most
    likely next tokens at each position: log-probabilities and ids [B, T, k])."""
    logprobs = invariant.log_softmax(model.head(x).astype(jnp.float32))
    following = jnp.concatenate([tokens[:, 1:], tokens[:, -1:]], axis=1)
    chosen = jnp.take_along_axis(logprobs, following[..., None], axis=-1)[..., 0]
    top, ids = jax.lax.top_k(logprobs, k)
    return chosen, top, ids


# -- packed-tree scoring -------------------------------------------------------------------------------------
def score_begin(model: MoEModel, pool: list[Layer], batch: dict, *, span: tuple = (0, None)
                ) -> tuple[dict, list[Layer] | None]:
    """batch: tokens, positions, q_pre, q_post [B, T] (DFS spans of each token's node); read_idx [B, U] (rows whose
    next-token distribution is read); tgt_u, tgt_tok [B, G] (which read row, which token). Optional prior keys
    from the pool: prior_ids [B, NP] and prior_pos, prior_pre, prior_post [B, NP*BLOCK]; optional blocks to
    store: store_ids [B, NS], store_src [B, NS, BLOCK] (indices into prior + new keys). span (static): the
    rows' TreeSpan (head, window), which keys attention reads (moejax.sched.packing.tree_span)."""
    prior = model.map_layers(lambda layer: kv_pool.gather_layer(layer, batch["prior_ids"]), pool) \
        if "prior_ids" in batch else None

    def keys(name: str) -> jax.Array:
        new = batch["positions"] if name == "pos" else batch[f"q_{name}"]
        return new if prior is None else jnp.concatenate([batch[f"prior_{name}"], new], axis=1)

    tree = TreeMask(batch["q_pre"], keys("pre"), keys("post"), keys("pos"), *span)
    x, at = model.embed_inputs(batch["tokens"], batch["positions"], tree)
    return dict(x=x, at=at, prior=prior), prior


def score_end(model: MoEModel, x: jax.Array, new: list[Layer], prior: list[Layer] | None, pool: list[Layer],
              batch: dict, *, span: tuple = (0, None)) -> tuple[jax.Array, list[Layer]]:
    """-> (log-probabilities of the target tokens [B, G] float32, pool)."""
    return scored(model, model.head(x, batch["read_idx"]), new, prior, pool, batch)


def greedy_score_end(model: MoEModel, x: jax.Array, new: list[Layer], prior: list[Layer] | None, pool: list[Layer],
                     batch: dict, *, span: tuple = (0, None)) -> tuple[tuple[jax.Array, jax.Array], list[Layer]]:
    """score_end that also says whether each target is its read position's argmax, as lm-eval's loglikelihood
    answers (log-probability, is_greedy) -> ((log-probabilities [B, G] float32, greedy [B, G]), pool)."""
    logits = model.head(x, batch["read_idx"])  # [B, U, V] float32
    picked, pool = scored(model, logits, new, prior, pool, batch)
    top = jnp.argmax(logits, axis=-1)  # [B, U]: the first maximum, as torch's argmax
    greedy = jnp.take_along_axis(top, batch["tgt_u"], axis=1) == batch["tgt_tok"]
    return (picked, greedy), pool


def scored(model: MoEModel, logits: jax.Array, new: list[Layer], prior: list[Layer] | None, pool: list[Layer],
           batch: dict) -> tuple[jax.Array, list[Layer]]:
    """From the read positions' logits [B, U, V]: (the target tokens' log-probabilities [B, G] float32, the pool
    with the batch's prompt blocks stored)."""
    logprobs = invariant.log_softmax(logits)
    picked = jnp.take_along_axis(logprobs, batch["tgt_u"][..., None], axis=1)  # [B, G, V]
    picked = jnp.take_along_axis(picked, batch["tgt_tok"][..., None], axis=2)[..., 0]
    if "store_ids" in batch:
        keys = new if prior is None else model.map_layers(kv_pool.concat_layer, prior, new)
        pool = model.map_layers(lambda p, k: kv_pool.store_layer(p, k, batch["store_ids"], batch["store_src"]),
                                pool, keys)
    return picked, pool


# -- prefill -------------------------------------------------------------------------------------------------
def prefill_begin(model: MoEModel, pool: list[Layer], rows: PrefillRows, *, cache_len: int) -> tuple[dict, None]:
    """Cache slot = position; rows with prior_ids first copy those pool blocks into their cache."""
    B = rows.tokens.shape[0]
    cache = model.init_cache(B, cache_len)
    if rows.prior_ids is not None:
        ids = rows.prior_ids
        slots = cache_positions(ids.shape[1] * kv_pool.BLOCK, B)
        cache = model.map_layers(
            lambda c, p: {name: write_cache(c[name], slots, a) for name, a in kv_pool.gather_layer(p, ids).items()},
            cache, pool)
    x, at = model.embed_inputs(rows.tokens, rows.positions)
    return dict(x=x, at=at, cache=cache), None


def prefill_end(model: MoEModel, x: jax.Array, cache: list, context: None, pool: list[Layer], rows: PrefillRows, *,
                cache_len: int) -> tuple[list, jax.Array, list[Layer]]:
    """-> (cache, first new token per row, pool); with `expand`, cache and tokens are per decode row."""
    if rows.store_ids is not None:
        assert rows.store_src is not None  # given with store_ids
        store_ids, store_src = rows.store_ids, rows.store_src
        pool = model.map_layers(lambda p, c: kv_pool.store_layer(p, c, store_ids, store_src), pool, cache)
    logits = model.head(x, rows.last)
    if rows.expand is not None:
        expand = rows.expand
        cache = model.map_layers(lambda c: jax.tree.map(lambda a: a[expand], c), cache)
        logits = logits[rows.expand]
    return cache, rows.sampling.next_tokens(logits), pool


def prefill_reads_cache(pool: list[Layer] | None, rows: PrefillRows, **static: Any) -> bool:
    return rows.prior_ids is not None  # else the cache held nothing before this call


# -- decode --------------------------------------------------------------------------------------------------
class DecodeLoop(NamedTuple):
    """The decode loop's state: step, the index of the tokens it makes next (the prefill's is 0); out [B, steps],
    each row's tokens (0 after its last); done [B]; counts [B], the tokens each row made; last [B], its last token."""
    step: jax.Array
    out: jax.Array
    done: jax.Array
    counts: jax.Array
    last: StepArray  # rows.first before step 1


def decode_start(rows: DecodeRows, steps: int) -> DecodeLoop:
    """The decode loop's state before step 1."""
    B = rows.first.shape[0]
    out = jnp.zeros((B, steps), jnp.int32).at[:, 0].set(rows.first)
    done = is_stop(rows.first, rows.stops) | (rows.max_new <= 1)
    return DecodeLoop(jnp.int32(1), out, done, jnp.ones((B,), jnp.int32), rows.first)


def decode_begin(model: MoEModel, loop: DecodeLoop, rows: DecodeRows) -> dict:
    positions = (rows.lengths + loop.step - 1)[:, None]
    x, at = model.embed_inputs(loop.last[:, None], positions)
    return dict(x=x, at=at)


def decode_end(model: MoEModel, x: jax.Array, loop: DecodeLoop, rows: DecodeRows) -> DecodeLoop:
    """Sample this step's tokens and update the loop's state."""
    step, out, done, count, last = loop
    B = x.shape[0]
    tok = rows.sampling.next_tokens(model.head(x, jnp.zeros((B,), jnp.int32)), step)
    tok = jnp.where(done, last, tok)
    out = out.at[:, step].set(jnp.where(done, 0, tok))
    count = count + (~done).astype(jnp.int32)
    done = done | is_stop(tok, rows.stops) | (step + 1 >= rows.max_new)
    return DecodeLoop(step + 1, out, done, count, tok)


def decode(graphdef: nnx.GraphDef, kernels: Kernels, state: nnx.State, cache: list, rows: DecodeRows, *, steps: int
           ) -> tuple[jax.Array, jax.Array]:
    """Decode until every row has max_new[row] tokens or has emitted one of its stop tokens. Returns (tokens,
    counts)."""
    model = model_of(graphdef, state)
    limit = jnp.max(rows.max_new)

    def cond(carry: tuple[list, DecodeLoop]) -> jax.Array:
        _, loop = carry
        return (loop.step < limit) & ~jnp.all(loop.done)

    def body(carry: tuple[list, DecodeLoop]) -> tuple[list, DecodeLoop]:
        cache, loop = carry
        x, cache = model.run_layers(**decode_begin(model, loop, rows), cache=cache, kernels=kernels)
        return cache, decode_end(model, x, loop, rows)

    _, loop = token_loop(cond, body, (cache, decode_start(rows, steps)), steps - 1, few=False)
    return loop.out, loop.counts


def is_stop(tok: StepArray, stops: StepArray) -> jax.Array:
    return jnp.any(tok[:, None] == stops, axis=1)


full_logits = resident(logits_begin, logits_end)
token_logprobs = resident(logprobs_begin, logprobs_end)
score = resident(score_begin, score_end)
greedy_score = resident(score_begin, greedy_score_end)
prefill = resident(prefill_begin, prefill_end, prefill_reads_cache)
