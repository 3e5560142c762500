"""The batch-invariant mode's switch and its row-wise pieces (moejax.kernels.invariant has the rest): whether the
step being traced runs in the mode, a loop XLA compiles once whatever its trip count, and matmuls, norms and
softmaxes over fixed [ROWS, K] row tiles. Imports nothing of moejax, so that any kernel may ask it."""
from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

ROWS = 8  # rows of a matmul / norm / expert tile, and queries of an attention tile
_f32 = jnp.float32
_active = contextvars.ContextVar("moejax_batch_invariant", default=False)


def active() -> bool:
    """Whether the step being traced computes batch-invariantly."""
    return _active.get()


@contextlib.contextmanager
def scope(on: bool = True) -> Iterator[None]:
    token = _active.set(on)
    try:
        yield
    finally:
        _active.reset(token)


def traced(fn: Callable[..., Any]) -> Callable[..., Any]:
    """fn run (traced, under jit) with the mode on."""
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with scope():
            return fn(*args, **kwargs)
    return run


def loop(count: jax.Array | int, piece: Callable[[jax.Array], jax.Array], out: jax.ShapeDtypeStruct) -> jax.Array:
    """[count, *piece's shape]: piece(i) for i < count (the rest zeros), in a loop whose trip count XLA cannot see,
    so the body is compiled once for its own shapes (never unrolled or fused with its neighbours by batch size)."""
    n = lax.optimization_barrier(jnp.asarray(count, jnp.int32))

    def body(i: jax.Array, acc: jax.Array) -> jax.Array:
        return lax.dynamic_update_index_in_dim(acc, piece(i).astype(acc.dtype), i, 0)
    return lax.fori_loop(0, n, body, jnp.zeros(out.shape, out.dtype))


def _pad_rows(x: jax.Array, multiple: int) -> jax.Array:
    pad = -x.shape[0] % multiple
    return jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)) if pad else x


def by_rows(fn: Callable[[jax.Array], jax.Array], x: jax.Array) -> jax.Array:
    """fn ([ROWS, *row] -> [ROWS, *out row]) over x [..., *row] with `row_dims` trailing, in fixed row tiles: each
    row's result is what it would be alone. x's last axis is the row; every leading axis is a row index."""
    lead, row = x.shape[:-1], x.shape[-1:]
    flat = _pad_rows(x.reshape(-1, *row), ROWS)
    tiles = flat.reshape(-1, ROWS, *row)
    shape = jax.eval_shape(fn, jax.ShapeDtypeStruct(tiles.shape[1:], tiles.dtype))
    out = loop(tiles.shape[0], lambda i: fn(lax.dynamic_index_in_dim(tiles, i, keepdims=False)),
                jax.ShapeDtypeStruct((tiles.shape[0], *shape.shape), shape.dtype))
    rows = 1
    for d in lead:
        rows *= d
    return out.reshape(-1, *shape.shape[1:])[:rows].reshape(*lead, *shape.shape[1:])


def by_row_tiles(fn: Callable[..., jax.Array], *arrays: jax.Array) -> jax.Array:
    """fn(*tiles) -> [ROWS, ...] over fixed tiles of ROWS rows of `arrays` (each [B, ...], one B) -> [B, ...]."""
    B = arrays[0].shape[0]
    tiled = [_pad_rows(a, ROWS).reshape(-1, ROWS, *a.shape[1:]) for a in arrays]
    shape = jax.eval_shape(fn, *(jax.ShapeDtypeStruct(t.shape[1:], t.dtype) for t in tiled))
    out = loop(tiled[0].shape[0], lambda i: fn(*(lax.dynamic_index_in_dim(t, i, keepdims=False) for t in tiled)),
               jax.ShapeDtypeStruct((tiled[0].shape[0], *shape.shape), shape.dtype))
    return out.reshape(-1, *shape.shape[1:])[:B]


def log_softmax(x: jax.Array) -> jax.Array:
    """jax.nn.log_softmax over the last axis; in the mode, per fixed row tile."""
    return by_rows(lambda t: jax.nn.log_softmax(t, axis=-1), x) if active() else jax.nn.log_softmax(x, axis=-1)


def dot(a: jax.Array, b: jax.Array, precision: lax.Precision | None = None) -> jax.Array:
    """a [..., K] @ b [K, N] -> float32 [..., N], in fixed [ROWS, K] row tiles."""
    return by_rows(lambda t: jnp.dot(t, b, preferred_element_type=_f32, precision=precision), a)


def einsum(spec: str, a: jax.Array, b: jax.Array, precision: lax.Precision | None = None) -> jax.Array | None:
    """f32_einsum's batch-invariant form for a row-wise product with a weight matrix ('btd,df->btf': a's last
    index contracted with b's first, the output a's other indices then b's second); None for other specs."""
    inputs, out = spec.replace(" ", "").split("->")
    lhs, rhs = inputs.split(",")
    if len(rhs) != 2 or b.ndim != 2 or rhs[0] != lhs[-1] or out != lhs[:-1] + rhs[1] or rhs[1] in lhs:
        return None
    return dot(a, b, precision)
