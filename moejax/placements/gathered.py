"""AsyncEP's two-channel pipeline (MoE-Prefill §6.2-6.3, layout experts=async_ep with placement 'streamed'): each
device copies its shard of a layer's experts from pinned host memory while gathering the next layer's shards from
the others (moejax.sharding.gathered).

This file is the shape of every placement: adding one is this file and its line in moejax.placements.registry,
nothing else. The class says when it runs (`applies`: the memory budget's placement, the settings, the layout),
where the routed experts go at load (`new_store`, `place`), what runs each MoE layer (`layer_runtime`, an
implementation of moejax.offload.layered_steps.LayerRuntime, or `make_steps` for steps of its own), and what differs
from the defaults of moejax.placements.base.Placement (its Θ channel, the settings it takes, its stats). A new value of
the `placement` option also defines `budget` (its memory budget rules, moejax.offload.memory_budget.BudgetRules),
`auto_rank` if placement auto may choose it, and adds its name to the option's choices (moejax.offload.settings:
the option is checked where the settings are built, below the placements)."""
from __future__ import annotations

from moejax.config import ModelConfig
from moejax.kernels.backends import Kernels
from moejax.offload.host_store import HostStore
from moejax.offload.memory_budget import MemoryBudget
from moejax.offload.settings import PlacementSettings
from moejax.placements.base import LayerByLayer, Store
from moejax.sharding.gathered import GatheredStreamed
from moejax.sharding.setup import LayoutSetup


class Gathered(LayerByLayer):
    name = "async_ep+streamed"
    theta_mode = "two_channel"
    profiles_theta = True
    takes_staging = True  # its placement option's, streamed

    @classmethod
    def applies(cls, budget: MemoryBudget, settings: PlacementSettings, layout_setup: LayoutSetup | None) -> bool:
        return (budget.placement == "streamed" and layout_setup is not None and not settings.streams_in_jit
                and layout_setup.layout.experts == "async_ep")

    def new_store(self) -> HostStore:
        assert self.layout_setup is not None  # applies only with a layout
        return HostStore(per_expert=False, sharding=self.layout_setup.expert_shards)

    def layer_runtime(self, store: Store, kernels: Kernels, config: ModelConfig) -> GatheredStreamed:
        assert self.layout_setup is not None and self.memory_budget.window is not None  # a streamed budget's window
        return GatheredStreamed(store, self.memory_budget.window, self.layout_setup.mesh, config, kernels.experts)
