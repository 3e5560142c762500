"""Run a list of command steps under one time budget, each in its own process group, and keep going past any
step that fails, times out or cannot start: every step ends with a status, its seconds and a one-line detail.
The gpu check (`launch.gpu_check`) is the user: a lease on a GPU machine is short, and one broken step must
never hide what the others measured."""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable
from typing import TextIO

MIN_START_S = 15.0  # a step needs at least this much of the budget left to start
UNFINISHED = ("failed", "timeout", "skipped")  # the statuses a second call would run again


@dataclasses.dataclass
class Step:
    name: str
    what: str  # one line: what the step shows
    commands: list[list[str]]  # run in order; the first that fails ends the step
    timeout_s: float
    read: Callable[[], str] | None = None  # after the commands (even failed ones): reads outputs, returns a detail
    absent: str | None = None  # why the step does not exist yet (recorded, not run, not a failure)


@dataclasses.dataclass
class StepResult:
    name: str
    what: str
    status: str  # passed, failed, timeout, skipped, absent
    seconds: float
    detail: str

    def ok(self) -> bool:
        return self.status in ("passed", "absent")


def _tail(path: str, lines: int = 15) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


def _run(argv: list[str], log: TextIO, timeout_s: float, env: dict) -> int | None:
    """Exit status, or None when it ran past timeout_s (then its whole process group is killed)."""
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=max(timeout_s, 1.0))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return None


def run_step(step: Step, log_path: str, deadline: float, env: dict | None = None) -> StepResult:
    if step.absent:
        return StepResult(step.name, step.what, "absent", 0.0, step.absent)
    left = deadline - time.monotonic()
    if left < MIN_START_S:
        return StepResult(step.name, step.what, "skipped", 0.0, f"not started: {max(left, 0):.0f} s of the budget left")
    t0, status, detail = time.monotonic(), "passed", ""
    for argv in step.commands:
        with open(log_path, "a") as log:
            log.write(f"\n===== {step.name}: {' '.join(argv)}\n")
            log.flush()
            left = min(step.timeout_s - (time.monotonic() - t0), deadline - time.monotonic())
            code = _run(argv, log, left, env or dict(os.environ))
        if code is None:
            status, detail = "timeout", f"stopped after {time.monotonic() - t0:.0f} s"
            break
        if code != 0:
            status, detail = "failed", f"exit status {code} from {' '.join(argv[:4])}"
            break
    if step.read is not None:
        try:
            read = step.read()
        except Exception as e:  # a step whose outputs cannot be read is a failed step, not a crashed check
            read, status = f"its outputs could not be read: {type(e).__name__}: {e}", "failed"
        detail = f"{detail}; {read}" if detail and read else detail or read
    if status != "passed":
        with open(log_path, "a") as log:
            log.write(f"===== {step.name}: {status} ({detail})\n")
    return StepResult(step.name, step.what, status, time.monotonic() - t0, detail)


def run_steps(steps: Iterable[Step], log_path: str, budget_s: float, env: dict | None = None,
              echo: Callable[[str], None] = print,
              after: Callable[[list[StepResult]], object] | None = None) -> list[StepResult]:
    """`steps` may be a generator: each step is built when its turn comes (after the steps before it ran).
    after(results so far) runs after each step (the caller writes what it has)."""
    deadline, results = time.monotonic() + budget_s, []
    for step in steps:
        echo(f"[{step.name}] {step.what}")
        result = run_step(step, log_path, deadline, env)
        results.append(result)
        echo(f"[{step.name}] {result.status} in {result.seconds:.1f} s{': ' + result.detail if result.detail else ''}")
        if result.status in ("failed", "timeout"):
            echo(_tail(log_path))
        if after is not None:
            after(results)
    return results


def table(results: list[StepResult]) -> str:
    rows = [("step", "status", "seconds", "detail")] + [
        (r.name, r.status.upper() if not r.ok() else r.status, f"{r.seconds:.1f}", r.detail) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return "\n".join(f"{a:{widths[0]}s}  {b:{widths[1]}s}  {c:>{widths[2]}s}  {d}" for a, b, c, d in rows)
