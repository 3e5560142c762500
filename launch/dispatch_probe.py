"""`python -m launch.dispatch_probe [--model M] [--dtype D] [--batch B] [--out FILE]`: what a decode call's dispatch
waits for on this device.

`bench generate` measured on an H200 that the continuous scheduler's decode call returns only after about as long as
the device takes to run it: the dispatch is synchronous, so the scheduler's host work cannot overlap the device's.
This runs bench generate's GPU workload once under continuous batching with the step recorder
(launch/bench/step_overhead.py), then replays its decode calls back to back without waiting between them, in variants
that each remove one suspect, and times how long each call takes to return (the device's time is the wait at the end):

  as run           the recorded calls: numpy inputs, pool and carry donated
  inputs on device the rows put on the device before the timed loop
  no donation      the same program jitted without donate_argnums
  exit checked     that, with the token loop's early exit checked every token (moejax/steps/token_loop.py): a while_loop
                   whose trip count XLA cannot know
  fixed trip count that, with the exit never checked inside the call: a fori_loop of a known trip count, numpy
                   inputs and inputs on the device
  guard            one call under jax.transfer_guard_device_to_host("disallow"): a read back to the host inside the
                   dispatch raises, and the error says which

A variant whose calls return in far less than the device's time per call has found the wait. The settings XLA
reads at start-up are flags of the probe (moejax/serving/xla_startup.py: --command-buffers, --tfrt-gpu-client,
--mem-fraction), applied before JAX starts: a run compares the variants under one setting, and the GPU check runs it
with and without command buffers. The record also holds the continuous scheduler's own account of the recorded run
(the host's share of a decode step: launch/bench/decode.py's host_share).

--model, --num-layers, --dtype: the engine (a real-shaped preset's weights are drawn on the device). --batch B: B
requests of --prompt-len tokens making --max-new tokens each, at once, with B decode rows (without it: --requests
log-uniform requests, bench generate's GPU workload)."""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time
from typing import Any

import jax
import numpy as np

import moejax
from launch.bench import decode as bench_decode
from launch.bench import generate as bench_generate
from launch.bench import generate_workloads, step_overhead
from launch.bench.provenance import git_commit
from launch.bench.results import ResultsFile
from moejax.models.kv_pool import BLOCK, Layer
from moejax.sched.batch import serve_lines
from moejax.sched.serving_options import ServingOptions
from moejax.serving import xla_startup
from moejax.steps import paged_phases, token_loop

# jaxlib 0.10.2 and 0.11.1 (jaxlib/xla_client.py, generate_pjrt_gpu_plugin_options) pass this variable to the
# CUDA plugin as its `use_tfrt_gpu_client` option: the probe's --tfrt-gpu-client sets it.
TFRT_NOTE = ("XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT=1 asks the CUDA plugin for its TFRT GPU client (jaxlib 0.10.2 "
             "and 0.11.1 pass it as the plugin option use_tfrt_gpu_client): --tfrt-gpu-client")


def _timed(method: step_overhead.StepMethod, pool: list[Layer], carry: jax.Array, calls: list[step_overhead.Call],
           on_device: bool) -> dict:
    args: list[tuple] = [step_overhead._as_run(c) for c in calls]
    if on_device:
        args = jax.block_until_ready(jax.device_put(args))
    returns, t0 = [], time.perf_counter()
    for call, a in zip(calls, args, strict=True):
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

    def fori(x: jax.Array) -> jax.Array:
        return jax.lax.fori_loop(0, 8, lambda i, y: jax.numpy.tanh(y @ w), x)

    def unrolled(x: jax.Array) -> jax.Array:
        for _ in range(8):
            x = jax.numpy.tanh(x @ w)
        return x

    def early(x: jax.Array) -> jax.Array:
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
    p.add_argument("--model", default="pycode-moe", help="preset or checkpoint directory")
    p.add_argument("--num-layers", type=int, default=None, help="the model's first N layers")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--batch", type=int, default=None, help="B requests at once, B decode rows")
    p.add_argument("--prompt-len", type=int, default=64, help="--batch's prompt tokens")
    p.add_argument("--requests", type=int, default=32, help="without --batch: log-uniform requests")
    p.add_argument("--max-new", type=int, default=256, help="tokens each request makes at most")
    p.add_argument("--out", default=None)
    p.add_argument("--loops", action="store_true", help=loops.__doc__)
    xla_startup.add_arguments(p)
    a = p.parse_args()
    for flag, value in (("--batch", a.batch), ("--prompt-len", a.prompt_len), ("--requests", a.requests),
                        ("--max-new", a.max_new), ("--num-layers", a.num_layers)):
        if value is not None and value < 1:
            p.error(f"{flag} must be >= 1; got {value}")
    startup = xla_startup.apply(a)  # before JAX's backend starts
    if a.loops:
        return loops()
    where = argparse.Namespace(model=a.model, num_layers=a.num_layers, seed=0, no_transformers=True)
    path, options = bench_generate._checkpoint(where, "/tmp")
    engine = moejax.load(path, dtype=a.dtype, compilation_cache=False, **options)
    cfg = engine.config
    # bench generate's GPU workload on pycode-moe also stops at 588 (a frequent token); --batch: the eos alone
    stops = tuple(cfg.eos_token_ids) + ((588,) if not a.batch and 588 < cfg.vocab_size else ())
    if a.batch:
        reqs = generate_workloads.log_uniform(a.batch, cfg.vocab_size, (a.prompt_len,) * 2, (a.max_new,) * 2,
                                              stops, 0)
    else:
        reqs = generate_workloads.log_uniform(a.requests, cfg.vocab_size, (32, 512), (8, a.max_new), stops, 0)
    lines = bench_generate._lines(reqs)
    # --batch: a pool of what the batch needs (with a block a row to spare), not the device's free memory: the
    # replays hold a second pool of the same size
    sizes: dict[str, Any] = {"max_rows": a.batch, "kv_pool_mb": a.batch * (a.prompt_len + a.max_new + 2 * BLOCK)
            * engine.kv_bytes_per_token() / 2**20} if a.batch else {}
    serving = ServingOptions(batching="continuous", **sizes)
    with tempfile.TemporaryDirectory() as d:  # a fresh output file each run: an existing one is resumed
        serve_lines(engine, lines, os.path.join(d, "warm.jsonl"), serving, seed_nonce=0)  # compiles
        recorder = step_overhead.StepRecorder(engine)
        try:
            summary = serve_lines(engine, lines, os.path.join(d, "timed.jsonl"), serving, seed_nonce=0)
        finally:
            recorder.close()
    calls = [c for c in recorder.calls if c.method == "paged_decode"]
    if not calls:
        raise SystemExit(f"dispatch_probe: the run made no decode call ({summary['requests_ok']} of {len(reqs)} "
                         "requests served): nothing to replay; a longer --max-new?")
    print(f"{len(calls)} decode calls of {len(recorder.calls)} recorded", flush=True)
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        (recorder.pool, recorder.carry))

    # zeros of the run's pool (0) or carry (1): every pass starts from the same kind of input
    def fresh(which: int) -> Any:
        return jax.tree.map(lambda s: jax.numpy.zeros(s.shape, s.dtype, device=s.sharding), like[which])
    method = recorder.methods["paged_decode"]

    # the step jitted anew without donate_argnums, traced under the token loop's setting of the time
    def undonated() -> step_overhead.StepMethod:
        step = jax.jit(functools.partial(paged_phases.decode, engine._graphdef, engine.kernels),
                       static_argnames=("steps",))
        return functools.partial(step, engine.params)

    # the first pass compiles what this variant's inputs need
    def twice(m: step_overhead.StepMethod, on_device: bool) -> dict:
        _timed(m, fresh(0), fresh(1), calls, on_device)
        return _timed(m, fresh(0), fresh(1), calls, on_device)
    rows: dict = {"as run": twice(method, False), "inputs on device": twice(method, True),
                  "no donation": twice(undonated(), False)}
    steps = max(int(c.kwargs.get("steps", 1)) for c in calls)  # the token loop's iterations a call
    for name, every, on_device in (("no donation, exit checked every token", 1, False),
                                   ("no donation, fixed trip count", steps, False),
                                   ("no donation, fixed trip count, inputs on device", steps, True)):
        before = os.environ.get(token_loop.CHECK_VARIABLE)
        os.environ[token_loop.CHECK_VARIABLE] = str(every)  # read when the new jit traces
        try:
            rows[name] = twice(undonated(), on_device)
        finally:
            if before is None:
                del os.environ[token_loop.CHECK_VARIABLE]
            else:
                os.environ[token_loop.CHECK_VARIABLE] = before
    try:
        with jax.transfer_guard_device_to_host("disallow"):
            method(fresh(0), fresh(1), *step_overhead._as_run(calls[0]), **calls[0].kwargs)
        rows["guard"] = "no read back to the host inside the dispatch"
    except Exception as e:  # noqa: BLE001 - the error is the finding
        rows["guard"] = f"{type(e).__name__}: {e}"[:2000]
    record = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, jaxlib=jax.lib.__version__,
                  git=dict(commit=git_commit()[0]),
                  command=" ".join(["python -m launch.dispatch_probe"] + sys.argv[1:]), xla_startup=startup,
                  config=dict(model=a.model, num_layers=cfg.num_layers, dtype=a.dtype, batch=a.batch,
                              prompt_len=a.prompt_len if a.batch else None, requests=len(reqs), max_new=a.max_new),
                  decode_calls=len(calls), decode_rows=sorted({int(np.shape(c.args[0].start)[0]) for c in calls}),
                  variants=rows,
                  scheduler_host_share_of_decode=bench_decode.host_share(summary["scheduler"]),
                  tfrt_gpu_client=TFRT_NOTE)
    for name, r in rows.items():
        print(f"{name:18s} {r if isinstance(r, str) else json.dumps(r)}", flush=True)
    share = record["scheduler_host_share_of_decode"]
    print(f"scheduler: decode host share {share['share'] or 0:.1%} ({share['share_without_dispatch'] or 0:.1%} "
          f"without the dispatch), {share['host_ms_per_step'] or 0:.2f} ms host a step", flush=True)
    if a.out:  # one more run in the file, as the benchmarks' results files (launch/bench/results.py)
        ResultsFile(a.out).complete(record)


if __name__ == "__main__":
    main()
