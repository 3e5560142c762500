"""MoE-Lightning (Cao et al., ASPLOS '25; seeds/moe-lightning.txt): the KV cache in host memory with decode attention
on the host CPU, the experts paged in with a resident share r_w, and CGOPipe's schedule over micro-batches
(moejax.lightning). Its policy (N, μ, A_g, F_g, r_w, r_c) is the budget's LightningPlan."""
from __future__ import annotations

from typing import TYPE_CHECKING

from moejax.lightning.pages import PagedExperts, PagedStore
from moejax.lightning.pipeline import LightningSettings, LightningSteps, PipelineStats
from moejax.placements.base import LayerByLayer, Store

if TYPE_CHECKING:
    from flax import nnx

    from moejax.config import ModelConfig
    from moejax.kernels.backends import Kernels
    from moejax.lightning.policy import LightningPlan
    from moejax.offload.layered import LayeredSteps
    from moejax.offload.memory_budget import MemoryBudget
    from moejax.offload.settings import PlacementSettings
    from moejax.sharding.setup import LayoutSetup

HOST_BACKEND = "xla"  # the host's attention kernel (Pallas does not run on a CPU)


class Lightning(LayerByLayer):
    name = "lightning"

    @classmethod
    def applies(cls, budget: MemoryBudget, settings: PlacementSettings, layout_setup: LayoutSetup | None) -> bool:
        return budget.placement == cls.name and layout_setup is None

    @property
    def plan(self) -> LightningPlan:
        return self.memory_budget.lightning

    def new_store(self) -> PagedStore:
        return PagedStore(self.plan.r_w, pages=self.plan.micro_batches)

    def layer_runtime(self, store: Store, kernels: Kernels, config: ModelConfig) -> PagedExperts:
        return PagedExperts(store, kernels.experts)

    def make_steps(self, graphdef: nnx.GraphDef, kernels: Kernels, config: ModelConfig, params: nnx.State | None = None,
                   store: Store = None) -> LightningSteps:
        assert params is not None  # a layer loop is built with the weights (Engine.steps)
        settings = LightningSettings(self.plan.mu, self.plan.device_kv_layers(config.num_layers), HOST_BACKEND)
        return LightningSteps(graphdef, params, kernels, self.layer_runtime(store, kernels, config), settings)

    def stats(self, steps: LayeredSteps | None) -> dict:
        assert isinstance(steps, LightningSteps)
        return {"placement": self.name, "pipeline": steps.stats.as_dict(),
                **steps.experts.stats.as_dict()}

    def reset_stats(self, steps: LayeredSteps | None) -> None:
        assert isinstance(steps, LightningSteps)
        steps.stats = PipelineStats()
        steps.experts.stats = type(steps.experts.stats)()

    def describe(self, steps: LayeredSteps | None) -> str:
        assert isinstance(steps, LightningSteps)
        L = len(steps.layers)
        host_layers = L - steps.settings.device_kv_layers
        return (f"placement lightning: {self.plan.describe()}\n  KV cache of {host_layers} of {L} layers on the "
                f"host ({steps.host}), attention there with the {steps.settings.host_backend} kernel; "
                f"{steps.experts.describe()}")
