"""A model's weights as the Engine asks for them (once, on first use): read from a checkpoint directory or made by
the presets' deterministic init, each tensor placed where its Placement says."""
from __future__ import annotations

import functools
import zlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax.typing import DTypeLike

from moejax.models.checkpoint import checkpoint_reader
from moejax.models.decoder import MoEModel
from moejax.placements.base import Placement


def materializer(abstract: MoEModel, shapes: dict, placement: Placement, *, checkpoint: str | None = None,
                 ignore_layers_from: int | None = None, seed: int = 0) -> Callable[[], tuple[nnx.State, Any]]:
    """-> materialize() giving (weights as an nnx.State, the placement's store or None). `abstract`: the model
    under nnx.eval_shape; shapes: the abstract arrays of the same config's unstacked model by flat path (each layer's
    own, ('layers', i, ...)); checkpoint: a HF directory to read (None: the presets' random init with `seed`).
    Tensors are read and placed one layer at a time, as the unstacked model has them; a stacked model's stacks are
    made on the device and each layer's tensor is written into its slot as it arrives, so neither host nor device
    memory ever holds a second copy of the weights (one layer's tensor at most)."""
    flat = dict(nnx.to_flat_state(nnx.state(abstract)))
    # a checkpoint is checked against the model from its metadata now, at load; its tensors are read on first use
    read = None if checkpoint is None else checkpoint_reader(checkpoint, abstract.cfg, shapes,
                                                             ignore_layers_from=ignore_layers_from)
    slot_of = {layer_path: (stack, repeat) for stack, layer_paths in
               (abstract.stacked_sources().items() if abstract.stacked else ())
               for repeat, layer_path in enumerate(layer_paths)}

    def materialize() -> tuple[nnx.State, Any]:
        store = placement.new_store()
        stacks: dict[tuple, jax.Array] = {}

        def place(path: tuple, array: Any) -> Any:  # as Placement.place, then into its stack
            placed = placement.place(path, array, store)
            if path not in slot_of:
                return placed
            stack, repeat = slot_of[path]
            if stack not in stacks:
                stacks[stack] = _empty_stack(placed, flat[stack].get_value().shape[0])
            stacks[stack] = _write_slot(stacks[stack], placed, jnp.int32(repeat))
            return None
        if read is not None:
            values = read(place)
        else:
            values = {p: place(p, random_param(p, s, seed)) for p, s in shapes.items()}
        values.update(stacks)
        for path, var in flat.items():
            var.set_value(values[path])
        return nnx.from_flat_state(list(flat.items())), store
    return materialize


def _empty_stack(layer: jax.Array, count: int) -> jax.Array:
    """A zeroed [count, *layer.shape] array placed as `layer` is, with the new axis whole on every device."""
    sharding = layer.sharding
    if isinstance(sharding, NamedSharding):
        sharding = NamedSharding(sharding.mesh, P(None, *sharding.spec))
    return jnp.zeros((count, *layer.shape), layer.dtype, device=sharding)


@functools.partial(jax.jit, donate_argnums=(0,))
def _write_slot(stack: jax.Array, layer: jax.Array, repeat: jax.Array) -> jax.Array:
    return jax.lax.dynamic_update_index_in_dim(stack, layer.astype(stack.dtype), repeat, 0)


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
