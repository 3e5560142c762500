"""Engine: a loaded model with jit-compiled full-sequence, prefill and decode steps."""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.buckets import bucket
from moejax.config import ModelConfig
from moejax.models.decoder import MoEModel
from moejax.sampling import sample

MIN_SEQ_BUCKET = 16


class Engine:
    """Serve one model. Weights are created lazily: a full-shape preset costs nothing until it runs."""

    def __init__(self, config: ModelConfig, graphdef, abstract_state, materialize: Callable[[], nnx.State],
                 tokenizer=None, *, dtype=jnp.float32, expert_impl: str = "sorted", name: str = ""):
        self.config = config
        self.tokenizer = tokenizer
        self.dtype = jnp.dtype(dtype)
        self.expert_impl = expert_impl
        self.name = name
        self._graphdef = graphdef
        self.abstract_params = abstract_state
        self._materialize = materialize
        self._state = None
        self._logits_fn = jax.jit(functools.partial(_full_logits, graphdef, expert_impl))
        self._prefill_fn = jax.jit(functools.partial(_prefill, graphdef, expert_impl), static_argnames=("cache_len",))
        self._decode_fn = jax.jit(functools.partial(_decode, graphdef, expert_impl), static_argnames=("steps",))

    # -- weights ---------------------------------------------------------------------------------
    @property
    def params(self) -> nnx.State:
        if self._state is None:
            self._state = self._materialize()
        return self._state

    def param_bytes(self) -> int:
        """Bytes of all weights (from abstract shapes; allocates nothing)."""
        return sum(int(np.prod(v.shape)) * jnp.dtype(v.dtype).itemsize
                   for v in jax.tree.leaves(self.abstract_params))

    # -- public API --------------------------------------------------------------------------------
    def logits(self, token_ids) -> np.ndarray:
        """token_ids int [B, T] -> float32 logits [B, T, vocab] at every position."""
        ids = np.asarray(token_ids)
        if ids.ndim != 2 or ids.shape[1] == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"token_ids must be a non-empty int array of shape (B, T); got {ids.dtype} {ids.shape}")
        self._check_ids(ids.reshape(-1), "token_ids")
        B, T = ids.shape
        if T > self.config.max_position_embeddings:
            raise ValueError(f"token_ids: {T} tokens exceed the model's context of "
                             f"{self.config.max_position_embeddings}")
        padded = np.zeros((bucket(B), bucket(T, MIN_SEQ_BUCKET)), np.int32)
        padded[:B, :T] = ids
        out = self._logits_fn(self.params, jnp.asarray(padded))
        return np.asarray(out[:B, :T])

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0, stop_token_ids: Sequence[int] | None = None) -> list[list[int]]:
        """New tokens for each prompt (greedy when temperature is 0). A sequence ends after
        `max_new_tokens` or after emitting one of `stop_token_ids` (kept as its last token)."""
        if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0; got {max_new_tokens!r}")
        if temperature < 0 or not 0 < top_p <= 1:
            raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1; got {temperature}, {top_p}")
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
        B = bucket(n)
        lengths = np.ones((B,), np.int32)
        lengths[:n] = [len(p) for p in prompts]
        T = bucket(int(lengths.max()), MIN_SEQ_BUCKET)
        tokens = np.zeros((B, T), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = p
        steps = bucket(max_new_tokens, MIN_SEQ_BUCKET)
        cache_len = T + steps
        stops = np.full((bucket(len(stop_token_ids or ()), 4),), -1, np.int32)
        stops[: len(stop_token_ids or ())] = list(stop_token_ids or ())
        rows = jnp.arange(B, dtype=jnp.uint32)
        keys = jax.vmap(lambda r: jax.random.fold_in(jax.random.key(seed), r))(rows)
        temp = jnp.full((B,), temperature, jnp.float32)
        topp = jnp.full((B,), top_p, jnp.float32)
        cache, first = self._prefill_fn(self.params, jnp.asarray(tokens), jnp.asarray(lengths), temp, topp, keys,
                                        cache_len=cache_len)
        out, count = self._decode_fn(self.params, cache, first, jnp.asarray(lengths), temp, topp, keys,
                                     jnp.asarray(stops), jnp.int32(max_new_tokens), steps=steps)
        out, count = np.asarray(out), np.asarray(count)
        return [out[i, : count[i]].tolist() for i in range(n)]

    def _check_ids(self, ids: np.ndarray, where: str):
        if ids.size and (ids.min() < 0 or ids.max() >= self.config.vocab_size):
            bad = ids[(ids < 0) | (ids >= self.config.vocab_size)][0]
            raise ValueError(f"{where}: token id {int(bad)} is outside the vocabulary [0, {self.config.vocab_size})")


def _model(graphdef, state) -> MoEModel:
    return nnx.merge(graphdef, state)


def _full_logits(graphdef, impl, state, tokens):
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    logits, _ = _model(graphdef, state)(tokens, positions, impl=impl)
    return logits


def _prefill(graphdef, impl, state, tokens, lengths, temperature, top_p, keys, *, cache_len):
    """Right-padded prompts -> (cache, first new token per row). Cache slot = position."""
    model = _model(graphdef, state)
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    cache = model.init_cache(B, cache_len)
    logits, cache = model(tokens, positions, cache, read_cache=False, impl=impl, gather_idx=lengths - 1)
    step_keys = jax.vmap(lambda k: jax.random.fold_in(k, 0))(keys)
    return cache, sample(logits, temperature, top_p, step_keys)


def _decode(graphdef, impl, state, cache, first, lengths, temperature, top_p, keys, stops, max_new, *, steps):
    """Decode until every row has max_new tokens or has emitted a stop token. Returns (tokens, counts)."""
    model = _model(graphdef, state)
    B = first.shape[0]
    out = jnp.zeros((B, steps), jnp.int32).at[:, 0].set(first)
    done = jnp.isin(first, stops) | (max_new <= 1)
    count = jnp.ones((B,), jnp.int32)

    def cond(carry):
        step, _, _, done, _, _ = carry
        return (step < max_new) & ~jnp.all(done)

    def body(carry):
        step, cache, out, done, count, last = carry
        positions = (lengths + step - 1)[:, None]
        logits, cache = model(last[:, None], positions, cache, impl=impl, gather_idx=jnp.zeros((B,), jnp.int32))
        step_keys = jax.vmap(lambda k: jax.random.fold_in(k, step))(keys)
        tok = sample(logits, temperature, top_p, step_keys)
        tok = jnp.where(done, last, tok)
        out = out.at[:, step].set(jnp.where(done, 0, tok))
        count = count + (~done).astype(jnp.int32)
        done = done | jnp.isin(tok, stops) | (step + 1 >= max_new)
        return step + 1, cache, out, done, count, tok

    _, _, out, _, count, _ = jax.lax.while_loop(cond, body, (jnp.int32(1), cache, out, done, count, first))
    return out, count
