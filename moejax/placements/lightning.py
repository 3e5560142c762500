"""MoE-Lightning (Cao et al., ASPLOS '25; arXiv 2411.11217): the KV cache in host memory with decode attention
on the host CPU, the experts paged in with a resident share r_w, and CGOPipe's schedule over micro-batches
(moejax.lightning). Its policy (N, μ, A_g, F_g, r_w, r_c) is the budget's LightningPlan."""
from __future__ import annotations


from moejax.lightning.pages import PagedExperts, PagedStore
from moejax.lightning.pipeline import LightningSettings, LightningSteps, PipelineStats
from moejax.lightning.policy import host_memory_bytes
from moejax.offload.memory_budget import size
from moejax.placements.base import LayerByLayer, Store
from moejax.plan.lightning import CPU_USABLE

from flax import nnx
from moejax.config import ModelConfig
from moejax.kernels.backends import Kernels
from moejax.lightning.policy import LightningPlan
from moejax.offload.layered import LayeredSteps
from moejax.offload.memory_budget import MemoryBudget
from moejax.offload.settings import PlacementSettings
from moejax.sharding.setup import LayoutSetup

# the host's paged attention kernel: Pallas does not run on a CPU, and 'cpu' (moejax.kernels.attention.paged_cpu)
# read the pool 1.1-5x faster than 'xla' there (the cpuattn measurements, README "Placement lightning")
HOST_BACKEND = "cpu"


class Lightning(LayerByLayer):
    name = "lightning"
    static_prefill_pool = False  # its static prefill writes each row's KV straight to the host

    @classmethod
    def applies(cls, budget: MemoryBudget, settings: PlacementSettings, layout_setup: LayoutSetup | None) -> bool:
        return budget.placement == cls.name and layout_setup is None

    def __init__(self, budget: MemoryBudget, layout_setup: LayoutSetup | None = None, *,
                 host_memory_gb: float | None = None) -> None:
        super().__init__(budget, layout_setup)
        self.host_memory_gb = host_memory_gb

    @classmethod
    def build(cls, budget: MemoryBudget, settings: PlacementSettings, layout_setup: LayoutSetup | None) -> Lightning:
        return cls(budget, layout_setup, host_memory_gb=settings.host_memory_gb)

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

    def decode_pool_room(self, config: ModelConfig) -> tuple[float, str]:
        """The pool's bytes over every layer: the host's usable memory for its 1 - r_c share of the layers, and the
        device's free bytes for the r_c share, whichever bounds first."""
        plan, L = self.plan, config.num_layers
        on_device = plan.device_kv_layers(L)
        host = CPU_USABLE * host_memory_bytes(self.host_memory_gb)
        room = [(host * L / (L - on_device), f"{CPU_USABLE:.0%} of {size(host / CPU_USABLE)} host memory for the KV "
                                             f"of {L - on_device} of {L} layers")] if on_device < L else []
        budget = self.memory_budget
        if on_device and budget.budget_bytes is not None:
            free = max(budget.budget_bytes - budget.reserve_bytes - budget.device_bytes, 0)
            room.append((free * L / on_device, f"{size(free)} the device budget leaves for the KV of {on_device} of "
                                               f"{L} layers (r_c = {plan.r_c:.2f})"))
        return min(room) if room else (float("inf"), "no limit known")

    def scheduler_defaults(self) -> dict:
        # the decode batch N in one call: its micro-batches are the pipeline's
        return {"max_rows": self.plan.N, "decode_calls": 1}

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
