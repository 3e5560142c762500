"""Where the continuous-batching scheduler's time goes, per kind of step (chunk, decode) and for the loop around
them, in phases:

- admit, retire: the loop's own bookkeeping (admission, block allocation, releasing finished sequences);
- prepare: building a step's host inputs (rows, tokens, block tables, sampling parameters);
- compile: the step call when its shape is new in this run (tracing, lowering and compiling happen inside it,
  unless the process compiled that shape before); what JAX itself reports spending on tracing, lowering and
  backend compiling meanwhile is counted apart (`jax_compile`);
- dispatch: the step call for a shape already compiled (copying its host inputs, enqueueing the program);
- deliver: results of retired sequences handed on (detokenising, writing) while the step runs;
- wait: blocking on the step's sampled tokens (device compute the host work did not cover);
- update: appending the tokens, stop checks, publishing prefix blocks.

The sum over phases is the scheduler's wall time; `wait` over it is the device's share the host could not hide,
the rest is host work on the critical path."""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from moejax.compiles import Compiles, counting

PHASES = ("admit", "retire", "prepare", "compile", "dispatch", "deliver", "wait", "update")
KINDS = ("loop", "chunk", "decode")


class StepTimes:
    def __init__(self) -> None:
        self.seconds = {kind: dict.fromkeys(PHASES, 0.0) for kind in KINDS}
        self.steps = dict.fromkeys(KINDS, 0)  # the loop's: its iterations
        self.jax_compile = Compiles()

    def listening(self) -> contextlib.AbstractContextManager[Compiles]:
        """Count JAX's own tracing, lowering and compiling (every program of this process) meanwhile."""
        return counting(self.jax_compile)

    @contextlib.contextmanager
    def phase(self, kind: str, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[kind][name] += time.perf_counter() - t0

    def as_dict(self) -> dict:
        """Seconds per kind and phase, and per step of each kind in milliseconds (phases that took no time left
        out)."""
        out: dict[str, object] = {}
        for kind in KINDS:
            spent = {p: s for p, s in self.seconds[kind].items() if s}
            steps = self.steps[kind]
            out[kind] = dict(steps=steps, seconds=spent, total_s=sum(spent.values()),
                             ms_per_step={p: 1e3 * s / steps for p, s in spent.items()} if steps else {})
        host = sum(s for kind in KINDS for p, s in self.seconds[kind].items() if p not in ("wait", "compile"))
        out["host_s"] = host  # the critical path's host work, compiling apart
        out["compile_s"] = sum(self.seconds[kind]["compile"] for kind in KINDS)
        out["jax_compile_s"] = dict(self.jax_compile.seconds)
        out["wait_s"] = sum(self.seconds[kind]["wait"] for kind in KINDS)
        steps = self.steps["chunk"] + self.steps["decode"]
        out["host_ms_per_step"] = 1e3 * host / steps if steps else None
        return out

    def describe(self) -> str:
        return describe(self.as_dict())


def describe(d: dict) -> str:
    """One line of StepTimes.as_dict()'s figures (what launch.bench generate prints)."""
    parts = [f"{kind} {d[kind]['steps']} steps: " + ", ".join(f"{p} {v:.2f}" for p, v in d[kind]["ms_per_step"].items())
             + " ms/step" for kind in ("chunk", "decode") if d[kind]["steps"]]
    return (f"host {d['host_s']:.2f} s ({d['host_ms_per_step'] or 0:.2f} ms a step), first calls of new shapes "
            f"{d['compile_s']:.2f} s, wait {d['wait_s']:.2f} s; " + "; ".join(parts))
