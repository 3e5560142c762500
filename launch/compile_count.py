"""Programs JAX traces, lowers and compiles while a block runs, counted from its monitoring events: how many XLA
programs a benchmark's run compiled, by function, and the seconds each phase took. A run whose programs another
run compiled before it counts none (JAX's in-process caches): `jax.clear_caches()` first makes a run pay for all
of its own."""
from __future__ import annotations

import collections
import contextlib

from jax import monitoring

PHASES = {"/jax/core/compile/jaxpr_trace_duration": "trace_s",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
          "/jax/core/compile/backend_compile_duration": "compile_s"}
_counting: list[Compiles] = []  # the blocks running now (nested blocks each count)
_listening = False


class Compiles:
    def __init__(self):
        self.seconds = dict.fromkeys(PHASES.values(), 0.0)
        self.programs: collections.Counter = collections.Counter()  # XLA compilations by function name
        self.compile_s: collections.Counter = collections.Counter()  # their seconds, by function name

    def add(self, event: str, seconds: float, fun_name: str) -> None:
        phase = PHASES.get(event)
        if phase is None:
            return
        self.seconds[phase] += seconds
        if phase == "compile_s":
            self.programs[fun_name] += 1
            self.compile_s[fun_name] += seconds

    def as_dict(self) -> dict:
        return dict(programs=sum(self.programs.values()), by_function=dict(self.programs.most_common()),
                    compile_s_by_function={k: round(v, 3) for k, v in self.compile_s.most_common()},
                    **{k: round(v, 3) for k, v in self.seconds.items()})


def _listen(event: str, seconds: float, **info) -> None:
    for c in _counting:
        c.add(event, seconds, info.get("fun_name", "?"))


@contextlib.contextmanager
def counting():
    """with counting() as c: ...; c.as_dict() -> {programs, by_function, compile_s_by_function, trace_s, lower_s,
    compile_s}."""
    global _listening
    if not _listening:  # JAX keeps listeners for the process: register one, once
        monitoring.register_event_duration_secs_listener(_listen)
        _listening = True
    c = Compiles()
    _counting.append(c)
    try:
        yield c
    finally:
        _counting.remove(c)
