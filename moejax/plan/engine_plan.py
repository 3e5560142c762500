"""What `moejax.load` runs, as data: the placement and its settings, the layout and its settings, the hardware profile
that `auto` choices consult and the workload they are made for. `load(model, plan=EnginePlan(...))` and today's
keyword form `load(model, placement=..., layout=..., ...)` meet here: `from_options` turns the keywords into a
plan, and every setting is checked once, when its dataclass is built."""
from __future__ import annotations

import dataclasses

from moejax.offload.settings import PlacementSettings
from moejax.sharding.layout import Layout

PLAN_OPTIONS = ("layout", "profile", "plan_tokens", "plan_seq_len") + PlacementSettings.names()


@dataclasses.dataclass(frozen=True)
class Workload:
    """The step `auto` plans for: `tokens` per forward step in sequences of `seq_len` (serve: --max-batch-tokens)."""
    tokens: int = 8192
    seq_len: int = 1024

    def __post_init__(self):
        for name in ("tokens", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"moejax.load: plan_{name} must be an int >= 1, got {value!r}")


@dataclasses.dataclass(frozen=True)
class EnginePlan:
    placement: PlacementSettings = PlacementSettings()
    layout: Layout | str | None = None  # a Layout (fields may be "auto"), "auto", or None: one device
    profile: str | None = None  # datasheet name or measured profile JSON; None: the devices' own (moejax.plan.resolve)
    workload: Workload = Workload()

    def __post_init__(self):
        if isinstance(self.layout, str) and self.layout != "auto":
            try:
                object.__setattr__(self, "layout", Layout.parse(self.layout))
            except ValueError as e:
                raise ValueError(f"moejax.load: {e}") from None
        if not isinstance(self.placement, PlacementSettings):
            raise TypeError(f"moejax.load: plan.placement must be a PlacementSettings, got {type(self.placement)}")

    @classmethod
    def from_options(cls, options: dict) -> "EnginePlan":
        """load's keyword options (those of PLAN_OPTIONS; None means not given) -> EnginePlan."""
        given = {k: v for k, v in options.items() if v is not None}
        placement = PlacementSettings(**{k: v for k, v in given.items() if k in PlacementSettings.names()})
        workload = Workload(**{k[len("plan_"):]: v for k, v in given.items() if k in ("plan_tokens", "plan_seq_len")})
        return cls(placement, given.get("layout"), given.get("profile"), workload)

    @property
    def needs_planner(self) -> bool:
        """Some choice is left to a planner: layout auto, or a DEP layout with auto fields."""
        return self.layout == "auto" or (isinstance(self.layout, Layout) and bool(self.layout.auto_fields))
