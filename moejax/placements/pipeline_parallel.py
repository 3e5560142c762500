"""Pipeline parallelism for prefill (layout attn=pp,experts=pp): each stage's decoder layers on its own device,
micro-batches passed from stage to stage in one jit (moejax.sharding.pipeline_steps). Prefill-only scoring."""
from __future__ import annotations

from typing import Any

from flax import nnx

from moejax.config import ModelConfig
from moejax.kernels.backends import Kernels
from moejax.offload.memory_budget import MemoryBudget
from moejax.offload.settings import PlacementSettings
from moejax.placements.base import Placement, Store
from moejax.sharding.pipeline_steps import PipelineSteps, StageStore
from moejax.sharding.setup import LayoutSetup


class Pipeline(Placement):
    name = "pipeline"
    continuous_batching = False  # prefill-only: no KV pool
    no_generation = ("layout attn=pp,experts=pp runs prefill-only scoring: generation would keep each stage's KV "
                     "cache on its device, which the pipeline does not implement (max_tokens 0 with echo, the "
                     "prompt's log-probabilities, runs)")
    no_prefix_pool = ("layout attn=pp,experts=pp keeps no prefix KV cache across scoring batches (each stage would "
                      "keep its layers' blocks, which the pipeline does not implement)")
    steps_need_weights = True  # the steps stack the layers by stage

    @classmethod
    def applies(cls, budget: MemoryBudget, settings: PlacementSettings, layout_setup: LayoutSetup | None) -> bool:
        return budget.placement == "resident" and layout_setup is not None and layout_setup.layout.attn == "pp"

    def new_store(self) -> StageStore:
        return StageStore()

    def place(self, path: tuple, array: Any, store: Store) -> Any:
        """Decoder-layer tensors into the store (a 0-d stand-in in the params), the rest replicated."""
        if path[0] == "layers":
            return store.add(path, array)
        assert self.layout_setup is not None  # applies only with a layout
        return self.layout_setup.place(path, array)

    def make_steps(self, graphdef: nnx.GraphDef, kernels: Kernels, config: ModelConfig, params: nnx.State | None = None,
                   store: Store = None) -> PipelineSteps:
        assert params is not None and self.layout is not None and self.layout_setup is not None  # with the weights
        return PipelineSteps(graphdef, params, kernels, store, self.layout, self.layout_setup.mesh)
