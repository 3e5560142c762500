"""Weights per device under a layout, from abstract shapes (nothing allocated), checked against the device budget.

Routed experts: whole on every device (replicated), 1/P each (ep, tp), 1/P plus the first MoE layer whole plus
one gathered layer whole (async_ep: the layer being computed; XLA may hold more at once), or 1/B on each of
DEP's expert devices. Attention arrays split by heads under attn=tp count 1/P; everything else is whole on every
device (on DEP's attention devices only). Pipeline (attn=pp): each device holds its stage's decoder layers, padded
as moejax.sharding.pipeline_steps stacks them, and the embedding, final norm and head."""
from __future__ import annotations

import dataclasses

import numpy as np

from moejax.layout import Layout
from moejax.models.moe import is_routed_expert
from moejax.offload.memory_budget import RESERVE_FRACTION, size
from moejax.sharding.stages import stage_bytes


@dataclasses.dataclass(frozen=True)
class DeviceWeights:
    """Bytes of weights one device holds: `rest` (attention, norms, embeddings, shared experts...) and `experts`
    (routed); under DEP the attention and expert devices differ, so both are given per group."""
    layout: str
    rest: int
    experts: int
    expert_device_experts: int = 0  # DEP: what each expert device holds (its attention devices hold `rest`)

    @property
    def most(self) -> int:
        return max(self.rest + self.experts, self.expert_device_experts)

    def describe(self) -> str:
        if self.expert_device_experts:
            return (f"per device: attention devices {size(self.rest)} of weights, expert devices "
                    f"{size(self.expert_device_experts)} of routed experts")
        return f"per device: {size(self.rest + self.experts)} of weights ({size(self.experts)} routed experts)"


def device_weights(shapes: dict, layout: Layout, first_moe: int | None, head_split: set[str]) -> DeviceWeights:
    """shapes: flat parameter path -> abstract array; head_split: attention array names split by heads (attn=tp)."""
    P = layout.devices
    assert P is not None, "device_weights: resolve the layout first"
    if layout.attn == "pp":
        outside, per_stage, experts = stage_bytes(shapes, P)
        return DeviceWeights(str(layout), outside + per_stage - experts, experts)
    rest = experts = first = 0
    per_layer: dict[int, int] = {}
    for path, a in shapes.items():
        nbytes = int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
        if is_routed_expert(path):
            per_layer[path[1]] = per_layer.get(path[1], 0) + nbytes
            if path[1] == first_moe:
                first += nbytes
            experts += nbytes
        elif layout.attn == "tp" and len(path) == 4 and path[2] == "attn" and path[3] in head_split:
            rest += nbytes // P
        else:
            rest += nbytes
    layer_experts = max(per_layer.values(), default=0)
    if layout.experts == "replicated":
        return DeviceWeights(str(layout), rest, experts)
    if layout.experts == "dep":
        assert layout.expert_devices is not None  # resolved with its devices
        return DeviceWeights(str(layout), rest, 0, experts // layout.expert_devices)
    if layout.experts == "async_ep":  # shards of the later layers, the first whole, one gathered layer whole
        return DeviceWeights(str(layout), rest, (experts - first) // P + first + layer_experts)
    return DeviceWeights(str(layout), rest, experts // P)


def check_fits(weights: DeviceWeights, budget: int | None) -> None:
    """ValueError with the numbers when a device's weights leave less than the reserve of `budget`."""
    if budget is None:
        return
    usable = budget * (1 - RESERVE_FRACTION)
    if weights.most > usable:
        raise ValueError(f"moejax.load: layout {weights.layout} cannot fit: {weights.describe()}, over the "
                         f"{size(usable)} a device has for weights (budget {size(budget)} less the "
                         f"{RESERVE_FRACTION:.0%} reserve); spread the experts (ep, async_ep, tp, dep) over more "
                         "devices or offload them")
