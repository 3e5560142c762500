"""`python -m launch.bench generate --decode-batches 1,64,256,1024`: continuous batching alone at fixed batches, for a
whole real-shaped model: output tokens/s, time per output token (TPOT) and MBU.

For each batch B: `--requests-per-batch` x B requests of `--prompt-len` random tokens, each making exactly
`--output-len` tokens (no stop token: the scheduler is driven directly, so a random model's eos ends nothing), under
the continuous scheduler (moejax.sched.continuous) with B decode rows (its max_rows), one decode call a step, and a KV
pool of what B sequences need. More requests than rows keep the rows full: a sequence that ends makes room for one
whose prompt a chunk step prefills meanwhile, as in a serving engine's throughput benchmark. Each batch runs once
untimed with its prefill-only run (compiling the programs no batch before it compiled: a short GPU call's time is
scarce; seconds per program from JAX's own events, moejax/compiles.py), then `--repeats` times timed, each timed
run paired with a prefill-only run of the same requests (one output token each).

Decode time = the pair's difference. Every decode call is logged as it is dispatched (its rows, their positions,
the tokens each makes): a token iteration is one token for every row of a call, and
- TPOT = decode time / token iterations: how long a running sequence waits for each token;
- bytes = the sum over iterations of what it must read (launch/bench/decode_bytes.py: the weights, the experts its rows
  route to, each row's KV up to its position), written out; MBU = bytes / decode time / the measured copy ceiling
  (launch/gpu_ceilings.py's device stream, or --copy-gbps).
The scheduler's own account of the timed run (Stats.times: host work against waiting on the device) gives the host
share of a decode step."""
from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from typing import Any, cast

import jax
import numpy as np

from launch import gpu_ceilings
from launch.bench import decode_bytes
from moejax import compiles
from moejax.engine import Engine
from moejax.models.kv_pool import BLOCK, Layer
from moejax.sched.continuous import GenRequest, Scheduler
from moejax.steps.rows import PagedDecodeRows

HOST_PHASES = ("prepare", "dispatch", "update", "deliver")  # a decode step's host work (Stats.times' phases)


def batches_of(text: str) -> list[int]:
    try:
        batches = [int(b) for b in text.split(",") if b.strip()]
    except ValueError:
        raise SystemExit(f"bench generate: --decode-batches {text!r}: expected comma-separated whole numbers") from None
    if not batches or min(batches) < 1:
        raise SystemExit(f"bench generate: --decode-batches {text!r}: expected batches >= 1")
    return batches


def _requests(engine: Engine, batch: int, prompt_len: int, output_len: int, seed: int) -> list[GenRequest]:
    rng = np.random.default_rng(seed)
    key = jax.random.key(seed)
    return [GenRequest(rng.integers(1, engine.config.vocab_size, prompt_len).tolist(), output_len,
                       np.asarray(jax.random.key_data(jax.random.fold_in(key, i))), tag=i) for i in range(batch)]


def _failed(request: GenRequest, message: str) -> None:
    raise RuntimeError(f"bench generate: request {request.tag} failed: {message}")


class LoggedDecode:
    """`engine` whose paged_decode logs each call's token iterations as it is dispatched: per iteration, the rows
    that make a token and the sum of the positions they attend to (every other attribute is the engine's)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.iterations: list[tuple[int, int]] = []  # [(rows, tokens attended in all)]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def paged_decode(self, pool: list[Layer], carry: jax.Array, rows: PagedDecodeRows, *, steps: int
                     ) -> tuple[list[Layer], jax.Array, jax.Array]:
        start, budget = np.asarray(rows.start), np.asarray(rows.budget)
        for j in range(int(budget.max(initial=0))):
            alive = budget > j
            self.iterations.append((int(alive.sum()), int((start[alive] + j + 1).sum())))
        return self._engine.paged_decode(pool, carry, rows, steps=steps)


def _run(engine: Engine, reqs: list[GenRequest], batch: int, args: argparse.Namespace
         ) -> tuple[float, dict, int, list[tuple[int, int]]]:
    """One scheduler run: (wall seconds, its Stats.as_dict(), output tokens, the decode iterations LoggedDecode
    logged). The pool holds B whole sequences in the prefill-only run too: a pool of another size is another
    program to compile, inside the timed run."""
    blocks = batch * -(-(args.prompt_len + args.output_len) // BLOCK)
    made: list[int] = []
    logged = LoggedDecode(engine)
    # LoggedDecode passes for the Engine: every attribute but paged_decode is the engine's
    sched = Scheduler(cast(Engine, logged), blocks, max_rows=batch, chunk_tokens=args.chunk_tokens,
                      row_tokens=min(args.row_tokens, args.chunk_tokens), decode_steps=args.decode_steps,
                      decode_calls=1)
    t0 = time.perf_counter()
    sched.run(reqs, lambda r, tokens, cached: made.append(len(tokens)), _failed)
    wall = time.perf_counter() - t0
    stats = sched.stats.as_dict()
    sched.pool = sched.carry = None  # the next run's pool may need all of this one's memory
    gc.collect()
    return wall, stats, sum(made), logged.iterations


def host_share(stats: dict) -> dict:
    """A decode step's host work against its whole time, from the scheduler's phases (compiling apart)."""
    d = stats["breakdown"]["decode"]["seconds"]
    host = sum(d.get(p, 0.0) for p in HOST_PHASES)
    total = host + d.get("wait", 0.0)
    steps = stats["breakdown"]["decode"]["steps"]
    # where the dispatch itself waits for the device (XLA:GPU with a loop in the program, bench/README.md), its
    # seconds are the device's, not host work: the share without them says how much of the step is the host's own
    own = host - d.get("dispatch", 0.0)
    return dict(host_s=host, wait_s=d.get("wait", 0.0), share=host / total if total else None,
                share_without_dispatch=own / total if total else None,
                host_ms_per_step=1e3 * host / steps if steps else None, dispatch_ms_per_step=(
                    1e3 * d.get("dispatch", 0.0) / steps if steps else None), phases=HOST_PHASES)


def decode_batches(engine: Engine, args: argparse.Namespace, config: dict, environment: dict,
                   partial: Callable[[dict, str], None]) -> dict:
    batches = batches_of(args.decode_batches)
    for flag in ("prompt_len", "requests_per_batch", "chunk_tokens", "row_tokens", "decode_steps", "repeats"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"bench generate: --{flag.replace('_', '-')} must be >= 1; got {getattr(args, flag)}")
    if args.output_len < 2:
        raise SystemExit(f"bench generate: --output-len must be >= 2 (a decode step after the prompt's token); got "
                         f"{args.output_len}")
    cfg = engine.config
    ceiling = gpu_ceilings.measured("device_stream", args.copy_gbps)
    print(f"copy ceiling {ceiling['value']:.1f} GB/s ({ceiling['method']})", flush=True)
    param_bytes, kv_token = engine.param_bytes(), engine.kv_bytes_per_token()
    results: list[dict] = []

    def record() -> dict:
        return dict(**environment, benchmark="generate --decode-batches", config=config, copy_ceiling=ceiling,
                    method=__doc__.split("\n\n")[1].replace("\n", " "), results=results)
    for batch in batches:
        timed = _requests(engine, batch * args.requests_per_batch, args.prompt_len, args.output_len, args.seed)
        prefill_only = [GenRequest(r.prompt, 1, r.key, tag=r.tag) for r in timed]
        with compiles.counting() as first:
            first_s = _run(engine, timed, batch, args)[0]
            _run(engine, prefill_only, batch, args)  # anything it compiles besides
        pairs = []
        for _ in range(args.repeats):
            prefill_s = _run(engine, prefill_only, batch, args)[0]
            wall, stats, made, iterations = _run(engine, timed, batch, args)
            pairs.append((prefill_s, wall))
        if made != len(timed) * args.output_len:
            raise RuntimeError(f"batch {batch}: made {made} tokens, not {len(timed)} x {args.output_len}")
        prefill_s = float(np.median([p for p, _ in pairs]))
        wall = float(np.median([w for _, w in pairs]))
        counted = decode_bytes.iterations_bytes(cfg, param_bytes, engine.dtype.itemsize, kv_token, iterations)
        # a decode time within the runs' noise (the prefill-only run as long: a tiny model on a shared CPU) has no
        # rate: None rather than a huge number
        decode_s = wall - prefill_s if wall > prefill_s else None
        tpot = decode_s / len(iterations) if decode_s else None
        row = dict(batch=batch, requests=len(timed), prompt_len=args.prompt_len, output_len=args.output_len,
                   output_tokens=made, seconds=[w for _, w in pairs], prefill_only_seconds=[p for p, _ in pairs],
                   wall_s=wall, prefill_only_s=prefill_s, decode_s=decode_s, output_tokens_per_s=made / wall,
                   decode_tokens_per_s=counted["tokens"] / decode_s if decode_s else None,
                   tpot_ms=1e3 * tpot if tpot else None, decode_iterations=len(iterations),
                   mean_rows=counted["tokens"] / len(iterations), bytes=counted,
                   achieved_gb_per_s=counted["total"] / decode_s / 1e9 if decode_s else None,
                   mbu=counted["total"] / decode_s / (ceiling["value"] * 1e9) if decode_s else None,
                   host_share_of_decode=host_share(stats), scheduler=stats,
                   first_run_s=first_s, first_run_compiles=first.as_dict())
        c = row["first_run_compiles"]
        rates = (f"TPOT {row['tpot_ms']:.2f} ms, {row['achieved_gb_per_s']:.1f} GB/s, MBU {row['mbu']:.2f}"
                 if decode_s else "decode time within noise (the prefill-only run took as long)")
        print(f"  batch {batch:5d}: {row['output_tokens_per_s']:9.1f} output tok/s, {rates} ({row['mean_rows']:.1f} "
              f"rows a token iteration, peak {stats['peak_rows']}; {counted['total'] / len(iterations) / 1e9:.3g} GB "
              f"an iteration), decode host share {row['host_share_of_decode']['share'] or 0:.1%}; "
              f"first run {first_s:.1f} s, {c['programs']} programs compiled in {c['compile_s']:.1f} s", flush=True)
        results.append(row)
        partial(record(), f"batch {batch}")
    return record()


def add_arguments(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    g = p.add_argument_group("--decode-batches: continuous batching alone at fixed batches (launch/bench/decode.py)")
    g.add_argument("--decode-batches", default=None, metavar="B,...",
                   help="run only this: each batch's requests at once, the batch as the scheduler's decode rows")
    g.add_argument("--requests-per-batch", type=int, default=2,
                   help="requests per decode row: more than one keeps the rows full while others prefill")
    g.add_argument("--prompt-len", type=int, default=512)
    g.add_argument("--output-len", type=int, default=128)
    g.add_argument("--chunk-tokens", type=int, default=32768,
                   help="the scheduler's chunk step budget (64 rows of 512: at 8 tokens a decode call, 1024 rows "
                        "stay full)")
    g.add_argument("--row-tokens", type=int, default=512, help="the scheduler's chunk row length")
    g.add_argument("--decode-steps", type=int, default=8, help="tokens a decode call makes per row")
    g.add_argument("--copy-gbps", type=float, default=None,
                   help="the copy ceiling MBU divides by, GB/s (default: measured now, launch/gpu_ceilings.py)")
