"""A model's weights as the Engine asks for them (once, on first use): read from a checkpoint directory or made by
the presets' deterministic init, each tensor placed where its Placement says."""
from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from moejax.models.checkpoint import checkpoint_reader

if TYPE_CHECKING:
    from moejax.models.decoder import MoEModel
    from moejax.placements.base import Placement


def materializer(abstract: MoEModel, shapes: dict, placement: Placement, *, checkpoint: str | None = None,
                 ignore_layers_from: int | None = None, seed: int = 0) -> Callable[[], tuple[nnx.State, Any]]:
    """-> materialize() giving (weights as an nnx.State, the placement's store or None). `abstract`: the model
    under nnx.eval_shape; shapes: its abstract arrays by flat path; checkpoint: a HF directory to read (None: the
    presets' random init with `seed`)."""
    flat = dict(nnx.to_flat_state(nnx.state(abstract)))
    # a checkpoint is checked against the model from its metadata now, at load; its tensors are read on first use
    read = None if checkpoint is None else checkpoint_reader(checkpoint, abstract.cfg, shapes,
                                                             ignore_layers_from=ignore_layers_from)

    def materialize() -> tuple[nnx.State, Any]:
        store = placement.new_store()

        def place(path: tuple, array: Any) -> Any:  # as Placement.place
            return placement.place(path, array, store)
        if read is not None:
            values = read(place)
        else:
            values = {p: place(p, random_param(p, s, seed)) for p, s in shapes.items()}
        for path, var in flat.items():
            var.set_value(values[path])
        return nnx.from_flat_state(list(flat.items())), store
    return materialize


def random_param(path: tuple, abstract: jax.ShapeDtypeStruct, seed: int) -> jax.Array:
    """Deterministic per-tensor random init on the default device (norm weights 1, biases 0)."""
    name = str(path[-1]) if path[-1] != "weight" else str(path[-2])
    shape, dtype = tuple(abstract.shape), abstract.dtype
    if path[-1] == "weight":  # RMSNorm scales
        return jnp.ones(shape, dtype)
    if name.startswith("b") or name in ("sinks", "router_bias", "correction_bias"):
        return jnp.zeros(shape, dtype)
    key = jax.random.fold_in(jax.random.key(seed), zlib.crc32("/".join(map(str, path)).encode()))
    return _normal(key, shape, dtype)


@jax.jit
def _normal_impl(key: jax.Array, proto: jax.ShapeDtypeStruct) -> jax.Array:
    return (0.02 * jax.random.normal(key, proto.shape, jnp.float32)).astype(proto.dtype)


def _normal(key: jax.Array, shape: tuple[int, ...], dtype: DTypeLike) -> jax.Array:
    return _normal_impl(key, jax.ShapeDtypeStruct(shape, dtype))
