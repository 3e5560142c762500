"""`python -m launch.bench generate --decode-batches 1,64,256,1024`: continuous batching alone at fixed batches, for a
whole real-shaped model: output tokens/s, time per output token (TPOT) and MBU.

For each batch B: B requests of `--prompt-len` random tokens, each making exactly `--output-len` tokens (no stop
token: the scheduler is driven directly, so a random model's eos ends nothing), under the continuous scheduler
(moejax.sched.continuous) with B decode rows (its max_rows) and a KV pool of exactly what they need. Each batch runs
twice untimed (compiling every program; seconds per program from JAX's own events, moejax/compiles.py), then
`--repeats` times timed, each timed run paired with a prefill-only run of the same requests (one output token).
Decode time = the pair's difference; TPOT = decode time / (output_len - 1); MBU = the bytes the decode steps read
(launch/decode_bytes.py, written out) / decode time / the measured copy ceiling (launch/gpu_ceilings.py's device
stream, or --copy-gbps). The scheduler's own account of the timed run (Stats.times: host work against waiting on
the device, per step kind) gives the host share of a decode step."""
from __future__ import annotations

import gc
import time

import jax
import numpy as np

from moejax import compiles
from moejax.kv_pool import BLOCK
from moejax.sched.continuous import GenRequest, Scheduler
from launch import decode_bytes, gpu_ceilings

HOST_PHASES = ("prepare", "dispatch", "update", "deliver")  # a decode step's host work (Stats.times' phases)


def batches_of(text: str) -> list[int]:
    try:
        batches = [int(b) for b in text.split(",") if b.strip()]
    except ValueError:
        raise SystemExit(f"bench generate: --decode-batches {text!r}: expected comma-separated whole numbers") from None
    if not batches or min(batches) < 1:
        raise SystemExit(f"bench generate: --decode-batches {text!r}: expected batches >= 1")
    return batches


def _requests(engine, batch: int, prompt_len: int, output_len: int, seed: int) -> list[GenRequest]:
    rng = np.random.default_rng(seed)
    key = jax.random.key(seed)
    return [GenRequest(rng.integers(1, engine.config.vocab_size, prompt_len).tolist(), output_len,
                       np.asarray(jax.random.key_data(jax.random.fold_in(key, i))), tag=i) for i in range(batch)]


def _failed(request: GenRequest, message: str) -> None:
    raise RuntimeError(f"bench generate: request {request.tag} failed: {message}")


def _run(engine, reqs: list[GenRequest], batch: int, args) -> tuple[float, dict, int]:
    """One scheduler run: (wall seconds, its Stats.as_dict(), output tokens)."""
    blocks = batch * -(-(args.prompt_len + max(r.max_tokens for r in reqs)) // BLOCK)
    made = []
    sched = Scheduler(engine, blocks, max_rows=batch, chunk_tokens=args.chunk_tokens,
                      row_tokens=min(args.row_tokens, args.chunk_tokens), decode_steps=args.decode_steps)
    t0 = time.perf_counter()
    sched.run(reqs, lambda r, tokens, cached: made.append(len(tokens)), _failed)
    wall = time.perf_counter() - t0
    stats = sched.stats.as_dict()
    sched.pool = sched.carry = None  # the next run's pool may need all of this one's memory
    gc.collect()
    return wall, stats, sum(made)


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


def decode_batches(engine, args, config: dict, environment: dict, partial) -> dict:
    batches = batches_of(args.decode_batches)
    if args.output_len < 2 or args.prompt_len < 1:
        raise SystemExit("bench generate: --output-len must be >= 2 and --prompt-len >= 1 (decode needs a token "
                         "after the prompt's first)")
    cfg = engine.config
    ceiling = gpu_ceilings.measured("device_stream", args.copy_gbps)
    print(f"copy ceiling {ceiling['value']:.1f} GB/s ({ceiling['method']})", flush=True)
    param_bytes, kv_token = engine.param_bytes(), engine.kv_bytes_per_token()
    results: list[dict] = []

    def record() -> dict:
        return dict(**environment, benchmark="generate --decode-batches", config=config, copy_ceiling=ceiling,
                    method=__doc__.split("\n\n")[1].replace("\n", " "), results=results)
    for batch in batches:
        timed = _requests(engine, batch, args.prompt_len, args.output_len, args.seed)
        prefill_only = [GenRequest(r.prompt, 1, r.key, tag=r.tag) for r in timed]
        jax.clear_caches()  # each batch pays for its own programs
        with compiles.counting() as first:
            t0 = time.perf_counter()
            _run(engine, prefill_only, batch, args)
            _run(engine, timed, batch, args)
            first_s = time.perf_counter() - t0
        pairs = []
        for _ in range(args.repeats):
            prefill_s, _, _ = _run(engine, prefill_only, batch, args)
            wall, stats, made = _run(engine, timed, batch, args)
            pairs.append((prefill_s, wall))
        if made != batch * args.output_len:
            raise RuntimeError(f"batch {batch}: made {made} tokens, not {batch} x {args.output_len}")
        prefill_s = float(np.median([p for p, _ in pairs]))
        wall = float(np.median([w for _, w in pairs]))
        decode_s = max(wall - prefill_s, 1e-9)
        context = args.prompt_len + args.output_len / 2  # a step's rows attend to this many tokens on average
        step = decode_bytes.decode_step_bytes(cfg, param_bytes, engine.dtype.itemsize, kv_token, batch, context)
        steps = args.output_len - 1
        tpot = decode_s / steps
        row = dict(batch=batch, prompt_len=args.prompt_len, output_len=args.output_len, output_tokens=made,
                   seconds=[w for _, w in pairs], prefill_only_seconds=[p for p, _ in pairs], wall_s=wall,
                   prefill_only_s=prefill_s, decode_s=decode_s, output_tokens_per_s=made / wall,
                   decode_tokens_per_s=batch * steps / decode_s, tpot_ms=1e3 * tpot,
                   bytes_per_decode_step=step, bytes_read=step["total"] * steps,
                   achieved_gb_per_s=step["total"] / tpot / 1e9,
                   mbu=step["total"] / tpot / (ceiling["value"] * 1e9),
                   host_share_of_decode=host_share(stats), scheduler=stats,
                   first_runs_s=first_s, first_runs_compiles=first.as_dict())
        c = row["first_runs_compiles"]
        print(f"  batch {batch:5d}: {row['output_tokens_per_s']:9.1f} output tok/s, TPOT {row['tpot_ms']:.2f} ms, "
              f"{row['achieved_gb_per_s']:.1f} GB/s of {step['total'] / 1e9:.2f} GB a step "
              f"({step['experts_per_layer']:.1f} experts a layer), MBU {row['mbu']:.2f}, decode host share "
              f"{row['host_share_of_decode']['share'] or 0:.1%}, peak rows {stats['peak_rows']}; first runs "
              f"{first_s:.1f} s, {c['programs']} programs compiled in {c['compile_s']:.1f} s", flush=True)
        results.append(row)
        partial(record(), f"batch {batch}")
    return record()


def add_arguments(p) -> None:
    g = p.add_argument_group("--decode-batches: continuous batching alone at fixed batches (launch/bench_decode.py)")
    g.add_argument("--decode-batches", default=None, metavar="B,...",
                   help="run only this: each batch's requests at once, the batch as the scheduler's decode rows")
    g.add_argument("--prompt-len", type=int, default=512)
    g.add_argument("--output-len", type=int, default=128)
    g.add_argument("--chunk-tokens", type=int, default=8192, help="the scheduler's chunk step budget")
    g.add_argument("--row-tokens", type=int, default=512, help="the scheduler's chunk row length")
    g.add_argument("--decode-steps", type=int, default=8, help="tokens a decode call makes per row")
    g.add_argument("--copy-gbps", type=float, default=None,
                   help="the copy ceiling MBU divides by, GB/s (default: measured now, launch/gpu_ceilings.py)")
