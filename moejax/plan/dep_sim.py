"""A discrete-event simulator of the DEP pipeline (FinDEP §3.2): what the attention group (AG), the expert group
(EG) and the two transfer paths between them (A2E, E2A) do, task by task, for one forward pass, to cross-check the
closed-form objective of `moejax.plan.findep` and to draw Gantt charts from.

The four resources are Eq. 5's: each runs one task at a time (rules 1-5), and, as a device stream runs what JAX
dispatched to it, in dispatch order: a task starts when its resource has finished the task dispatched before it
and its inputs are ready (rules 6-9), never earlier to fill a gap. The dispatch order is moejax.sharding.dep's:

    for each layer t, for each micro-batch i:   [combine of (t-1, i)] attention(t, i), then its r2 chunks
                                                (A2E -> experts -> E2A each), then
        asas:   shared(t, i) right after attention(t, i) on the AG;
        pppipe: shared(t, i) right after attention(t, i), and the chunks' A2E wait for it (shared is part of
                attention, MegaScale-Infer's ping-pong pipeline; r2 = 1 there);
    aass: after every attention of layer t, shared(t, 0), ..., shared(t, r1 - 1).

The combine of micro-batch i (residual + routed + shared outputs) is dispatched just before its next-layer attention
and takes no time here: attention(t+1, i) waits for every E2A of (t, i) and for shared(t, i) (rule 9). A dense layer
(no experts) is one AG task per micro-batch. Every chunk of a micro-batch lasts the same (the planner times the
largest of the executor's padded chunks); a model without shared experts has no shared tasks.

`simulate` returns (makespan of one pass, events), the events `Event(resource, label, start, end)` tuples (seconds
from the start of the pass) with resource in RESOURCES and label "<task> L<layer> m<micro-batch>[ c<chunk>]", task
one of attn, shared, dense, a2e, experts, e2a (e.g. "experts L3 m1 c0"): enough for a Gantt chart, one row per
resource."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple, Protocol

from moejax.config import ModelConfig
from moejax.plan.hardware import Profile

RESOURCES = ("AG", "A2E", "EG", "E2A")
SIM_ORDERS = ("asas", "aass", "pppipe")


class Event(NamedTuple):
    resource: str  # one of RESOURCES
    label: str  # "<task> L<layer> m<micro-batch>[ c<chunk>]"
    start: float  # seconds from the start of the pass
    end: float


@dataclasses.dataclass(frozen=True)
class TaskTimes:
    """Seconds per task: attention/shared/dense per micro-batch on one AG device, experts per chunk on one EG
    device, a2e/e2a per chunk on the transfer path."""
    attention: float
    shared: float
    experts: float
    a2e: float
    e2a: float
    dense: float = 0.0


class Simulation(NamedTuple):
    """(makespan, events): unpacks as the pair a Gantt chart takes."""
    makespan: float  # seconds, one pass
    events: tuple[Event, ...]

    def busy(self, resource: str) -> float:
        """Seconds the resource works during the pass."""
        return sum(e.end - e.start for e in self.events if e.resource == resource)


class DepScheduleLike(Protocol):
    """What simulate_schedule reads of a moejax.plan.findep.DepSchedule (which imports this module); read-only, as a
    frozen dataclass's fields are."""
    @property
    def profile(self) -> str: ...
    @property
    def task_times(self) -> TaskTimes: ...
    @property
    def r1(self) -> int: ...
    @property
    def r2(self) -> int: ...
    @property
    def order(self) -> str: ...


class _Resources:
    """Per resource the time it becomes free; `run` places a task after it and after its inputs."""

    def __init__(self) -> None:
        self.free = dict.fromkeys(RESOURCES, 0.0)
        self.events: list[Event] = []

    def run(self, resource: str, label: str, ready: float, seconds: float) -> float:
        start = max(self.free[resource], ready)
        end = start + seconds
        self.free[resource] = end
        self.events.append(Event(resource, label, start, end))
        return end


def simulate(times: TaskTimes, *, layers: Sequence[bool], r1: int, r2: int, order: str) -> Simulation:
    """One pass of `layers` (True: a MoE layer, False: dense) over r1 micro-batches with r2 chunks each."""
    if order not in SIM_ORDERS:
        raise ValueError(f"simulate: order must be one of {', '.join(SIM_ORDERS)}, got {order!r}")
    if r1 < 1 or r2 < 1:
        raise ValueError(f"simulate: r1 and r2 must be >= 1, got r1={r1}, r2={r2}")
    res = _Resources()
    ready = [0.0] * r1  # when each micro-batch's input to the next layer is complete (its combine)
    for t, moe in enumerate(layers):
        if not moe:
            ready = [res.run("AG", f"dense L{t} m{i}", ready[i], times.dense) for i in range(r1)]
            continue
        ready = _moe_layer(res, times, t, ready, r2, order)
    return Simulation(max(ready, default=0.0), tuple(res.events))


def _moe_layer(res: _Resources, times: TaskTimes, t: int, ready: list[float], r2: int, order: str) -> list[float]:
    has_shared = times.shared > 0
    attn_end, shared_end, back = [], [], []
    for i, r in enumerate(ready):
        attn_end.append(res.run("AG", f"attn L{t} m{i}", r, times.attention))
        if has_shared and order != "aass":  # asas and pppipe: shared right after its attention
            shared_end.append(res.run("AG", f"shared L{t} m{i}", attn_end[i], times.shared))
        release = shared_end[i] if order == "pppipe" and has_shared else attn_end[i]
        back.append(_chunks(res, times, t, i, release, r2))
    if has_shared and order == "aass":
        shared_end = [res.run("AG", f"shared L{t} m{i}", attn_end[i], times.shared) for i in range(len(ready))]
    if not has_shared:
        return back
    return [max(b, s) for b, s in zip(back, shared_end, strict=True)]


def _chunks(res: _Resources, times: TaskTimes, t: int, i: int, release: float, r2: int) -> float:
    """A2E -> experts -> E2A for each chunk of micro-batch i; returns when the last one is back."""
    last = release
    for j in range(r2):
        tag = f"L{t} m{i} c{j}"
        sent = res.run("A2E", f"a2e {tag}", release, times.a2e)
        done = res.run("EG", f"experts {tag}", sent, times.experts)
        last = max(last, res.run("E2A", f"e2a {tag}", done, times.e2a))
    return last


def simulate_schedule(cfg: ModelConfig, profile: Profile | None, schedule: DepScheduleLike,
                      layers: int | Sequence[bool] | None = None) -> Simulation:
    """Simulate one pass of a `moejax.plan.findep.DepSchedule` (its task times, r1, r2 and order) over cfg's layers
    (layers: None for all of them, an int for the first that many, or the MoE flags themselves). `profile` must be
    the one the schedule was made with (the task times come from the schedule). The schedule's predicted_s covers
    all its passes: compare it with makespan x schedule.passes."""
    if profile is not None and getattr(profile, "name", schedule.profile) != schedule.profile:
        raise ValueError(f"simulate_schedule: the schedule was made for profile {schedule.profile!r}, "
                         f"not {profile.name!r}")
    flags: Sequence[bool] = cfg.moe_layers[:layers] if layers is None or isinstance(layers, int) else layers
    return simulate(schedule.task_times, layers=flags, r1=schedule.r1, r2=schedule.r2, order=schedule.order)
