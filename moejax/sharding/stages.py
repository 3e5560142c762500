"""Pipeline stages (layout attn=pp,experts=pp) without devices: which decoder layers each stage runs, how its layers
stack into one array per parameter and layer kind, and the bytes a stage's device holds.

Layers with the same parameter names, shapes and dtypes are one kind (a dense first layer and the MoE layers
after it are two). A stage's layers of one kind are stacked along a slot axis, padded to the most any stage
has, so that every stage's block of the stacked array has one shape (moejax.sharding.pipeline_steps shards it over
the stages): an uneven split or kinds spread unevenly over the stages cost padding slots of zeros."""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TypeVar

import numpy as np

from moejax.models.moe import is_routed_expert

K = TypeVar("K", bound=Hashable)  # a layer kind


def stage_layers(layers: int, stages: int) -> tuple[range, ...]:
    """Contiguous layers per stage; when they do not divide, the first `layers % stages` stages take one more."""
    if stages < 1 or layers < stages:
        raise ValueError(f"pipeline: {layers} decoder layers cannot be split over {stages} stages (each stage "
                         "needs a layer)")
    bounds = np.cumsum([0] + [len(c) for c in np.array_split(np.arange(layers), stages)])
    return tuple(range(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True))


def slots(kinds: Sequence[K], stages: int) -> tuple[dict[K, int], list[tuple[K, int]]]:
    """kinds: each layer's kind. -> (slots per kind: the most layers of that kind any stage holds, each layer's
    (kind, slot on its stage))."""
    counts: dict[K, int] = {}
    where = []
    for stage in stage_layers(len(kinds), stages):
        seen: dict[K, int] = {}
        for i in stage:
            where.append((kinds[i], seen.get(kinds[i], 0)))
            seen[kinds[i]] = seen.get(kinds[i], 0) + 1
        for kind, n in seen.items():
            counts[kind] = max(counts.get(kind, 0), n)
    return counts, where


def stage_bytes(shapes: dict, stages: int) -> tuple[int, int, int]:
    """shapes: flat parameter path -> abstract array. -> (bytes outside the decoder layers, which every stage
    holds; bytes of one stage's stacked layers, padding slots included; of those, the routed experts')."""
    outside = 0
    layers: dict[int, dict[tuple, tuple]] = {}
    for path, a in shapes.items():
        if path[0] == "layers":
            layers.setdefault(int(path[1]), {})[tuple(path[2:])] = (tuple(a.shape), np.dtype(a.dtype).name)
        else:
            outside += int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
    kinds = [tuple(sorted(layers[i].items())) for i in range(len(layers))]
    counts, _ = slots(kinds, stages)
    stacked = experts = 0
    for kind, n in counts.items():
        for sub, (shape, dtype) in kind:
            nbytes = n * int(np.prod(shape)) * np.dtype(dtype).itemsize
            stacked += nbytes
            experts += nbytes if is_routed_expert(("layers", 0, *sub)) else 0
    return outside, stacked, experts
