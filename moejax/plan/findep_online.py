"""FinDEP's online phase (Pan et al. §4): the solver runs again for each step shape the engine meets, not once for the
planned workload. A DEP layout whose r1, r2 or order was "auto" keeps them in `Layout.online`; for every step
DisaggregatedSteps asks `OnlineDep.layout_for` the layout to run, which is the load's with (r1, r2, order) solved for
the step's shape (rows, tokens per row) on the layout's fixed groups (A, B), from a cache of solutions or solved now
(`moejax.plan.findep.solve_step`, timed). Fields the user gave stay as given (pinned values win).

The shape is the step as the executor runs it, padding included: rows (a bucket, a multiple of A) and tokens per row
(the row-length bucket; 1 in a decode step). r1 is searched only over the micro-batch counts that split the rows into
equal multiples of A (the executor's micro-batches then shard evenly over the attention group). The cost model is
the solver's: a decode step (one token per row) is modelled as sequences of one token, so the attention's reads of
the earlier context are not counted. Solutions are kept for the engine's life (the step shapes are few: rows and
lengths come in buckets; Engine.reset_stats leaves them and their hit counts); `as_dict` / `describe` report per
shape the schedule, the solve time and the hits (Engine.stats()["online"], --explain)."""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from moejax.config import ModelConfig
from moejax.layout import Layout
from moejax.plan.findep import solve_step
from moejax.plan.hardware import Profile

ONLINE_FIELDS = ("r1", "r2", "order")  # what a step may change; the groups (A, B) hold the weights and stay


@dataclasses.dataclass
class StepSchedule:
    """The schedule of one step shape and how it was found: solve_s, the solver's own time; hits, the steps of this
    shape served from the cache since; predicted_s, the solver's time for the step (None: not solved, see why)."""
    rows: int
    tokens_per_row: int
    r1: int
    r2: int
    order: str
    solve_s: float
    predicted_s: float | None
    hits: int = 0
    why: str = ""  # set when the solver could not plan the shape and the load's values run instead

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class OnlineDep:
    """Per step shape (rows, tokens per row): (r1, r2, order) from the cache, or solved and cached. `layout`: the
    resolved DEP layout, its `online` fields the ones to solve; `find_profile`: the hardware profile the solver
    plans on (resolved at the first solve)."""

    def __init__(self, config: ModelConfig, layout: Layout, find_profile: Callable[[], Profile]) -> None:
        if layout.experts != "dep" or layout.attn_devices is None or layout.expert_devices is None:
            raise ValueError(f"online FinDEP: needs a resolved DEP layout, got {layout}")
        unknown = set(layout.online) - set(ONLINE_FIELDS)
        if not layout.online or unknown:
            raise ValueError(f"online FinDEP: layout.online must name some of {', '.join(ONLINE_FIELDS)}, got "
                             f"{layout.online}")
        self.config, self.layout, self._find_profile = config, layout, find_profile
        self._profile: Profile | None = None
        self.schedules: dict[tuple[int, int], StepSchedule] = {}

    def layout_for(self, rows: int, tokens_per_row: int, *, count: bool = True) -> Layout:
        """The layout a step of this shape runs: the load's, with its online fields as solved for the shape (count:
        a cache hit is a step served; False for a look ahead at the split a step will use)."""
        s = self.schedule(rows, tokens_per_row, count=count)
        return dataclasses.replace(self.layout, r1=s.r1, r2=s.r2, order=s.order)

    def schedule(self, rows: int, tokens_per_row: int, *, count: bool = True) -> StepSchedule:
        if rows < 1 or tokens_per_row < 1:
            raise ValueError(f"online FinDEP: a step of {rows} rows x {tokens_per_row} tokens has no tokens")
        key = (rows, tokens_per_row)
        found = self.schedules.get(key)
        if found is not None:
            found.hits += count
            return found
        found = self.schedules[key] = self._solve(rows, tokens_per_row)
        return found

    def _solve(self, rows: int, tokens_per_row: int) -> StepSchedule:
        lay = self.layout
        assert lay.attn_devices is not None and lay.expert_devices is not None  # checked in __init__
        if self._profile is None:
            self._profile = self._find_profile()  # not timed: a step pays it once, whatever the shape
        held = {f: getattr(lay, f) for f in ("r2", "order") if f not in lay.online}
        r1s = even_micro_batches(rows, lay.attn_devices) if "r1" in lay.online else [lay.r1]
        start = time.perf_counter()
        try:
            choice = solve_step(self.config, self._profile, attn_devices=lay.attn_devices,
                                expert_devices=lay.expert_devices, rows=rows, tokens_per_row=tokens_per_row,
                                r1_choices=r1s, **held)
        except ValueError as e:  # the step runs anyway: on the load's values (r1 as near as the rows split evenly)
            r1 = max(r for r in r1s if r <= lay.r1) if min(r1s) <= lay.r1 else min(r1s)
            return StepSchedule(rows, tokens_per_row, r1, lay.r2, lay.order, time.perf_counter() - start, None,
                                why=str(e))
        return StepSchedule(rows, tokens_per_row, choice.r1, choice.r2, choice.order, time.perf_counter() - start,
                            choice.predicted_s)

    # -- reporting ------------------------------------------------------------------------------------------------
    def as_dict(self) -> dict:
        solves = list(self.schedules.values())
        return {"fields": list(self.layout.online), "shapes": len(solves), "hits": sum(s.hits for s in solves),
                "solve_s_total": sum(s.solve_s for s in solves),
                "solve_s_max": max((s.solve_s for s in solves), default=0.0),
                "schedules": [s.as_dict() for s in solves]}

    def describe(self) -> str:
        d = self.as_dict()
        head = (f"online FinDEP: {', '.join(self.layout.online)} re-solved per step shape; {d['shapes']} shapes "
                f"solved ({d['solve_s_total'] * 1e3:.1f} ms in all, at most {d['solve_s_max'] * 1e3:.1f} ms), "
                f"{d['hits']} steps from the cache")
        lines = [head]
        for s in self.schedules.values():
            why = f" (not solved: {s.why}; the load's values)" if s.why else ""
            lines.append(f"  {s.rows} rows x {s.tokens_per_row} tokens: r1={s.r1} r2={s.r2} order={s.order}, "
                         f"solved in {s.solve_s * 1e3:.2f} ms, {s.hits} hits{why}")
        return "\n".join(lines)


def even_micro_batches(rows: int, attn_devices: int) -> list[int]:
    """Micro-batch counts r1 that cut `rows` into equal micro-batches of a multiple of `attn_devices` rows (rows not
    a multiple of the devices: 1, the whole step)."""
    if rows % attn_devices:
        return [1]
    per_device = rows // attn_devices
    return [r for r in range(1, per_device + 1) if per_device % r == 0]
