"""MoE-Lightning (Cao et al., ASPLOS '25; arXiv 2411.11217): the KV cache in host memory with decode attention
on the host CPU, the experts paged in with a resident share r_w, and CGOPipe's schedule over micro-batches
(moejax.lightning). Its policy (N, μ, A_g, F_g, r_w, r_c) is the budget's LightningPlan."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from moejax.config import ModelConfig
from moejax.kernels.backends import Kernels
from moejax.lightning.at_load import kv_bytes_per_token, kv_fits_device
from moejax.lightning.balance import BatchLimit
from moejax.lightning.cgopipe_steps import LightningSettings, LightningSteps, PipelineStats
from moejax.lightning.host_ffn import HostExpertStore, HostFFN
from moejax.lightning.pages import PagedExperts, PagedStore
from moejax.lightning.policy import FIELDS, LightningPlan, check_kv_fits, host_memory_bytes, resolve_plan
from moejax.offload.layered_steps import LayeredSteps
from moejax.offload.memory_budget import (
    BudgetAsk,
    MemoryBudget,
    MemoryBudgetError,
    ModelBytes,
    device_budget_bytes,
    size,
)
from moejax.offload.settings import PlacementSettings
from moejax.placements.base import LayerByLayer, Store
from moejax.placements.budget import budget_for
from moejax.plan.engine_plan import EnginePlan
from moejax.plan.hardware import Profile
from moejax.plan.lightning import CPU_USABLE
from moejax.sharding.setup import LayoutSetup

# the host's paged attention kernel: Pallas does not run on a CPU, and 'cpu' (moejax.kernels.attention.paged_cpu)
# read the pool 1.1-5x faster than 'xla' there (bench/README.md, "Lightning against streamed and cached")
HOST_BACKEND = "cpu"


class Lightning(LayerByLayer):
    name = "lightning"
    static_prefill_pool = False  # its static prefill writes each row's KV straight to the host
    offloads = True
    probed_at_explain = True
    # auto_rank None: bytes never choose it; auto_instead does, when the planned batch's KV does not fit the device

    # -- the memory budget ----------------------------------------------------------------------------------------
    @classmethod
    def budget(cls, model: ModelBytes, ask: BudgetAsk, auto: bool) -> MemoryBudget:
        plan = ask.lightning
        if plan is None:
            raise MemoryBudgetError("placement 'lightning' needs its policy (moejax.lightning.policy.resolve_plan)")
        budget = MemoryBudget(cls, **model.fields(), lightning=plan, reason=f"policy {plan.describe()}")
        if model.budget_bytes is not None and budget.device_bytes > model.budget_bytes - model.reserve:
            raise MemoryBudgetError(
                f"placement 'lightning' with r_w = {plan.r_w:.2f}: resident weights {size(model.resident)} + experts "
                f"{size(budget.expert_device_bytes)} = {size(budget.device_bytes)} exceed the budget "
                f"{size(model.budget_bytes)} less the reserve {size(model.reserve)}; give a smaller resident_share")
        return budget

    @classmethod
    def expert_device_bytes(cls, budget: MemoryBudget) -> int:
        """The resident share of every layer and the pages of two layers (the double buffer; the FFN reads each
        expert from its page, moejax.lightning.pages.paged_routed); under F_g = 0 the resident share alone."""
        keep = int(round(budget.lightning.r_w * budget.experts_per_layer))
        paged = (budget.experts_per_layer - keep) if budget.lightning.F_g else 0
        return budget.expert_bytes * (keep * budget.moe_layers + 2 * paged)

    @classmethod
    def describe_experts(cls, budget: MemoryBudget) -> str:
        if not budget.lightning.F_g:
            return (f"r_w = {budget.lightning.r_w:.2f} of the experts resident, the rest in host memory, run by the "
                    "host (F_g = 0)")
        return (f"r_w = {budget.lightning.r_w:.2f} of the experts resident, the rest paged: two layers' pages, read in "
                "place through a page table")

    @classmethod
    def budget_at_load(cls, cfg: ModelConfig, shapes: dict, settings: PlacementSettings, plan: EnginePlan,
                       dtype: DTypeLike, profile: Callable[[], Profile]) -> tuple[MemoryBudget, str]:
        """Its policy resolved from the options and the search, the KV cache of its batch checked against host and
        device memory -> (budget, a line on its KV cache); ValueError naming what does not fit."""
        workload = plan.workload
        host_bytes = host_memory_bytes(settings.host_memory_gb)

        device_bytes = device_budget_bytes(settings.device_memory_gb)

        def here() -> Profile:  # the search sizes the KV as the check below does: this dtype, this host's memory,
            found = profile()  # this device budget (else it may put a KV cache on a device that cannot hold it)
            device = found.device if device_bytes is None else \
                dataclasses.replace(found.device, memory_bytes=float(device_bytes))
            return dataclasses.replace(found, dtype_bytes=jnp.dtype(dtype).itemsize, device=device,
                                       host=dataclasses.replace(found.host, memory_bytes=float(host_bytes)))
        try:
            policy = resolve_plan(cfg, {f: getattr(settings, f) for f in FIELDS}, prompt_len=workload.seq_len,
                                  gen_len=workload.gen_len, profile=here)
            budget = budget_for(cfg, shapes, dataclasses.replace(settings, placement=cls.name), lightning=policy)
            free = None if budget.budget_bytes is None else \
                budget.budget_bytes - budget.reserve_bytes - budget.device_bytes
            text = check_kv_fits(policy, kv_bytes_per_token(cfg, dtype), cfg.num_layers,
                                 workload.seq_len + workload.gen_len, host_bytes=host_bytes, device_free=free,
                                 where="placement 'lightning'")
        except MemoryBudgetError as e:
            raise ValueError(f"moejax.load: {e}") from None
        budget = dataclasses.replace(budget, kv_row_tokens=workload.seq_len + workload.gen_len)
        return budget, f"placement lightning: {policy.describe()}; {text}"

    @classmethod
    def auto_instead(cls, cfg: ModelConfig, shapes: dict, settings: PlacementSettings, chosen: MemoryBudget,
                     plan: EnginePlan, dtype: DTypeLike, profile: Callable[[], Profile]
                     ) -> tuple[MemoryBudget, str] | None:
        """Lightning when the planned batch's KV cache does not fit beside the chosen placement's weights (the
        policy search then decides its settings); the chosen one, said so, when lightning cannot run either."""
        why = kv_fits_device(cfg, chosen, plan.workload, dtype)
        if why is None:
            return None
        try:
            budget, text = cls.budget_at_load(cfg, shapes, settings, plan, dtype, profile)
        except ValueError as e:
            return chosen, f"placement auto: {chosen.placement}, though {why}: lightning cannot run ({e})"
        return budget, f"placement auto: lightning, because {why}; {text}"

    @classmethod
    def applies(cls, budget: MemoryBudget, settings: PlacementSettings, layout_setup: LayoutSetup | None) -> bool:
        return budget.placement == cls.name and layout_setup is None

    def __init__(self, budget: MemoryBudget, layout_setup: LayoutSetup | None = None, *,
                 host_memory_gb: float | None = None, schedule: str | None = None) -> None:
        super().__init__(budget, layout_setup)
        self.host_memory_gb = host_memory_gb
        self.schedule = schedule or "cgopipe"

    @classmethod
    def build(cls, budget: MemoryBudget, settings: PlacementSettings, layout_setup: LayoutSetup | None) -> Lightning:
        return cls(budget, layout_setup, host_memory_gb=settings.host_memory_gb, schedule=settings.pipeline_schedule)

    @property
    def plan(self) -> LightningPlan:
        return self.memory_budget.lightning

    def new_store(self) -> PagedStore | HostExpertStore:
        if not self.plan.F_g:
            return HostExpertStore(self.plan.r_w)
        return PagedStore(self.plan.r_w, pages=self.plan.micro_batches)

    def layer_runtime(self, store: Store, kernels: Kernels, config: ModelConfig) -> PagedExperts | HostFFN:
        if isinstance(store, HostExpertStore):
            return HostFFN(store, config, kernels.experts)
        return PagedExperts(store, kernels.experts)

    def make_steps(self, graphdef: nnx.GraphDef, kernels: Kernels, config: ModelConfig, params: nnx.State | None = None,
                   store: Store = None) -> LightningSteps:
        assert params is not None  # a layer loop is built with the weights (Engine.steps)
        L = config.num_layers
        settings = LightningSettings(self.plan.mu, self.plan.device_kv_layers(L), HOST_BACKEND,
                                     swap_kv=self.plan.swaps_kv(L), schedule=self.schedule)
        return LightningSteps(graphdef, params, kernels, self.layer_runtime(store, kernels, config), settings)

    def decode_pool_room(self, config: ModelConfig) -> tuple[float, str]:
        """The pool's bytes over every layer: the host's usable memory for its 1 - r_c share of the layers, and the
        device's free bytes for the r_c share, whichever bounds first."""
        plan, L = self.plan, config.num_layers
        on_device = plan.device_kv_layers(L)
        swapped = plan.swapped_kv_layers(L)
        host = CPU_USABLE * host_memory_bytes(self.host_memory_gb)
        room = [(host * L / (L - on_device), f"{CPU_USABLE:.0%} of {size(host / CPU_USABLE)} host memory for the KV "
                                             f"of {L - on_device} of {L} layers")] if on_device < L else []
        budget = self.memory_budget
        if on_device + swapped and budget.budget_bytes is not None:
            free = max(budget.budget_bytes - budget.reserve_bytes - budget.device_bytes, 0)
            room.append((free * L / (on_device + swapped),
                         f"{size(free)} the device budget leaves for the KV of {on_device} of {L} layers (r_c = "
                         f"{plan.r_c:.2f})" + (f" and {swapped} swapped in" if swapped else "")))
        return min(room) if room else (float("inf"), "no limit known")

    def batch_limit(self) -> BatchLimit | None:
        """Alg. 2's limits on the decode batch: the policy's micro-batches of μ rows, each holding the KV of μ rows
        of the tokens the policy was sized for (moejax.load's plan_seq_len + plan_gen_len); None: not sized."""
        row = self.memory_budget.kv_row_tokens
        plan = self.plan
        return None if row is None else BatchLimit(plan.micro_batches, plan.mu, plan.mu * row)

    def scheduler_defaults(self) -> dict:
        # the decode batch N in one call: its micro-batches are the pipeline's; Alg. 2 admits into it
        return {"max_rows": self.plan.N, "decode_calls": 1, "batch_limit": self.batch_limit()}

    def stats(self, steps: LayeredSteps | None) -> dict:
        assert isinstance(steps, LightningSteps)
        out = {"placement": self.name, "pipeline": steps.stats.as_dict(), **steps.experts.stats.as_dict()}
        if isinstance(steps.experts, HostFFN):  # F_g = 0: the FFN's inputs to the host, its output back
            out["host_ffn"] = {"bytes_d2h": steps.experts.bytes_d2h, "bytes_h2d": steps.experts.bytes_h2d}
        return out

    def reset_stats(self, steps: LayeredSteps | None) -> None:
        assert isinstance(steps, LightningSteps)
        steps.stats = PipelineStats()
        steps.experts.stats = type(steps.experts.stats)()
        if isinstance(steps.experts, HostFFN):
            steps.experts.bytes_d2h = steps.experts.bytes_h2d = 0

    def describe(self, steps: LayeredSteps | None) -> str:
        assert isinstance(steps, LightningSteps)
        L = len(steps.layers)
        host_layers = L - steps.settings.device_kv_layers
        attention = ("swapped in to the device per pass, attention there" if steps.settings.swap_kv else
                     f"attention there with the {steps.settings.host_backend} kernel")
        return (f"placement lightning: {self.plan.describe()}\n  KV cache of {host_layers} of {L} layers on the "
                f"host ({steps.host}), {attention}; {steps.experts.describe()}; {steps.settings.schedule} launch "
                "order" + self._limit_text())

    def _limit_text(self) -> str:
        limit = self.batch_limit()
        return "" if limit is None else (f"; Alg. 2 admits a request where its micro-batch's KV stays within "
                                         f"{limit.cache_tokens} tokens (prompts and max_tokens)")
