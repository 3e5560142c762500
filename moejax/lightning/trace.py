"""When each of the pipeline's tasks ran, measured without serialising them: the executor registers every task it
dispatches with the arrays it produces; a thread polls them (jax.Array.is_ready) in launch order per resource and
stamps a task's end when its outputs are ready. Its start is the later of its dispatch and the end of the task
before it on the same resource (each resource runs its tasks in order: the device's stream, the host's attention
jits, each direction of the link), so the timeline is an estimate within the polling interval. Opt-in: the thread
takes CPU time from the host's attention.

Resources: "device" (PREATTN, POSTATTN), "host" (CPUATTN), "link h2d" (LOADH, W_PINTOG), "link d2h" (OFFLOADQKV)."""
from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Any

import jax

from moejax.lightning.schedule import ATTN, LOAD, OFFLOAD, PAGE, POST, PRE, Task

RESOURCES = {PRE: "device", POST: "device", ATTN: "host", LOAD: "link h2d", PAGE: "link h2d", OFFLOAD: "link d2h"}
POLL_S = 50e-6


@dataclasses.dataclass(frozen=True)
class MeasuredEvent:
    resource: str
    task: Task
    start: float  # seconds since the trace began
    end: float

    @property
    def label(self) -> str:
        return f"{self.task.op}({self.task.layer},{self.task.micro_batch})"


class Timeline:
    """start() -> record(task, outputs) for each task dispatched -> stop() -> events."""

    def __init__(self) -> None:
        self.events: list[MeasuredEvent] = []
        self._queues: dict[str, collections.deque] = {r: collections.deque() for r in set(RESOURCES.values())}
        self._last_end: dict[str, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.t0 = 0.0

    def start(self) -> Timeline:
        self.t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def record(self, task: Task, outputs: Any) -> None:
        arrays = [a for a in jax.tree.leaves(outputs) if isinstance(a, jax.Array)]
        with self._lock:
            self._queues[RESOURCES[task.op]].append((task, time.perf_counter() - self.t0, arrays))

    def stop(self) -> list[MeasuredEvent]:
        """Wait for every recorded task, then end the thread."""
        for q in list(self._queues.values()):
            for _, _, arrays in list(q):
                jax.block_until_ready([a for a in arrays if not a.is_deleted()])
        while any(self._queues.values()):
            time.sleep(POLL_S)
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.events.sort(key=lambda e: (e.start, e.end))
        return self.events

    def _poll(self) -> None:
        while not self._stop.is_set():
            now = time.perf_counter() - self.t0
            with self._lock:
                for resource, q in self._queues.items():
                    while q and all(_done(a) for a in q[0][2]):
                        task, dispatched, _ = q.popleft()
                        start = max(dispatched, self._last_end.get(resource, 0.0))
                        self._last_end[resource] = now
                        self.events.append(MeasuredEvent(resource, task, start, max(now, start)))
            time.sleep(POLL_S)


def _done(a: jax.Array) -> bool:
    """Ready, or donated to a later task (the host's KV pool): that task runs after it on the same resource."""
    # jax.Array's stub lacks is_ready; the arrays have it
    return a.is_deleted() or a.is_ready()  # type: ignore[attr-defined]


def busy(events: list[MeasuredEvent]) -> dict[str, float]:
    """Seconds each resource was busy (its tasks' spans, which do not overlap on one resource)."""
    out: dict[str, float] = collections.defaultdict(float)
    for e in events:
        out[e.resource] += e.end - e.start
    return dict(out)
