"""What `moejax.load` runs, as data: the placement and its settings, the layout and its settings, the hardware profile
that `auto` choices consult and the workload they are made for. `load(model, plan=EnginePlan(...))` and today's
keyword form `load(model, placement=..., layout=..., ...)` meet here: `from_options` turns the keywords into a
plan, and every setting is checked once, when its dataclass is built."""
from __future__ import annotations

import dataclasses

from moejax import options
from moejax.layout import Layout
from moejax.offload.settings import PlacementSettings
from moejax.options import option


@dataclasses.dataclass(frozen=True)
class Workload:
    """The step `auto` plans for: `tokens` per forward step in sequences of `seq_len` (serve: --max-batch-tokens)."""
    tokens: int = option(8192, minimum=1, flag=False, help="tokens of the step auto plans for (load: plan_tokens)")
    seq_len: int = option(1024, minimum=1, help="prompt tokens of the sequences auto and lightning's policy search "
                                                 "plan for (load: plan_seq_len)")
    gen_len: int = option(128, minimum=2, help="tokens generated per sequence, for lightning's policy search and "
                                               "placement auto's KV check (load: plan_gen_len)")

    def __post_init__(self) -> None:
        options.check(self, prefix="moejax.load: plan_")


WORKLOAD_OPTIONS = {f"plan_{f.name}": f.name for f in options.fields(Workload)}  # load's keyword -> field


@dataclasses.dataclass(frozen=True)
class EnginePlan:
    placement: PlacementSettings = PlacementSettings()
    layout: Layout | str | None = option(  # a Layout (fields may be "auto"), "auto", or None: one device
        None, type=str, checked=False,
        help="spread the model over devices, e.g. attn=dp,experts=ep (keys: attn dp|tp|pp; experts replicated|tp|ep|"
             "async_ep|dep|pp; devices=N; exchange=all_to_all|gather; dep: attn_devices, expert_devices, r1, r2, order "
             "asas|aass|pppipe, each may be auto (FinDEP's solver); attn=pp,experts=pp: pipeline stages, prefill-only "
             "scoring, microbatches=M; see moejax.sharding), or auto: the layout the planner predicts fastest "
             "(--explain says why)")
    profile: str | None = option(  # None: the devices' own (moejax.plan.resolve)
        None, type=str,
        help="hardware profile that auto choices and --theta eq1 consult: h100, h200, a100, l4, t4 or a JSON from "
             "`python -m launch.profile_devices` (default: the one measured for these devices, else their datasheet)")
    workload: Workload = Workload()

    def __post_init__(self) -> None:
        if isinstance(self.layout, str) and self.layout != "auto":
            try:
                object.__setattr__(self, "layout", Layout.parse(self.layout))
            except ValueError as e:
                raise ValueError(f"moejax.load: {e}") from None
        if not isinstance(self.placement, PlacementSettings):
            raise TypeError(f"moejax.load: plan.placement must be a PlacementSettings, got {type(self.placement)}")

    @classmethod
    def from_options(cls, given: dict) -> EnginePlan:
        """load's keyword options (those of PLAN_OPTIONS; None means not given) -> EnginePlan."""
        given = {k: v for k, v in given.items() if v is not None}
        placement = PlacementSettings(**{k: v for k, v in given.items() if k in PlacementSettings.names()})
        workload = Workload(**{WORKLOAD_OPTIONS[k]: v for k, v in given.items() if k in WORKLOAD_OPTIONS})
        return cls(placement, given.get("layout"), given.get("profile"), workload)

    @property
    def needs_planner(self) -> bool:
        """Some choice is left to a planner: layout auto, or a DEP layout with auto fields."""
        return self.layout == "auto" or (isinstance(self.layout, Layout) and bool(self.layout.auto_fields))


# load's keywords of a plan: EnginePlan's own (layout, profile), the Workload's and the placement settings
PLAN_OPTIONS = tuple(f.name for f in options.fields(EnginePlan)) + tuple(WORKLOAD_OPTIONS) + PlacementSettings.names()
