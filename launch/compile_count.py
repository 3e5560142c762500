"""Programs JAX traces, lowers and compiles while a block runs, counted from its monitoring events: how many XLA
programs a benchmark's run compiled, by function, and the seconds each phase took. A run whose programs another
run compiled before it counts none (JAX's in-process caches): `jax.clear_caches()` first makes a run pay for all
of its own."""
from __future__ import annotations

import collections
import contextlib

from jax import monitoring

from moejax.sched.step_times import JAX_EVENTS  # event -> phase: trace, lower, backend

FIELDS = dict(trace="trace_s", lower="lower_s", backend="compile_s")


class Compiles:
    def __init__(self):
        self.seconds = dict.fromkeys(JAX_EVENTS.values(), 0.0)
        self.programs: collections.Counter = collections.Counter()  # XLA compilations by function name
        self.compile_s: collections.Counter = collections.Counter()  # their seconds, by function name

    def add(self, event: str, seconds: float, fun_name: str = "?", **_) -> None:
        phase = JAX_EVENTS.get(event)
        if phase is None:
            return
        self.seconds[phase] += seconds
        if phase == "backend":
            self.programs[fun_name] += 1
            self.compile_s[fun_name] += seconds

    def as_dict(self) -> dict:
        return dict(programs=sum(self.programs.values()), by_function=dict(self.programs.most_common()),
                    compile_s_by_function={k: round(v, 3) for k, v in self.compile_s.most_common()},
                    **{FIELDS[phase]: round(v, 3) for phase, v in self.seconds.items()})


@contextlib.contextmanager
def counting():
    """with counting() as c: ...; c.as_dict() -> {programs, by_function, compile_s_by_function, trace_s, lower_s,
    compile_s}."""
    c = Compiles()
    monitoring.register_event_duration_secs_listener(c.add)
    try:
        yield c
    finally:
        monitoring.unregister_event_duration_listener(c.add)
