"""Next-token choice, per row: greedy (temperature 0), or temperature, then the top_k, top_p (nucleus) and min_p
filters in that order (as vLLM, SGLang and Hugging Face transformers apply them), then a draw.

`SamplingParams` is one sequence's settings on the host, from request parsing (or `Engine.generate`) to the step;
`Sampling.of` maps a batch's onto the per-row arrays the jitted steps read, so a new value compiles nothing. A new
setting is a field and its rule here, its array in `Sampling` and its use in `_filter`; the request parser takes its
fields and rules from `SamplingParams`."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from moejax import row_tiles

# A step input's array: on the device, or host numpy that the jitted call copies over with the rest of its pytree
StepArray = jax.Array | np.ndarray

_SEED_RANGE = (-2**63, 2**63)  # what jax.random.key accepts


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one sequence's tokens are drawn. temperature 0: greedy (the filters then change nothing); top_k: keep the
    k most likely tokens (0 or -1: all); top_p: the smallest set whose probability reaches top_p; min_p: the tokens
    at least min_p times as likely as the most likely one (0: all); seed: its PRNG seed (None: the caller's
    default). Values out of range raise ValueError naming the field (`RULES`)."""
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        for name, (kind, rule, holds) in RULES.items():
            value = getattr(self, name)
            if value is None and name == "seed":
                continue
            if not _of_kind(value, kind) or not holds(value):
                raise ValueError(f"{name}: must be {rule}; got {value!r}")


def _of_kind(value: object, kind: type) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):  # True is not 1
        return False
    if kind is int:
        return isinstance(value, int)
    try:
        return math.isfinite(value)
    except OverflowError:  # an int past float's range
        return False


# field -> (its JSON type, the rule as a request's error names it, the check): the request parser
# (moejax.requests.parse) reads its sampling fields from here
RULES: dict[str, tuple[type, str, Callable[[float], bool]]] = {
    "temperature": (float, ">= 0", lambda v: v >= 0),
    "top_p": (float, "in (0, 1]", lambda v: 0 < v <= 1),
    "top_k": (int, "an int >= 1, or 0 or -1 (all tokens)", lambda v: v >= -1),
    "min_p": (float, "in [0, 1]", lambda v: 0 <= v <= 1),
    "seed": (int, "an int in [-2**63, 2**63)", lambda v: _SEED_RANGE[0] <= v < _SEED_RANGE[1]),
}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Sampling:
    """How each row of a step picks its tokens (a pytree: the steps pass it on whole). temperature, top_p, top_k,
    min_p [B]: the rows' SamplingParams (`of`); keys [B]: PRNG keys, typed or raw key data (the scheduler sends raw
    data: it crosses to the device with the other host inputs); count [B]: the index in its sequence of the row's
    next token. Token i of a sequence is sampled with fold_in(row key, i), so its tokens do not depend on which rows
    share its steps."""
    temperature: StepArray
    top_p: StepArray
    top_k: StepArray
    min_p: StepArray
    keys: StepArray
    count: StepArray

    @classmethod
    def of(cls, params: Sequence[SamplingParams], keys: StepArray, count: StepArray, rows: int | None = None
           ) -> Sampling:
        """Host arrays of `rows` rows (default len(params)): params' values, then padding rows of SamplingParams()'s
        (greedy). keys and count are the rows' already."""
        every = [*params, *[_DEFAULT] * ((len(params) if rows is None else rows) - len(params))]
        arrays = {name: np.array([_row_value(p, name) for p in every], dtype) for name, dtype in _ROWS.items()}
        return cls(keys=keys, count=count, **arrays)

    def next_tokens(self, logits: jax.Array, ahead: int | jax.Array = 0) -> jax.Array:
        """logits [B, V] float32 -> each row's token count[b] + ahead, int32 [B]."""
        return sample(logits, self.temperature, self.top_p, _fold(self.keys, self.count + ahead), self.top_k,
                      self.min_p)


_DEFAULT = SamplingParams()
# Sampling's fields that are SamplingParams', with their dtype on the device (an int field's is int32)
_ROWS = {f.name: np.int32 if isinstance(getattr(_DEFAULT, f.name), int) else np.float32
         for f in dataclasses.fields(Sampling) if hasattr(_DEFAULT, f.name)}


def _row_value(params: SamplingParams, name: str) -> float:
    value = getattr(params, name)
    if name == "top_k":  # int32 on the device: a k beyond the vocabulary keeps all of it, as 0 does
        return value if 0 < value < 2**31 else 0
    return value


def _fold(keys: StepArray, index: StepArray) -> jax.Array:
    """Each row's key folded with its token index; keys typed, or raw key data."""
    if not jax.dtypes.issubdtype(keys.dtype, jax.dtypes.prng_key):
        keys = jax.random.wrap_key_data(keys)  # type: ignore[arg-type]  # numpy key data works; jax types it Array
    return jax.vmap(jax.random.fold_in)(keys, index.astype(jnp.uint32))


def sample(logits: jax.Array, temperature: StepArray, top_p: StepArray, keys: jax.Array,
           top_k: StepArray | None = None, min_p: StepArray | None = None) -> jax.Array:
    """logits [B, V] float32; temperature, top_p [B]; keys [B] PRNG keys; top_k [B] int (0: off), min_p [B]
    (None: off) -> token ids [B] int32."""
    B = logits.shape[0]
    top_k = jnp.zeros((B,), jnp.int32) if top_k is None else top_k
    min_p = jnp.zeros((B,), jnp.float32) if min_p is None else min_p
    if row_tiles.active():  # per fixed row tile: a row's softmax and cumulative sum whatever the batch
        impl = jax.random.key_impl(keys)
        return row_tiles.by_row_tiles(
            lambda lg, t, p, k, m, key: _sample(lg, t, p, jax.random.wrap_key_data(key, impl=impl), k, m),
            logits, jnp.asarray(temperature), jnp.asarray(top_p), jnp.asarray(top_k), jnp.asarray(min_p),
            jax.random.key_data(keys))
    return _sample(logits, temperature, top_p, keys, top_k, min_p)


def _sample(logits: jax.Array, temperature: StepArray, top_p: StepArray, keys: jax.Array, top_k: StepArray,
            min_p: StepArray) -> jax.Array:
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    # Sorting the vocabulary is most of a small decode step on CPU (30 ms of ~175 for 32 rows of 4096 here):
    # only a batch with a sampling row pays it.
    return jax.lax.cond(jnp.any(temperature > 0), _draw, lambda *a: greedy, logits, temperature, top_p, top_k, min_p,
                        keys, greedy)


def filtered(logits: jax.Array, temperature: StepArray, top_p: StepArray, top_k: StepArray, min_p: StepArray
             ) -> tuple[jax.Array, jax.Array]:
    """The distribution a sampling row draws from: (its logits, sorted most likely first, -inf where filtered
    out; the vocabulary ids in that order), both [B, V]."""
    scaled = logits / jnp.maximum(jnp.asarray(temperature), 1e-6)[:, None]
    order = jnp.argsort(-scaled, axis=-1)
    ordered = jnp.take_along_axis(scaled, order, axis=-1)
    return _filter(ordered, jnp.asarray(top_p), jnp.asarray(top_k), jnp.asarray(min_p)), order


def _filter(ordered: jax.Array, top_p: jax.Array, top_k: jax.Array, min_p: jax.Array) -> jax.Array:
    """ordered [B, V]: each row's scaled logits, largest first -> the same with -inf where top_k, then top_p, then
    min_p drop a token. Each keeps the most likely token, and every token tied with the last it keeps."""
    V = ordered.shape[-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    kth = jnp.take_along_axis(ordered, (k - 1)[:, None], axis=-1)
    ordered = jnp.where(ordered >= kth, ordered, -jnp.inf)
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly ahead of each candidate
    keep = (before < top_p[:, None]).at[:, 0].set(True)
    ordered = jnp.where(keep, ordered, -jnp.inf)
    # p / p_max >= min_p, in logits (a softmax's normalisation cancels); log(0) = -inf keeps all
    floor = ordered[:, :1] + jnp.log(min_p)[:, None]
    return jnp.where(ordered >= floor, ordered, -jnp.inf)


def _draw(logits: jax.Array, temperature: StepArray, top_p: StepArray, top_k: StepArray, min_p: StepArray,
          keys: jax.Array, greedy: jax.Array) -> jax.Array:
    masked, order = filtered(logits, temperature, top_p, top_k, min_p)
    choice = jax.vmap(jax.random.categorical)(keys, masked)
    sampled = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy)
