"""Disaggregated expert parallelism (FinDEP, layout experts=dep): attention on one group of devices, the routed
experts on another, activations exchanged per token chunk (moejax.sharding.dep)."""
from __future__ import annotations

from moejax.models.moe import is_routed_expert
from moejax.placements.base import LayerByLayer
from moejax.sharding.dep import Disaggregated, DisaggregatedSteps


class DEP(LayerByLayer):
    name = "dep"
    continuous_batching = False  # a step's rows (and so its caches) split into micro-batches: no shared pool yet

    @classmethod
    def applies(cls, memory_plan, settings, layout_setup) -> bool:
        return memory_plan.placement == "resident" and layout_setup is not None and layout_setup.disaggregated

    def new_store(self):
        return self.layout_setup.expert_group()

    def place(self, path, array, store):
        if is_routed_expert(path):
            return store.add(path, array)  # a stand-in on the attention group
        return self.layout_setup.place(path, array)

    def layer_runtime(self, store, kernels, config):
        return Disaggregated(store, self.layout, config, kernels.experts)

    def steps_class(self):
        return DisaggregatedSteps  # drives its layers its own way
