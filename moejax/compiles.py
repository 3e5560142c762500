"""Programs JAX traces, lowers and compiles while a block runs, counted from its monitoring events: how many XLA
programs a run compiled, by function, and the seconds each phase took (the continuous scheduler's time breakdown,
moejax.sched.step_times, and `launch.bench generate`). A run whose programs another run compiled before it counts
none (JAX's in-process caches): `jax.clear_caches()` first makes a run pay for all of its own. Every thread's
compiles count while a block runs."""
from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator

from jax import monitoring

EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
          "/jax/core/compile/backend_compile_duration": "backend"}
FIELDS = dict(trace="trace_s", lower="lower_s", backend="compile_s")


class Compiles:
    def __init__(self) -> None:
        self.seconds = dict.fromkeys(EVENTS.values(), 0.0)
        self.programs: collections.Counter[str] = collections.Counter()  # XLA compilations by function name
        self.compile_s: collections.defaultdict[str, float] = collections.defaultdict(float)  # their seconds, by name

    def add(self, event: str, duration_secs: float, **kwargs: str | int) -> None:
        """jax.monitoring's event-duration listener: `fun_name` among the keywords names the compiled function."""
        phase = EVENTS.get(event)
        if phase is None:
            return
        self.seconds[phase] += duration_secs
        if phase == "backend":
            fun_name = str(kwargs.get("fun_name", "?"))
            self.programs[fun_name] += 1
            self.compile_s[fun_name] += duration_secs

    def as_dict(self) -> dict:
        by_seconds = sorted(self.compile_s.items(), key=lambda kv: kv[1], reverse=True)  # as Counter.most_common
        return dict(programs=sum(self.programs.values()), by_function=dict(self.programs.most_common()),
                    compile_s_by_function={k: round(v, 3) for k, v in by_seconds},
                    **{FIELDS[phase]: round(v, 3) for phase, v in self.seconds.items()})


@contextlib.contextmanager
def counting(c: Compiles | None = None) -> Iterator[Compiles]:
    """with counting() as c: ...; c.as_dict() -> {programs, by_function, compile_s_by_function, trace_s, lower_s,
    compile_s}. Given a Compiles, adds to it."""
    c = Compiles() if c is None else c
    monitoring.register_event_duration_secs_listener(c.add)
    try:
        yield c
    finally:
        monitoring.unregister_event_duration_listener(c.add)
