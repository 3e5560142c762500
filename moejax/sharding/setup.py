"""`moejax.load(layout=...)`: the spec checked against the model and the devices, its mesh, how each parameter
is placed on it, and the experts runner the MoE blocks call."""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from moejax.config import ModelConfig
from moejax.layout import Layout
from moejax.models.moe import is_routed_expert
from moejax.offload.memory_budget import MemoryBudget
from moejax.sharding import multihost
from moejax.sharding.dep import ExpertGroup, check_group_processes, group_meshes
from moejax.sharding.experts import AXIS, TP_SPECS, ShardedExperts, tp_columns
from moejax.sharding.memory import check_fits, device_weights
from moejax.sharding.mesh import make_mesh


@dataclasses.dataclass(frozen=True)
class LayoutSetup:
    layout: Layout
    mesh: Mesh  # every device of the layout; under DEP the attention group's
    run_experts: ShardedExperts | None  # one for every block: equal layers keep equal graphdefs (None under DEP)
    kv_heads: int
    expert_mesh: Mesh | None = None  # DEP: the expert group's devices
    first_moe: int | None = None  # async_ep keeps this layer's experts whole on every device

    @property
    def disaggregated(self) -> bool:
        return self.layout.experts == "dep"

    def expert_group(self) -> ExpertGroup:
        """DEP: where the loader puts the routed experts (the parameters keep stand-ins)."""
        assert self.expert_mesh is not None  # set under DEP
        return ExpertGroup(self.mesh, self.expert_mesh)

    def budget_memory(self, memory: MemoryBudget, shapes: dict, budget: int | None) -> MemoryBudget:
        """The memory budget of a resident layout: each device's weights from the abstract shapes, checked against
        the budget (ValueError with the numbers)."""
        weights = device_weights(shapes, self.layout, self.first_moe, set(self.heads) if self.layout.attn == "tp"
                                 else set())
        check_fits(weights, budget)
        return dataclasses.replace(memory, reason=f"a layout spreads the weights over devices ({weights.describe()})")

    @property
    def expert_shards(self) -> NamedSharding:
        """Where an offloaded layout's routed experts go: split by expert index over the devices (a HostStore
        puts them in each device's pinned host memory)."""
        return NamedSharding(self.mesh, P(AXIS))

    @property
    def split_batch(self) -> Callable[[jax.Array], jax.Array] | None:
        """attn=dp: hidden states split by batch rows (None under attn=tp, where every device sees every token)."""
        if self.layout.attn != "dp":
            return None
        return functools.partial(jax.lax.with_sharding_constraint, shardings=NamedSharding(self.mesh, P(AXIS)))

    def place(self, path: tuple, array: Any) -> jax.Array:
        """A parameter on the mesh, by the rules: routed experts split by expert index (ep, async_ep; async_ep
        keeps the first MoE layer's whole on every device, MoE-Prefill §6.2: nothing to gather before the first
        layer) or by width (tp, with gate/up columns interleaved per device); attention split by heads under
        attn=tp; the rest replicated."""
        spec, name = P(), path[-1] if path[-1] != "weight" else None
        if is_routed_expert(path):
            if self.layout.experts == "ep" or (self.layout.experts == "async_ep" and path[1] != self.first_moe):
                spec = P(AXIS)
            elif self.layout.experts == "tp":
                assert name is not None and self.layout.devices is not None  # routed experts are named; resolved
                spec = TP_SPECS[name]
                if name in ("we_gate_up", "be_gate_up"):
                    array = tp_columns(array, self.layout.devices)
        elif self.layout.attn == "tp" and len(path) == 4 and path[2] == "attn":
            spec = self.heads.get(name, P()) if name is not None else P()
        return multihost.place(array, NamedSharding(self.mesh, spec))

    @property
    def heads(self) -> dict[str, P]:
        """attn=tp: which attention arrays split by heads (columns of the input projections, rows of the output
        one; kv projections only when the kv heads divide too)."""
        by_heads = {"wq": P(None, AXIS), "bq": P(AXIS), "wq_b": P(None, AXIS), "wkv_b": P(None, AXIS),
                    "wo": P(AXIS, None), "sinks": P(AXIS)}
        assert self.layout.devices is not None  # resolved by layout_of
        if self.kv_heads % self.layout.devices == 0:
            by_heads.update(wk=P(None, AXIS), wv=P(None, AXIS), bk=P(AXIS), bv=P(AXIS))
        return by_heads


def layout_of(spec: Layout | str | None, cfg: ModelConfig) -> LayoutSetup | None:
    """The checked layout (None without one); which placements combine with it is moejax.placements' to say."""
    if spec is None:
        return None
    try:
        layout = spec if isinstance(spec, Layout) else Layout.parse(spec)
        layout = layout.resolve(cfg.num_experts or 1, len(jax.devices()), expert_width=cfg.moe_intermediate_size or 0,
                                heads=cfg.num_heads, layers=cfg.num_layers)
    except ValueError as e:
        raise ValueError(f"moejax.load: {e}") from None
    if layout.experts == "dep":
        if jax.process_count() > 1:
            try:
                check_group_processes(layout)
            except ValueError as e:
                raise ValueError(f"moejax.load: layout {layout}: {e}") from None
        attn_mesh, expert_mesh = group_meshes(layout)
        return LayoutSetup(layout, attn_mesh, None, cfg.num_kv_heads or 0, expert_mesh)
    assert layout.devices is not None  # resolved
    mesh = make_mesh(layout.devices)
    if layout.attn == "pp":  # each stage runs its layers' experts locally (moejax.sharding.pipeline_steps)
        if jax.process_count() > 1:
            raise ValueError("moejax.load: attn=pp,experts=pp runs in one process")
        return LayoutSetup(layout, mesh, None, cfg.num_kv_heads or 0)
    first_moe = next((i for i, moe in enumerate(cfg.moe_layers) if moe), None)
    return LayoutSetup(layout, mesh, ShardedExperts(layout, mesh), cfg.num_kv_heads or 0,
                       first_moe=first_moe)
