"""AsyncEP's two-channel pipeline (MoE-Prefill §6.2-6.3, layout experts=async_ep with placement 'streamed'): each
device copies its shard of a layer's experts from pinned host memory while gathering the next layer's shards from
the others (moejax.sharding.gathered)."""
from __future__ import annotations


from moejax.offload.host_store import HostStore
from moejax.placements.base import LayerByLayer, Store
from moejax.sharding.gathered import GatheredStreamed

from moejax.config import ModelConfig
from moejax.kernels.backends import Kernels
from moejax.offload.memory_budget import MemoryBudget
from moejax.offload.settings import PlacementSettings
from moejax.sharding.setup import LayoutSetup


class Gathered(LayerByLayer):
    name = "async_ep+streamed"
    theta_mode = "two_channel"
    profiles_theta = True

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
