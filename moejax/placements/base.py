"""The Placement interface: where a model's routed experts live and how a forward reaches them. `moejax.load` picks
one class (moejax.placements.placement_for) and it, the memory budget and the Engine ask it everything
placement-specific: the budget's rules, whether auto may choose it, the settings it takes, the layer runtime; no code
outside moejax.placements compares placement names (tests/placements/test_placements.py holds to it)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Self

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from moejax.config import ModelConfig
from moejax.kernels.backends import Kernels
from moejax.layout import Layout
from moejax.models.moe import LocalExperts, MoEBlock, is_routed_expert
from moejax.offload.layered_steps import LayeredSteps, LayerRuntime
from moejax.offload.memory_budget import BudgetAsk, MemoryBudget, ModelBytes
from moejax.offload.settings import PlacementSettings
from moejax.plan.dep_sim import Simulation
from moejax.plan.engine_plan import EnginePlan
from moejax.plan.hardware import Profile
from moejax.plan.placement import PlacementOption, step_costs
from moejax.plan.theta import ThetaEstimate, theta_at_load
from moejax.sharding.setup import LayoutSetup
from moejax.steps.protocol import Steps
from moejax.steps.whole_model import WholeModelSteps

# What a placement keeps the routed experts in at materialize (a HostStore, DEP's ExpertGroup), or None
Store = Any


class Placement:
    """Resident behaviour; each placement overrides what differs. Answers, for `moejax.load` and the Engine:
    - how checkpoint tensors are placed: `new_store()` at materialize, then `place(path, array, store)` for each;
    - which steps run a forward (`make_steps`): the whole-model jits (`experts_runner()` tells each MoE block how to
      run its experts inside them), or the layer loop of moejax.offload.layered_steps (LayerByLayer);
    - its saturation threshold Θ (`theta`; `theta_mode` names the weight channel Eq. 1 models, None: no copies);
    - its counters (`stats`) and how it describes itself (`describe`)."""

    name: ClassVar[str] = "resident"
    layer_by_layer: ClassVar[bool] = False  # the steps run MoE layers from Python (layer_runtime)
    theta_mode: ClassVar[str | None] = None  # moejax.plan.theta.MODES: Θ applies to this placement
    profiles_theta: ClassVar[bool] = False  # Θ may be measured on it (moejax.measure.saturation)
    continuous_batching: ClassVar[bool] = True  # its steps share one paged KV pool across a step's rows
    steps_need_weights: ClassVar[bool] = False  # make_steps takes the weights (the Engine builds them on first use)
    # the model holds runs of like layers as stacked weights and its whole-model jits scan over them (one program
    # per kind of layer, however deep; moejax.models.layer_runs); placements that address layers one by one do not
    stacks_layers: ClassVar[bool] = False
    # batch_invariant's fixed-tile kernels cover its steps (the whole model in one device's jits)
    runs_batch_invariant: ClassVar[bool] = False
    # Why it cannot generate (prefill into a KV cache, decode), or None: it can. Read before the weights load, so a
    # run refuses such requests up front instead of failing each batch.
    no_generation: ClassVar[str | None] = None
    # Why it keeps no prefix KV pool across scoring batches (kv_cache then runs off), or None: it can.
    no_prefix_pool: ClassVar[str | None] = None
    # Whether a static generation batch's prefill reads and stores prefix-pool blocks (else it computes every prompt
    # token: the same results, the pool serving scoring and continuous batching only).
    static_prefill_pool: ClassVar[bool] = True
    # --explain runs one decode call and sets it beside the plan's prediction (launch.serve: lightning's probe)
    probed_at_explain: ClassVar[bool] = False
    # The memory budget (moejax.offload.memory_budget.BudgetRules): a class that defines `budget` is a value of the
    # `placement` option and sizes budgets; the classes that run its budgets under a layout or settings inherit or
    # name it. auto_rank: placement auto tries the budget sizers in this order (None: auto never sizes it).
    offloads: ClassVar[bool] = False  # routed experts live in host memory (all or a share of them)
    takes_staging: ClassVar[bool] = False  # pinned_staging_mb applies: its HostStore copies through a pinned buffer
    auto_rank: ClassVar[int | None] = None
    # how a layout's devices share a budget sized as for one device (said in the budget's reason)
    per_device: ClassVar[str] = "each device holds its share of the weights"

    def __init__(self, budget: MemoryBudget, layout_setup: LayoutSetup | None = None) -> None:
        self.memory_budget = budget  # moejax.offload.memory_budget.MemoryBudget
        self.layout_setup = layout_setup  # moejax.sharding.setup.LayoutSetup, or None on one device
        self.staging_bytes: int | None = None  # pageable experts through a pinned buffer of this size (HostStore)

    @classmethod
    def applies(cls, budget: MemoryBudget, settings: PlacementSettings, layout_setup: LayoutSetup | None) -> bool:
        """Whether this class runs the memory budget's placement under the settings and the layout."""
        raise NotImplementedError

    @classmethod
    def build(cls, budget: MemoryBudget, settings: PlacementSettings, layout_setup: LayoutSetup | None) -> Placement:
        return cls(budget, layout_setup).staged(settings)

    def staged(self, settings: PlacementSettings) -> Self:
        """Takes the settings' pinned staging buffer (pinned_staging_mb) -> self."""
        mb = settings.pinned_staging_mb
        self.staging_bytes = None if mb is None else int(mb * 2**20)
        return self

    # -- the memory budget ----------------------------------------------------------------------------------------
    @classmethod
    def sizes_budgets(cls) -> bool:
        """Whether this class is a value of the `placement` option (it defines `budget` itself)."""
        return "budget" in vars(cls)

    @classmethod
    def budget(cls, model: ModelBytes, ask: BudgetAsk, auto: bool) -> MemoryBudget | None:
        """The memory budget of this placement for the model's bytes and what the settings ask, or None: placement
        auto (`auto`) passes it over here; MemoryBudgetError with the numbers when it does not fit."""
        raise NotImplementedError

    @classmethod
    def budget_at_load(cls, cfg: ModelConfig, shapes: dict, settings: PlacementSettings, plan: EnginePlan,
                       dtype: DTypeLike, profile: Callable[[], Profile]) -> tuple[MemoryBudget, str] | None:
        """moejax.load's budget of this placement when it is made its own way: -> (budget, a decision to report),
        or None (the default): the budget its `budget` sizes (moejax.placements.budget.budget_for)."""
        return None

    @classmethod
    def auto_instead(cls, cfg: ModelConfig, shapes: dict, settings: PlacementSettings, chosen: MemoryBudget,
                     plan: EnginePlan, dtype: DTypeLike, profile: Callable[[], Profile]
                     ) -> tuple[MemoryBudget, str] | None:
        """placement auto on one device, after bytes and step times chose `chosen`: this placement's budget instead
        and why, or None (the default: bytes and step times decide alone)."""
        return None

    @classmethod
    def expert_device_bytes(cls, budget: MemoryBudget) -> int:
        return budget.moe_layers * budget.layer_expert_bytes

    @classmethod
    def describe_experts(cls, budget: MemoryBudget) -> str:
        return "all routed experts on the device"

    @classmethod
    def predicted_step(cls, cfg: ModelConfig, profile: Profile, budget: MemoryBudget, tokens: int
                       ) -> PlacementOption:
        """Predicted seconds of a prefill step of `tokens` tokens under `budget` (moejax.plan.placement): compute
        only."""
        c = step_costs(cfg, profile, budget, tokens)
        return PlacementOption(cls.name, c.dense + c.moe * c.per_layer, "compute only")

    @property
    def layout(self) -> Layout | None:
        """The resolved moejax.sharding.Layout, or None on one device."""
        return None if self.layout_setup is None else self.layout_setup.layout

    @property
    def devices(self) -> int:
        layout = self.layout
        if layout is None:
            return 1
        assert layout.devices is not None  # a LayoutSetup's layout is resolved
        return layout.devices

    # -- the model ----------------------------------------------------------------------------------------------
    def experts_runner(self) -> Callable[[MoEBlock, jax.Array, str], jax.Array]:
        """How each MoE block runs its routed experts inside the whole-model jits (MoEBlock's experts_runner)."""
        return LocalExperts() if self.layout_setup is None or self.layout_setup.run_experts is None else \
            self.layout_setup.run_experts

    def split_batch(self) -> Callable[[jax.Array], jax.Array] | None:
        """The hidden-state row split of a data-parallel layout (MoEModel's split_batch), or None."""
        return None if self.layout_setup is None else self.layout_setup.split_batch

    # -- the weights --------------------------------------------------------------------------------------------
    def new_store(self) -> Store:
        """Where the routed experts go at materialize (a HostStore, DEP's expert group), or None: in the params."""
        return None

    def place(self, path: tuple, array: Any, store: Store) -> Any:
        """A checkpoint or preset tensor -> what the params hold for it (the placement may keep the array itself
        in `store` and give the params a stand-in)."""
        return self.layout_setup.place(path, array) if self.layout_setup is not None else jax.device_put(array)

    # -- the steps ------------------------------------------------------------------------------------------------
    def make_steps(self, graphdef: nnx.GraphDef, kernels: Kernels, config: ModelConfig, params: nnx.State | None = None,
                   store: Store = None) -> Steps:
        """The steps a forward runs (moejax.steps.protocol.Steps): here the whole-model jits,
        which need no weights; a layer-by-layer placement builds its loop over `params` and `store`."""
        return WholeModelSteps(graphdef, kernels)

    def at_load(self, config: ModelConfig, find_profile: Callable[[], Profile]) -> None:
        """At load, the hardware profile for choices the placement makes while it runs (`find_profile()` resolves
        it, only if called): none here; DEP's online FinDEP solver plans each step shape on it."""

    def theta(self, config: ModelConfig, find_profile: Callable[[], Profile]) -> ThetaEstimate | None:
        """Θ at load: Eq. 1 in this placement's channel (moejax.plan.theta), None without copies to hide."""
        return theta_at_load(config, self.theta_mode, self.devices, find_profile)

    # -- reporting ----------------------------------------------------------------------------------------------
    def stats(self, steps: LayeredSteps | None) -> dict:
        """Engine.stats(): counters since load or reset (`steps`: the layer loop, None for whole-model jits)."""
        return {"placement": self.name}

    def reset_stats(self, steps: LayeredSteps | None) -> None:
        pass

    def describe(self, steps: LayeredSteps | None) -> str | None:
        """A line for Engine.explain() after the memory budget's (None: nothing to add)."""
        return None

    def decode_pool_room(self, config: ModelConfig) -> tuple[float, str] | None:
        """The bytes the continuous-batching pool may take when it does not live in device memory (lightning: host
        memory), with where that number comes from; None: the device budget decides (moejax.sched.pool_size)."""
        return None

    def scheduler_defaults(self) -> dict:
        """Keywords of the continuous-batching Scheduler this placement sets unless the run gives them."""
        return {}

    def predicted_pipeline(self, config: ModelConfig, profile: Profile, max_batch_tokens: int) -> Simulation | None:
        """The predicted timeline of a pipelined placement's step on `profile` (what `--explain --plot` draws as a
        Gantt chart), or None: nothing pipelined to draw."""
        return None


class LayerByLayer(Placement):
    """A placement whose MoE layers run from Python (moejax.offload.layered_steps): `layer_runtime` gives the object
    that supplies each MoE layer's experts to the loop, and counters and description come from it."""

    layer_by_layer = True
    steps_need_weights = True

    def make_steps(self, graphdef: nnx.GraphDef, kernels: Kernels, config: ModelConfig, params: nnx.State | None = None,
                   store: Store = None) -> LayeredSteps:
        assert params is not None  # a layer loop is built with the weights (Engine.steps)
        return self.steps_class()(graphdef, params, kernels, self.layer_runtime(store, kernels, config))

    def layer_runtime(self, store: Store, kernels: Kernels, config: ModelConfig) -> LayerRuntime:
        """What supplies each MoE layer's experts to the loop (LayeredSteps' `placement`)."""
        raise NotImplementedError

    def steps_class(self) -> type[LayeredSteps]:
        """The layer loop's class (moejax.offload.layered_steps.LayeredSteps unless the placement drives its own)."""
        return LayeredSteps

    def stats(self, steps: LayeredSteps | None) -> dict:
        assert steps is not None  # a layer loop's
        runtime = steps.placement
        # the expert cache's own bookkeeping (its hits count a prefetch still queued; LayerStats' count it a miss)
        cache = runtime.cache_stats()
        return {"placement": runtime.name, **runtime.stats.as_dict({} if cache is None else {"cache": cache})}

    def reset_stats(self, steps: LayeredSteps | None) -> None:
        assert steps is not None
        steps.placement.reset_stats()

    def describe(self, steps: LayeredSteps | None) -> str:
        assert steps is not None
        return "placement " + steps.placement.describe()

    def place(self, path: tuple, array: Any, store: Store) -> Any:
        """Routed experts into the store, a 0-d stand-in in the params; the rest as resident."""
        if is_routed_expert(path):
            store.add(path, array)
            return jnp.zeros((), array.dtype)
        return super().place(path, array, store)
