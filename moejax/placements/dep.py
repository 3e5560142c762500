"""Disaggregated expert parallelism (FinDEP, layout experts=dep): attention on one group of devices, the routed
experts on another, activations exchanged per token chunk (moejax.sharding.dep)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from moejax.config import ModelConfig
from moejax.kernels.backends import Kernels
from moejax.models.moe import is_routed_expert
from moejax.offload.layered_steps import LayeredSteps
from moejax.offload.memory_budget import MemoryBudget
from moejax.offload.settings import PlacementSettings
from moejax.placements.base import LayerByLayer, Store
from moejax.plan.dep_sim import Simulation, simulate_schedule
from moejax.plan.findep import solve_dep
from moejax.plan.findep_online import OnlineDep
from moejax.plan.hardware import Profile
from moejax.sharding.dep import Disaggregated, DisaggregatedSteps, ExpertGroup
from moejax.sharding.setup import LayoutSetup


class DEP(LayerByLayer):
    name = "dep"
    # continuous batching: a paged step's rows split into micro-batches, each reading and writing the shared pool
    # through its own rows' block tables (moejax.sharding.dep.DisaggregatedSteps)

    online: OnlineDep | None = None  # r1, r2 or order left auto: FinDEP's online phase, per step shape

    def at_load(self, config: ModelConfig, find_profile: Callable[[], Profile]) -> None:
        lay = self.layout
        if lay is not None and lay.online:
            self.online = OnlineDep(config, lay, find_profile)

    @classmethod
    def applies(cls, budget: MemoryBudget, settings: PlacementSettings, layout_setup: LayoutSetup | None) -> bool:
        return budget.placement == "resident" and layout_setup is not None and layout_setup.disaggregated

    def new_store(self) -> ExpertGroup:
        assert self.layout_setup is not None  # DEP applies only with a layout
        return self.layout_setup.expert_group()

    def place(self, path: tuple, array: Any, store: Store) -> Any:
        if is_routed_expert(path):
            return store.add(path, array)  # a stand-in on the attention group
        assert self.layout_setup is not None
        return self.layout_setup.place(path, array)

    def layer_runtime(self, store: Store, kernels: Kernels, config: ModelConfig) -> Disaggregated:
        assert self.layout is not None
        return Disaggregated(store, self.layout, config, kernels.experts, online=self.online)

    def predicted_pipeline(self, config: ModelConfig, profile: Profile, max_batch_tokens: int) -> Simulation:
        """FinDEP's schedule of this layout's r1, r2 and order for a step of `max_batch_tokens` tokens (sequences of
        at most 1024), simulated over up to 3 layers on `profile`."""
        lay = self.layout
        assert lay is not None and lay.devices is not None  # a DEP placement's layout, resolved
        seq = min(max_batch_tokens, config.max_position_embeddings, 1024)
        schedule = solve_dep(config, profile, devices=lay.devices, tokens=max(max_batch_tokens, seq), seq_len=seq,
                             attn_devices=lay.attn_devices, expert_devices=lay.expert_devices, r1=lay.r1, r2=lay.r2,
                             order=lay.order)
        return simulate_schedule(config, profile, schedule, layers=min(config.num_layers, 3))

    def steps_class(self) -> type[DisaggregatedSteps]:
        return DisaggregatedSteps  # drives its layers its own way

    def stats(self, steps: LayeredSteps | None) -> dict:
        """The transfer counters; with online FinDEP also its log (per step shape: schedule, solve time, hits)."""
        out = super().stats(steps)
        return out if self.online is None else {**out, "online": self.online.as_dict()}

    def describe(self, steps: LayeredSteps | None) -> str:
        text = super().describe(steps)
        return text if self.online is None else f"{text}\n{self.online.describe()}"
