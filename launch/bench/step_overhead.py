"""Where a continuous-batching run's step time goes (`bench generate`). The scheduler (moejax.sched.continuous)
measures each step's wall time, from dispatch to its result on the host with the host work in between (Stats:
chunk_s, decode_s). `StepRecorder` keeps every step call of a run (its inputs, its result arrays and the seconds the
call itself took to return: converting the inputs and dispatching); `replay` then runs the same step programs on the
same inputs again, back to back, each waited for: the device's time plus one dispatch and one wait, with no host
bookkeeping between them. The overhead share of a step kind is 1 - replayed / measured: the part of the scheduler's
step time the device was not computing that step. It is a lower bound: the replay's own dispatch and wait count as
computing, and the replay runs each program compiled and warm, as the timed run did. On a CPU the "device" is the
host's own cores, so the share is near zero and may come out negative (noise); only a GPU run says where it stands."""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import TypeVar

import jax
import numpy as np

from moejax.engine import Engine
from moejax.models.kv_pool import Layer

StepMethod = Callable[..., tuple[list[Layer], jax.Array, jax.Array]]  # Engine.paged_chunk, .paged_decode
T = TypeVar("T")
STEPS = ("paged_chunk", "paged_decode")  # the Engine methods the scheduler's steps call
KIND = {"paged_chunk": "chunk", "paged_decode": "decode"}


@dataclasses.dataclass
class Call:
    method: str
    args: tuple  # after the pool and the carry: the step's rows (moejax.steps.rows)
    kwargs: dict
    out: object  # the call's result besides the pool (tokens, on the device)
    call_s: float  # host seconds until the call returned (inputs converted, program dispatched)


class StepRecorder:
    """Records the step calls made on `engine` (instance attributes shadow its methods until `close`)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.calls: list[Call] = []
        self.pool: list[Layer] | None = None
        self.carry: jax.Array | None = None
        self.methods = {name: getattr(engine, name) for name in STEPS}
        for name, method in self.methods.items():
            setattr(engine, name, self._recording(name, method))

    def _recording(self, name: str, method: StepMethod) -> StepMethod:
        def call(pool: list[Layer], carry: jax.Array, *args: object, **kwargs: object
                 ) -> tuple[list[Layer], jax.Array, jax.Array]:
            t0 = time.perf_counter()
            self.pool, self.carry, out = method(pool, carry, *args, **kwargs)
            self.calls.append(Call(name, args, kwargs, out, time.perf_counter() - t0))
            return self.pool, self.carry, out
        return call

    def close(self) -> None:
        for name in STEPS:
            delattr(self.engine, name)


def _as_run(call: Call) -> tuple:
    """A decode call's inputs made to run as many device-loop iterations as it did in the run: each row's budget is
    the tokens it made and no token stops it, its input token from the host (the replay's pool holds other KV, so
    its samples differ)."""
    if call.method != "paged_decode":
        return call.args
    rows, = call.args
    made = (np.asarray(call.out) >= 0).sum(axis=1).astype(np.int32)
    return (dataclasses.replace(rows, chain=np.zeros_like(rows.chain), budget=made,
                                stops=np.full_like(rows.stops, -1)),)


def _live(pool: T) -> T:
    """The run's last pool, or zeros of its shapes where a step consumed it (donated): the same compiled programs."""
    return jax.tree.map(lambda a: jax.numpy.zeros(a.shape, a.dtype, device=a.sharding) if a.is_deleted() else a, pool)


def replay(recorder: StepRecorder) -> list[float]:
    """Seconds of each recorded call run again on its own inputs, in order, each waited for."""
    pool, carry, seconds = _live(recorder.pool), _live(recorder.carry), []
    for call in recorder.calls:
        method = recorder.methods[call.method]
        t0 = time.perf_counter()
        pool, carry, out = method(pool, carry, *_as_run(call), **call.kwargs)
        jax.block_until_ready(out)
        seconds.append(time.perf_counter() - t0)
    return seconds


def step_times(recorder: StepRecorder, replayed: list[float], scheduler: dict, wall_s: float) -> dict:
    """Per step kind: steps, the scheduler's wall seconds and mean, the calls' own seconds, the replayed seconds and
    the overhead share; for the whole run: the replayed steps' share of its wall time and the rest."""
    out: dict[str, dict] = {}
    for name, kind in KIND.items():
        calls = [(c, s) for c, s in zip(recorder.calls, replayed, strict=True) if c.method == name]
        wall, replay_s = scheduler[f"{kind}_s"], sum(s for _, s in calls)
        out[kind] = dict(steps=scheduler[f"{kind}_steps"], calls_recorded=len(calls), wall_s=wall,
                         mean_step_ms=1e3 * wall / len(calls) if calls else None,
                         call_s=sum(c.call_s for c, _ in calls), replayed_s=replay_s,
                         mean_replayed_ms=1e3 * replay_s / len(calls) if calls else None,
                         overhead_share=1 - replay_s / wall if wall > 0 else None)
    busy = sum(replayed)
    out["run"] = dict(wall_s=wall_s, replayed_s=busy, overhead_share=1 - busy / wall_s if wall_s > 0 else None)
    return out


def describe(times: dict) -> str:
    def share(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.0%}"
    parts = [f"{kind} {t['calls_recorded']} x {t['mean_step_ms'] or 0:.2f} ms "
             f"(replayed {t['mean_replayed_ms'] or 0:.2f}"
             f" ms; overhead {share(t['overhead_share'])})" for kind, t in times.items() if kind != "run"]
    run = times["run"]
    return (", ".join(parts) + f"; run {run['wall_s']:.2f} s, steps replayed {run['replayed_s']:.2f} s "
            f"(overhead {share(run['overhead_share'])})")
