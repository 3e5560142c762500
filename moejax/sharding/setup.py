"""`moejax.load(layout=...)`: the spec checked against the model and the devices, its mesh, how each parameter
is placed on it, and the experts runner the MoE blocks call."""
from __future__ import annotations

import dataclasses
import functools

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moejax.models.moe import EXPERT_ARRAYS
from moejax.sharding.experts import AXIS, sharded_routed
from moejax.sharding.layout import Layout
from moejax.sharding.mesh import make_mesh


@dataclasses.dataclass(frozen=True)
class LayoutSetup:
    layout: Layout
    mesh: object
    run_experts: object  # one object for every block: the graphdefs of equal layers stay equal

    def sharding_of(self, path: tuple) -> NamedSharding:
        """Routed expert arrays split by expert index under ep; everything else replicated."""
        routed = len(path) == 4 and path[0] == "layers" and path[2] == "mlp" and path[3] in EXPERT_ARRAYS
        return NamedSharding(self.mesh, P(AXIS) if routed and self.layout.experts == "ep" else P())


def layout_of(spec, cfg, plan) -> LayoutSetup | None:
    if spec is None:
        return None
    try:
        layout = spec if isinstance(spec, Layout) else Layout.parse(spec)
        layout = layout.resolve(cfg.num_experts or 1, len(jax.devices()))
    except ValueError as e:
        raise ValueError(f"moejax.load: {e}") from None
    if plan.placement != "resident":
        raise ValueError(f"moejax.load: layout {layout} and placement {plan.placement!r} do not combine yet "
                         "(offloading is one device)")
    mesh = make_mesh(layout.devices)
    return LayoutSetup(layout, mesh, functools.partial(sharded_routed, layout, mesh))
