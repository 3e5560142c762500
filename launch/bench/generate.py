"""`python -m launch.bench generate`: output tokens/s of continuous batching against static batching and against
transformers' batched `generate`, side by side in one process on one checkpoint, on a long-tail workload
(launch/bench/generate_workloads.py: `--workload log-uniform`, prompts and max_tokens log-uniform over wide
ranges, greedy, with stop tokens; or `--workload long-tail`, for the scheduler's overhead: short prompts, seven in
eight requests stopping within 5 tokens on their own stop token, one in eight running to 160; transformers' generate,
one stop list per call, sits that one out).

Every engine delivers the same thing: each request's tokens up to its max_tokens or first stop token, and
tokens/s counts only those. moejax runs the whole `serve_lines` path (parse, plan, steps, results) once untimed, each
mode after `jax.clear_caches()`: it compiles every program the mode runs, none left by another mode (moejax/
compiles.py counts them), and its wall time is the end-to-end time "compilation included"; then `--repeats`
times ("warm"). transformers runs batches of `--hf-batch` requests (left-padded, sorted by prompt length) with
max_new_tokens = the batch's largest max_tokens and the stop tokens as eos: a row's tokens past its own max_tokens
are computed and dropped, as a static batch does. Slot utilisation is useful decode rows / decode rows computed
(moejax's runner counts both). Continuous batching runs twice: prefill chunks and decodes in separate steps (the
default) and in mixed steps (decoding sequences ride along in the chunk steps as 1-token rows while anything
prefills). For a preset the checkpoint is built with transformers from the preset's config (--num-layers of it),
so both engines load the same weights; a directory is loaded as it is.

Step times (continuous batching, the last timed run): the scheduler's chunk and decode steps, each kind's wall time
per step next to the same step programs replayed on the same inputs, and the overhead share, the part of the step
time the device was not computing (launch/bench/step_overhead.py says how).

A real-shaped preset at full depth (qwen3-30b-a3b's 48 layers) gets no transformers checkpoint (the whole model in
float32 on host and disk): moejax's modes run alone on the preset's weights drawn on the device, and the record says
how long they took to materialize (`config.weights`). `--decode-batches 1,64,...`: continuous batching alone at
fixed batches, with TPOT and MBU (launch/bench/decode.py). `--max-rows`: the continuous scheduler's decode rows;
`--command-buffers`, `--mem-fraction`, `--tfrt-gpu-client`: XLA settings applied before JAX starts
(moejax/serving/xla_startup.py), recorded.

`--overhead`: only continuous batching, with the model's forward a no-op of the same shapes, for the scheduler's host
time per step (launch/bench/sched_overhead.py)."""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
import numpy as np

import moejax
from launch.bench import decode as bench_decode
from launch.bench import generate_workloads, sched_overhead, step_overhead
from launch.bench import util as bench_util
from launch.bench.results import no_file
from moejax import compiles
from moejax.engine import Engine
from moejax.presets import PRESETS, preset_config, resolve_embedded
from moejax.sched import step_times
from moejax.sched.batch import serve_lines
from moejax.sched.serving_options import ServingOptions
from moejax.serving import xla_startup


def _lines(reqs: list[dict]) -> list[str]:
    return [json.dumps({"custom_id": f"g{i}", "url": "/v1/completions",
                        "body": {"prompt": r["prompt"], "max_tokens": r["max_tokens"], "temperature": 0,
                                 "stop_token_ids": r["stop_token_ids"], "seed": 0}})
            for i, r in enumerate(reqs)]


# moejax configurations: (name, serve_lines batching, scheduler options)
MOEJAX: tuple[tuple[str, str, dict | None], ...] = (
    ("continuous", "continuous", {}), ("continuous, mixed steps", "continuous", {"mixed": True}),
    ("static", "static", None))


def _moejax(engine: Engine, reqs: list[dict], batching: str, options: dict | None, max_batch_tokens: int,
            kv_pool_mb: float | None,
            steps: bool = False, max_rows: int | None = None) -> tuple[dict, list]:
    """steps: record the scheduler's step calls and replay them after the run (step_overhead)."""
    recorder = step_overhead.StepRecorder(engine) if steps else None
    try:
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "out.jsonl")
            t0 = time.perf_counter()
            scheduler = dict(options or {}, **({"max_rows": max_rows} if max_rows and options is not None else {}))
            serving = ServingOptions(batching=batching, max_batch_tokens=max_batch_tokens, kv_pool_mb=kv_pool_mb,
                                     **scheduler)
            summary = serve_lines(engine, _lines(reqs), out, serving, seed_nonce=0)
            wall = time.perf_counter() - t0
            rows = [json.loads(x) for x in open(out)]
    finally:
        if recorder is not None:
            recorder.close()
    result = dict(wall_s=wall, summary=summary)
    if recorder is not None:
        result["step_times"] = step_overhead.step_times(recorder, step_overhead.replay(recorder),
                                                        summary["scheduler"], wall)
    failed = [row for row in rows if row.get("error")]
    if failed:  # a benchmark of requests that failed measures nothing
        raise SystemExit(f"bench generate: {len(failed)} of {len(rows)} requests failed under {batching} batching; "
                         f"the first ({failed[0]['custom_id']}): {failed[0]['error']['message']}")
    tokens = [row["response"]["body"]["choices"][0]["token_ids"] for row in rows]
    return result, tokens


def _transformers(model: Any, reqs: list[dict], batch: int, stop_ids: Sequence[int], pad_id: int
                  ) -> tuple[float, list[list[int]]]:
    import torch  # optional: transformers' reference only
    order = sorted(range(len(reqs)), key=lambda i: len(reqs[i]["prompt"]))
    out: list[list[int]] = [[] for _ in reqs]
    t0 = time.perf_counter()
    with torch.no_grad():
        for k in range(0, len(order), batch):
            idx = order[k: k + batch]
            width = max(len(reqs[i]["prompt"]) for i in idx)
            ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(idx), width), dtype=torch.long)
            for r, i in enumerate(idx):
                p = reqs[i]["prompt"]
                ids[r, width - len(p):] = torch.tensor(p)
                mask[r, width - len(p):] = 1
            gen = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, eos_token_id=list(stop_ids),
                                 pad_token_id=pad_id, max_new_tokens=max(reqs[i]["max_tokens"] for i in idx))
            for r, i in enumerate(idx):
                out[i] = _cut(gen[r, width:].tolist(), reqs[i]["max_tokens"], stop_ids)
    return time.perf_counter() - t0, out


def _cut(tokens: list[int], max_tokens: int, stop_ids: Sequence[int]) -> list[int]:
    """A row as a request delivers it: up to max_tokens, ending at (and keeping) the first stop token."""
    tokens = tokens[:max_tokens]
    end = next((j for j, t in enumerate(tokens) if t in stop_ids), None)
    return tokens if end is None else tokens[: end + 1]


def full_size(model: str, num_layers: int | None) -> bool:
    """A real-shaped preset (not `tiny-*` or `micro-*`, moejax.presets) at its full depth: its transformers
    checkpoint would be the whole model in float32 on the host and the disk (about 122 GB for qwen3-30b-a3b)."""
    if model not in PRESETS or model.startswith(("tiny-", "micro-")):
        return False
    return num_layers is None or num_layers >= preset_config(model)["num_hidden_layers"]


def _checkpoint(args: argparse.Namespace, tmp: str) -> tuple[str, dict]:
    """What both engines load, and moejax.load's extra options: --model's directory, or a preset's config built
    and saved by transformers (without transformers, or a real-shaped preset at full size: the preset itself, its
    weights drawn on the device, its --num-layers)."""
    if os.path.isdir(resolve_embedded(args.model)):
        return resolve_embedded(args.model), {}
    if args.no_transformers or full_size(args.model, args.num_layers):
        return args.model, {} if args.num_layers is None else {"num_layers": args.num_layers}
    hf_config = preset_config(args.model)
    if args.num_layers:
        hf_config["num_hidden_layers"] = args.num_layers
        if isinstance(hf_config.get("layer_types"), list):
            hf_config["layer_types"] = hf_config["layer_types"][: args.num_layers]
    bench_util.hf_checkpoint(hf_config, tmp, args.seed)  # through the module: a test stands in for it
    return tmp, {}


def _workload(args: argparse.Namespace, engine: Engine) -> tuple[list[dict], dict]:
    """The requests, and what describes them in the record's config."""
    cfg = engine.config
    if args.workload == "long-tail":
        reqs = generate_workloads.long_tail(engine, args.requests, args.seed)
        lt = generate_workloads.LONG_TAIL
        print(f"{len(reqs)} requests, prompts {lt['prompt_range'][0]}-{lt['prompt_range'][1]}, max_tokens "
              f"{lt['max_tokens']}: {sum(not r['stop_token_ids'] for r in reqs)} long, the others stopping within "
              f"{lt['stop_within']} tokens (the model's eos {list(cfg.eos_token_ids)} stops every request)",
              flush=True)
        return reqs, dict(workload="long-tail", **lt)
    stop_ids = tuple(cfg.eos_token_ids) + tuple(int(t) for t in args.stop_ids.split(",") if t)
    if args.stop_fraction:  # a random-weight model rarely makes its eos: random stop ids end rows at random points
        pick = np.random.default_rng(args.seed + 1).choice(cfg.vocab_size, int(args.stop_fraction * cfg.vocab_size),
                                                           replace=False)
        stop_ids += tuple(int(t) for t in sorted(pick))
    reqs = generate_workloads.log_uniform(args.requests, cfg.vocab_size, (args.min_prompt, args.max_prompt),
                                          (args.min_new, args.max_new), stop_ids, args.seed)
    print(f"{len(reqs)} requests, prompts {args.min_prompt}-{args.max_prompt}, max_tokens {args.min_new}-"
          f"{args.max_new}, {len(stop_ids)} stop ids", flush=True)
    return reqs, dict(workload="log-uniform", prompt_range=[args.min_prompt, args.max_prompt],
                      max_tokens_range=[args.min_new, args.max_new], stop_ids=list(stop_ids),
                      stop_fraction=args.stop_fraction)


def _overhead(engine: Engine, reqs: list[dict], args: argparse.Namespace, record: dict) -> dict:
    """Continuous batching with no-op steps: an untimed run (compiles the no-op programs), then --repeats timed runs;
    the last one's scheduler stats give the host time per step."""
    token = sched_overhead.free_token(reqs, engine.config.eos_token_ids, engine.config.vocab_size)
    # NoopSteps passes for the Engine: every attribute but the two steps is the engine's
    noop = cast(Engine, sched_overhead.NoopSteps(engine, token))
    with compiles.counting() as first:
        t0 = time.perf_counter()
        _moejax(noop, reqs, "continuous", {}, args.max_batch_tokens, args.kv_pool_mb)
        first_s = time.perf_counter() - t0
    runs = [_moejax(noop, reqs, "continuous", {}, args.max_batch_tokens, args.kv_pool_mb) for _ in range(args.repeats)]
    result, tokens = runs[-1]
    made = sum(map(len, tokens))
    if made != sum(r["max_tokens"] for r in reqs):
        raise RuntimeError(f"the no-op run made {made} tokens, not every request's max_tokens: a stop was hit")
    o = sched_overhead.per_step(result["summary"]["scheduler"])
    print(f"  no-op model (token {token}): {sched_overhead.describe(o)}; first run {first_s:.1f}s "
          f"({first.as_dict()['programs']} programs compiled), timed {[round(r['wall_s'], 2) for r, _ in runs]}s",
          flush=True)
    return dict(record, overhead=dict(o, noop_token=token, output_tokens=made, first_run_s=first_s,
                                        first_run_compiles=first.as_dict(),
                                        seconds=[r["wall_s"] for r, _ in runs],
                                        method=sched_overhead.__doc__.replace("\n", " ")),
                scheduler=result["summary"]["scheduler"])


def _load(args: argparse.Namespace, tmp: str) -> tuple[Engine, str, dict]:
    """The engine with its weights in place, and how they came: their source and the seconds materializing took
    (a preset's drawn on the device, a checkpoint's read and copied)."""
    path, options = _checkpoint(args, tmp)
    engine = moejax.load(path, dtype=args.dtype, compilation_cache=False, **options)
    t0 = time.perf_counter()
    jax.block_until_ready(engine.params)
    seconds = time.perf_counter() - t0
    source = "checkpoint" if os.path.isdir(path) else "preset, drawn on the device"
    print(f"{args.model} ({path}): {engine.config.num_layers} layers, {engine.param_bytes() / 2**30:.2f} GiB of "
          f"weights ({source}) in place in {seconds:.1f} s", flush=True)
    return engine, path, dict(source=source, materialize_s=seconds, bytes=engine.param_bytes())


def generate(args: argparse.Namespace, environment: dict, partial: Callable[[dict, str], None] = no_file) -> dict:
    tmp = tempfile.TemporaryDirectory(prefix="moejax-bench-")
    if args.decode_batches:
        args.no_transformers = True  # moejax alone: no transformers checkpoint to build
    engine, path, weights = _load(args, tmp.name)
    cfg = engine.config
    cache_dir = jax.config.jax_compilation_cache_dir or None  # type: ignore[attr-defined]  # Config types no options
    if args.decode_batches:
        tmp.cleanup()
        config = dict(model=args.model, num_layers=cfg.num_layers, dtype=args.dtype, weights=weights,
                      decode_batches=args.decode_batches, requests_per_batch=args.requests_per_batch,
                      prompt_len=args.prompt_len, output_len=args.output_len,
                      chunk_tokens=args.chunk_tokens, row_tokens=args.row_tokens, decode_steps=args.decode_steps,
                      repeats=args.repeats, seed=args.seed,
                      persistent_compilation_cache=cache_dir)
        return bench_decode.decode_batches(engine, args, config, environment, partial)
    if full_size(args.model, args.num_layers):
        args.no_transformers = True  # no transformers checkpoint of a whole real-shaped model (_checkpoint)
    reqs, described = _workload(args, engine)
    config = dict(model=args.model, num_layers=cfg.num_layers, dtype=args.dtype, requests=args.requests, **described,
                  max_batch_tokens=args.max_batch_tokens, kv_pool_mb=args.kv_pool_mb, max_rows=args.max_rows,
                  hf_batch=args.hf_batch, repeats=args.repeats, seed=args.seed, weights=weights,
                  transformers=not args.no_transformers,
                  persistent_compilation_cache=cache_dir)
    if args.overhead:
        tmp.cleanup()
        return _overhead(engine, reqs, args, dict(**environment, benchmark="generate --overhead", config=config))
    results: list[dict] = []
    outputs: dict[str, list[list[int]]] = {}

    def record() -> dict:
        return dict(**environment, benchmark="generate", config=dict(config),
                    step_times_method=step_overhead.__doc__.split("\n\n")[0].replace("\n", " "),
                    results=results)
    for name, batching, options in MOEJAX:
        if args.no_mixed and options and options.get("mixed"):
            continue
        jax.clear_caches()  # this mode compiles every program it runs: none are left by the modes before it
        with compiles.counting() as first:
            t0 = time.perf_counter()
            _moejax(engine, reqs, batching, options, args.max_batch_tokens, args.kv_pool_mb, max_rows=args.max_rows)
            first_s = time.perf_counter() - t0
        with compiles.counting() as later:
            runs = [_moejax(engine, reqs, batching, options, args.max_batch_tokens, args.kv_pool_mb,
                            steps=batching == "continuous" and i == args.repeats - 1, max_rows=args.max_rows)
                    for i in range(args.repeats)]
        walls = [r[0]["wall_s"] for r in runs]
        outputs[name] = tokens = runs[-1][1]
        summary = runs[-1][0]["summary"]
        row = dict(engine="moejax", batching=name, seconds=walls, seconds_median=float(np.median(walls)),
                   first_run_s=first_s, first_run_compiles=first.as_dict(), later_compiles=later.as_dict(),
                   output_tokens=sum(map(len, tokens)),
                   slot_utilisation=summary["slot_utilisation"], scheduler=summary["scheduler"],
                   prefill_tokens_computed=summary["computed_tokens"], padded_prefill_tokens=summary["padded_tokens"])
        c = row["first_run_compiles"]
        print(f"  {name}: first run {first_s:.1f}s, {c['programs']} programs compiled (trace {c['trace_s']:.1f}s, "
              f"lower {c['lower_s']:.1f}s, compile {c['compile_s']:.1f}s); later {row['later_compiles']['programs']} "
              "(timed runs and step replay)", flush=True)
        if "step_times" in runs[-1][0]:
            row["step_times"] = runs[-1][0]["step_times"]
            print(f"  {name}: {step_overhead.describe(row['step_times'])}", flush=True)
        if summary["scheduler"]:
            print(f"  {name}, where the steps' time went: {step_times.describe(summary['scheduler']['breakdown'])}",
                  flush=True)
        results.append(row)
        partial(record(), name)
    if not args.no_transformers and args.workload == "long-tail":
        print("  transformers skipped: its generate takes one stop list per call, long-tail's stops are per request")
    elif not args.no_transformers:
        import torch  # optional: transformers' reference only
        import transformers  # optional: transformers' reference only
        torch.set_num_threads(os.cpu_count() or 1)
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        stop_ids = described["stop_ids"]
        _transformers(model, reqs[: args.hf_batch], args.hf_batch, stop_ids, 0)  # warm-up
        walls = []
        out: list[list[int]] = []
        for _ in range(args.repeats):
            wall, out = _transformers(model, reqs, args.hf_batch, stop_ids, 0)
            walls.append(wall)
        outputs["transformers"] = out
        results.append(dict(engine="transformers", batching=f"generate, batches of {args.hf_batch}", seconds=walls,
                            seconds_median=float(np.median(walls)), output_tokens=sum(map(len, out)),
                            torch_threads=torch.get_num_threads()))
        partial(record(), "transformers")
    for r in results:
        r["output_tokens_per_s"] = r["output_tokens"] / r["seconds_median"]
        key = "transformers" if r["engine"] == "transformers" else r["batching"]
        r["same_tokens_as_static"] = float(np.mean([a == b for a, b in zip(outputs[key], outputs["static"],
                                                                              strict=True)]))
        util = r.get("slot_utilisation")
        print(f"  {r['engine']:12s} {r['batching']:26s} {r['output_tokens_per_s']:8.1f} output tok/s  "
              f"median {r['seconds_median']:.1f}s  {r['output_tokens']} tokens  "
              f"{'' if util is None else f'slots {util:.0%} useful  '}same as static {r['same_tokens_as_static']:.0%}",
              flush=True)
    rate = {r["batching"] if r["engine"] == "moejax" else "transformers": r["output_tokens_per_s"] for r in results}
    first_run = {r["batching"]: r["first_run_s"] for r in results if r["engine"] == "moejax"}
    # the same tokens in each mode: a ratio of rates is the inverse ratio of times
    ratios = {"continuous / static": rate["continuous"] / rate["static"],
              "continuous / static, compilation included": first_run["static"] / first_run["continuous"]}
    if "continuous, mixed steps" in rate:
        ratios["mixed steps / separate steps"] = rate["continuous, mixed steps"] / rate["continuous"]
    if "transformers" in rate:
        ratios["continuous / transformers"] = rate["continuous"] / rate["transformers"]
    for k, v in ratios.items():
        print(f"  {k}{'' if 'compilation' in k else ', warm'}: {v:.2f}x")
    tmp.cleanup()
    lengths = [len(t) for t in outputs["static"]]
    done = record()
    done["config"]["output_length_quartiles"] = np.percentile(lengths, [25, 50, 75]).tolist()
    if args.workload == "long-tail":
        done["config"]["made"] = made = generate_workloads.long_tail_check(reqs, outputs["static"])
        early = made["long_lengths_below_max"]
        early = f" (the model's eos ended the others after {early} tokens)" if early else ""
        print(f"  made: {made['short_stopped_within']} of {made['short']} short requests stopped within "
              f"{generate_workloads.LONG_TAIL['stop_within']} tokens; {made['long_ran_to_max']} of {made['long']} long "
              f"ones ran to max_tokens{early}")
    return dict(done, ratios=ratios)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = sub.add_parser("generate", help="output tokens/s: continuous vs static batching vs transformers generate")
    p.add_argument("--model", default="pycode-moe",
                   help="preset (built with transformers; a real-shaped one at full depth: its weights drawn on the "
                        "device, moejax alone) or checkpoint directory")
    p.add_argument("--num-layers", type=int, default=None, help="a preset's first N layers")
    p.add_argument("--workload", default="log-uniform", choices=["log-uniform", "long-tail"],
                   help="long-tail: short prompts, most stopping at once (prompts 6-40, max_tokens 160; the prompt, "
                        "max_tokens and stop flags are log-uniform's)")
    p.add_argument("--overhead", action="store_true",
                   help="only continuous batching, the model a no-op: host microseconds per scheduler step")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--min-prompt", type=int, default=32)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--min-new", type=int, default=8)
    p.add_argument("--max-new", type=int, default=512)
    p.add_argument("--stop-ids", default="", help="stop token ids besides the model's eos, comma-separated")
    p.add_argument("--stop-fraction", type=float, default=0.0,
                   help="also stop at this fraction of the vocabulary, drawn at random (for random-weight presets)")
    p.add_argument("--max-batch-tokens", type=int, default=8192, help="static batching's budget (launch.serve's)")
    p.add_argument("--kv-pool-mb", type=float, default=None)
    p.add_argument("--max-rows", type=int, default=None,
                   help="continuous batching: the scheduler's decode rows, the batch (launch.serve's --max-rows)")
    p.add_argument("--hf-batch", type=int, default=16, help="transformers: requests per generate call")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="moejax's dtype (transformers runs float32: compare it in float32)")
    p.add_argument("--no-transformers", action="store_true")
    p.add_argument("--no-mixed", action="store_true", help="skip continuous batching with mixed steps")
    p.add_argument("--out", default=None, help="JSON file (default bench/results/generate-<device>.json)")
    bench_decode.add_arguments(p)
    xla_startup.add_arguments(p.add_argument_group("XLA settings read when JAX starts (moejax/serving/xla_startup.py)"))
    return p
