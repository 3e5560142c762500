"""Next-token choice: greedy (temperature 0) or temperature + nucleus (top-p) sampling, per row."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from moejax.kernels import invariant_rows

# A step input's array: on the device, or host numpy that the jitted call copies over with the rest of its pytree
StepArray = jax.Array | np.ndarray


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Sampling:
    """How each row of a step picks its tokens (a pytree: the steps pass it on whole, so a new setting touches
    this class, `sample` and the code that builds it). temperature [B] (0: greedy), top_p [B]; keys [B]: PRNG keys,
    typed or raw key data (the scheduler sends raw data: it crosses to the device with the other host inputs);
    count [B]: the index in its sequence of the row's next token. Token i of a sequence is sampled with
    fold_in(row key, i), so its tokens do not depend on which rows share its steps."""
    temperature: StepArray
    top_p: StepArray
    keys: StepArray
    count: StepArray

    def next_tokens(self, logits: jax.Array, ahead: int | jax.Array = 0) -> jax.Array:
        """logits [B, V] float32 -> each row's token count[b] + ahead, int32 [B]."""
        return sample(logits, self.temperature, self.top_p, _fold(self.keys, self.count + ahead))


def _fold(keys: StepArray, index: StepArray) -> jax.Array:
    """Each row's key folded with its token index; keys typed, or raw key data."""
    if not jax.dtypes.issubdtype(keys.dtype, jax.dtypes.prng_key):
        keys = jax.random.wrap_key_data(keys)  # type: ignore[arg-type]  # numpy key data works; jax types it Array
    return jax.vmap(jax.random.fold_in)(keys, index.astype(jnp.uint32))


def sample(logits: jax.Array, temperature: StepArray, top_p: StepArray, keys: jax.Array) -> jax.Array:
    """logits [B, V] float32; temperature, top_p [B]; keys [B] PRNG keys -> token ids [B] int32."""
    if invariant_rows.active():  # per fixed row tile: a row's softmax and cumulative sum whatever the batch
        data = jax.random.key_data(keys)
        return invariant_rows.by_row_tiles(
            lambda lg, t, p, k: _sample(lg, t, p, jax.random.wrap_key_data(k, impl=jax.random.key_impl(keys))),
            logits, jnp.asarray(temperature), jnp.asarray(top_p), data)
    return _sample(logits, temperature, top_p, keys)


def _sample(logits: jax.Array, temperature: StepArray, top_p: StepArray, keys: jax.Array) -> jax.Array:
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    # Sorting the vocabulary is most of a small decode step on CPU (30 ms of ~175 for 32 rows of 4096 here):
    # only a batch with a sampling row pays it.
    return jax.lax.cond(jnp.any(temperature > 0), _nucleus, lambda *a: greedy, logits, temperature, top_p, keys,
                        greedy)


def _nucleus(logits: jax.Array, temperature: StepArray, top_p: StepArray, keys: jax.Array, greedy: jax.Array
             ) -> jax.Array:
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly ahead of each candidate
    keep = before < top_p[:, None]
    keep = keep.at[:, 0].set(True)
    masked = jnp.where(keep, sorted_logits, -jnp.inf)
    choice = jax.vmap(jax.random.categorical)(keys, masked)
    sampled = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy)
