"""`python -m launch.dispatch_probe [--out FILE]`: what a decode call's dispatch waits for on this device.

`bench generate` measured on an H200 that the continuous scheduler's decode call returns only after about as long as
the device takes to run it: the dispatch is synchronous, so the scheduler's host work cannot overlap the device's.
This runs bench generate's GPU workload once under continuous batching with the step recorder
(launch/step_overhead.py), then replays its decode calls back to back without waiting between them, in variants that
each remove one suspect, and times how long each call takes to return (the device's time is the wait at the end):

  as run           the recorded calls: numpy inputs, pool and carry donated
  inputs on device the rows put on the device before the timed loop
  no donation      the same program jitted without donate_argnums
  exit checked     that, with the token loop's early exit checked every token (moejax/token_loop.py)
  guard            one call under jax.transfer_guard_device_to_host("disallow"): a read back to the host inside the
                   dispatch raises, and the error says which

A variant whose calls return in far less than the device's time per call has found the wait."""
from __future__ import annotations

import argparse
import functools
import json
import os
import tempfile
import time

import jax
import numpy as np

import moejax
from moejax import paged_steps, token_loop
from moejax.sched.batch import serve_lines
from moejax.sched.serving_options import ServingOptions
from launch import bench_generate, generate_workloads, step_overhead


def _timed(method, pool, carry, calls, on_device: bool) -> dict:
    args = [step_overhead._as_run(c) for c in calls]
    if on_device:
        args = jax.block_until_ready(jax.device_put(args))
    returns, t0 = [], time.perf_counter()
    for call, a in zip(calls, args):
        t = time.perf_counter()
        pool, carry, out = method(pool, carry, *a, **call.kwargs)
        returns.append(time.perf_counter() - t)
    jax.block_until_ready((pool, carry, out))
    wall = time.perf_counter() - t0
    return dict(calls=len(calls), mean_return_ms=1e3 * float(np.mean(returns)),
                median_return_ms=1e3 * float(np.median(returns)), wall_ms_per_call=1e3 * wall / len(calls))


def loops() -> None:
    """`--loops`: one jit of 8 matmuls [1024, 1024] chained, as a fori_loop, a while_loop on a device predicate and
    unrolled: does a call return before the device has finished? (a separate question from the model's)"""
    x = jax.random.normal(jax.random.key(0), (1024, 1024), jax.numpy.float32)
    w = jax.random.normal(jax.random.key(1), (1024, 1024), jax.numpy.float32) / 32

    def fori(x):
        return jax.lax.fori_loop(0, 8, lambda i, y: jax.numpy.tanh(y @ w), x)

    def unrolled(x):
        for _ in range(8):
            x = jax.numpy.tanh(x @ w)
        return x

    def early(x):
        return jax.lax.while_loop(lambda c: (c[0] < 8) & (c[1].sum() != 0), lambda c: (c[0] + 1, jax.numpy.tanh(
            c[1] @ w)), (0, x))[1]
    for name, f in (("fori_loop", fori), ("unrolled", unrolled), ("while_loop, device predicate", early)):
        f = jax.jit(f)
        jax.block_until_ready(f(x))
        returns, t0 = [], time.perf_counter()
        y = x
        for _ in range(50):
            t = time.perf_counter()
            y = f(y)
            returns.append(time.perf_counter() - t)
        jax.block_until_ready(y)
        wall = (time.perf_counter() - t0) / 50
        print(f"{name:30s} call returns {1e3 * np.median(returns):.3f} ms, wall {1e3 * wall:.3f} ms per call",
              flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="pycode-moe")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-new", type=int, default=256)
    p.add_argument("--out", default=None)
    p.add_argument("--loops", action="store_true", help=loops.__doc__)
    a = p.parse_args()
    if a.loops:
        return loops()
    where = argparse.Namespace(model=a.model, num_layers=None, seed=0, no_transformers=True)
    engine = moejax.load(bench_generate._checkpoint(where, "/tmp")[0], dtype="float32", compilation_cache=False)
    cfg = engine.config
    stops = tuple(cfg.eos_token_ids) + (588,)
    reqs = generate_workloads.log_uniform(a.requests, cfg.vocab_size, (32, 512), (8, a.max_new), stops, 0)
    lines = bench_generate._lines(reqs)
    serving = ServingOptions(batching="continuous")
    with tempfile.TemporaryDirectory() as d:  # a fresh output file each run: an existing one is resumed
        serve_lines(engine, lines, os.path.join(d, "warm.jsonl"), serving, seed_nonce=0)  # compiles
        recorder = step_overhead.StepRecorder(engine)
        try:
            serve_lines(engine, lines, os.path.join(d, "timed.jsonl"), serving, seed_nonce=0)
        finally:
            recorder.close()
    calls = [c for c in recorder.calls if c.method == "paged_decode"]
    print(f"{len(calls)} decode calls of {len(recorder.calls)} recorded", flush=True)
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        (recorder.pool, recorder.carry))

    def fresh(which: int):  # zeros of the run's pool (0) or carry (1): every pass starts from the same kind of input
        return jax.tree.map(lambda s: jax.numpy.zeros(s.shape, s.dtype, device=s.sharding), like[which])
    method = recorder.methods["paged_decode"]

    def undonated():  # the step jitted anew without donate_argnums, traced under the token loop's setting of the time
        step = jax.jit(functools.partial(paged_steps.decode, engine._graphdef, engine.kernels),
                       static_argnames=("steps",))
        return functools.partial(step, engine.params)

    def twice(m, on_device: bool) -> dict:  # the first pass compiles what this variant's inputs need
        _timed(m, fresh(0), fresh(1), calls, on_device)
        return _timed(m, fresh(0), fresh(1), calls, on_device)
    rows: dict = {"as run": twice(method, False), "inputs on device": twice(method, True),
                  "no donation": twice(undonated(), False)}
    os.environ[token_loop.CHECK_VARIABLE] = "1"  # read when the new jit traces: the early exit checked every token
    try:
        rows["no donation, exit checked every token"] = twice(undonated(), False)
    finally:
        del os.environ[token_loop.CHECK_VARIABLE]
    try:
        with jax.transfer_guard_device_to_host("disallow"):
            method(fresh(0), fresh(1), *step_overhead._as_run(calls[0]), **calls[0].kwargs)
        rows["guard"] = "no read back to the host inside the dispatch"
    except Exception as e:  # noqa: BLE001 - the error is the finding
        rows["guard"] = f"{type(e).__name__}: {e}"[:2000]
    record = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, decode_calls=len(calls), variants=rows)
    for name, r in rows.items():
        print(f"{name:18s} {r if isinstance(r, str) else json.dumps(r)}", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
