"""Serve a list of request lines on an Engine: parse, schedule, run, and write one result per line (the body of
`python -m launch.serve`, callable in-process by tests and benchmarks)."""
from __future__ import annotations

import dataclasses
import hashlib
import secrets
from collections.abc import Callable, Sequence

import jax

from moejax.engine import Engine
from moejax.requests import output_lock
from moejax.requests.parse import BadLine, CompletionRequest, Request, ScoreRequest, parse_lines
from moejax.requests.results import ResultStore, error_line, request_id
from moejax.sched.batch_schedule import BatchSchedule, schedule_batches
from moejax.sched.batch_size import DEFAULT_TOKENS, ScoreBatchSize, score_batch_size
from moejax.sched.explain import describe
from moejax.sched.pool_size import PoolSize, pool_size
from moejax.sched.prefix_cache import cache_blocks as prefix_cache_blocks
from moejax.sched.runner import Progress, Runner
from moejax.sched.serving_options import SERVING_DEFAULTS, ServingOptions


def _prepare(engine: Engine, lines: Sequence[str], store_path: str | None, options: ServingOptions, *,
             settings: dict | None = None, seed_nonce: int | None = None,
             progress: Callable[[int], Progress | None] | None = None
             ) -> tuple[list[Request | BadLine], ResultStore, list[Request], BatchSchedule, Runner]:
    cfg = engine.config
    entries = refuse_unservable(engine, parse_lines(lines, tokenizer=engine.tokenizer, vocab_size=cfg.vocab_size,
                                                    max_context=cfg.max_position_embeddings,
                                                    chat=engine.chat_template))
    store, todo = open_results(entries, lines, store_path, engine_settings(engine) if settings is None else settings,
                               seed_nonce)
    schedule, options, kv_pool, sizing = plan_requests(engine, todo, options)
    runner = Runner(engine, schedule, todo, store, options=options, kv_pool=kv_pool, batch_size=sizing,
                    progress=progress(len(todo)) if progress is not None else None)
    return entries, store, todo, schedule, runner


def open_results(entries: Sequence[Request | BadLine], lines: Sequence[str], store_path: str | None, settings: dict,
                 seed_nonce: int | None) -> tuple[ResultStore, list[Request]]:
    """The run's ResultStore for parsed `entries` (resuming what `store_path` holds) and the requests it still
    lacks, each with its seed (seed_nonce None: a random one)."""
    store = ResultStore(store_path, {e.line: e.custom_id for e in entries},
                        {e.line: request_id(e.line, lines[e.line - 1]) for e in entries}, settings=settings,
                        seed_nonce=secrets.randbits(63) if seed_nonce is None else seed_nonce)
    todo = [with_seed(e, store.seed_nonce, store.ids[e.line]) for e in entries
            if not isinstance(e, BadLine) and not store.done(e.line)]
    return store, todo


def refuse_unservable(engine: Engine, entries: Sequence[Request | BadLine]) -> list[Request | BadLine]:
    """Requests the engine's placement cannot run become invalid lines (400, with its reason) rather than failed
    batches: completions that generate, on a placement without generation (the pipeline layout)."""
    return refuse_generation(engine.placement.no_generation, entries)


def refuse_generation(why: str | None, entries: Sequence[Request | BadLine]) -> list[Request | BadLine]:
    """Completions that generate as invalid lines saying `why` (a placement's no_generation); None: all kept."""
    if why is None:
        return list(entries)
    return [BadLine(e.line, e.custom_id, f"body.max_tokens: {why}")
            if isinstance(e, CompletionRequest) and e.max_tokens else e for e in entries]


def unservable_lines(engine: Engine, lines: Sequence[str]) -> list[int]:
    """The lines (1-based) of valid requests the engine's placement cannot run (refuse_unservable's), found from the
    abstract engine: no weight is loaded."""
    cfg = engine.config
    entries = parse_lines(lines, tokenizer=engine.tokenizer, vocab_size=cfg.vocab_size,
                          max_context=cfg.max_position_embeddings, chat=engine.chat_template)
    valid = {e.line for e in entries if not isinstance(e, BadLine)}
    return [e.line for e in refuse_unservable(engine, entries) if isinstance(e, BadLine) and e.line in valid]


def line_list(numbers: Sequence[int], most: int = 10) -> str:
    """'1, 2, 3' (the first `most`, then how many more)."""
    shown = ", ".join(map(str, numbers[:most]))
    return shown + (f" and {len(numbers) - most} more" if len(numbers) > most else "")


def kv_cache_mode(engine: Engine, kv_cache: str) -> tuple[str, str | None]:
    """-> (the kv_cache mode scoring runs with, why it is not the one asked for or None). A placement without a
    prefix pool runs `auto` as off (its results are the same: the cache only saves recomputing prefixes); `on`
    there raises ValueError."""
    why = engine.placement.no_prefix_pool
    if why is None or kv_cache == "off":
        return kv_cache, None
    if kv_cache == "on":
        raise ValueError(f"kv_cache on: {why}; use auto or off")
    return "off", f"auto: off, {why}"


def write_invalid(store: ResultStore, entries: Sequence[Request | BadLine]) -> int:
    """Write the 400 line of each invalid entry the store does not hold yet -> how many it wrote."""
    bad = 0
    for e in entries:
        if isinstance(e, BadLine) and not store.done(e.line):
            store.write(e.line, error_line(e.line, e.custom_id, e.message, rid=store.ids[e.line], param=e.param))
            bad += 1
    return bad


def plan_requests(engine: Engine, todo: Sequence[Request], options: ServingOptions
                  ) -> tuple[BatchSchedule, ServingOptions, PoolSize | None, ScoreBatchSize]:
    """How `todo` runs on `engine`: its batch schedule, the options as they apply (continuous batching falls back
    to static where the placement has none), the continuous scheduler's KV pool, the scoring batches' size."""
    # streamed experts: scoring batches are filled to at least Θ FLOPs (MoE-Prefill §7.4), which hides the copies;
    # Θ and the batches are both counted in true FLOPs, attention included (moejax.costs.true_prefill_flops)
    cfg, saturation = engine.config, engine.saturation  # Θ: made at load (moejax.plan.theta), or measured since
    floor = saturation.theta_flops if saturation is not None else 0.0
    kv_cache, why_off = kv_cache_mode(engine, options.kv_cache)
    options = dataclasses.replace(options, kv_cache=kv_cache)
    cache_blocks = prefix_cache_blocks(engine, options.prefix_cache_mb)
    sizing = score_batch_size(engine, options.max_batch_tokens, longest=longest_score_sequence(todo),
                              reserved_bytes=0.0 if options.kv_cache == "off" else options.prefix_cache_mb * 2**20)
    schedule = schedule_batches(list(enumerate(todo)), max_batch_tokens=options.max_batch_tokens or DEFAULT_TOKENS,
                                kv_cache=options.kv_cache, cache_blocks=cache_blocks, min_batch_flops=floor,
                                config=cfg, score_batch=sizing, order=options.order)
    if why_off is not None:
        schedule = dataclasses.replace(schedule, reason=why_off)
    if options.batching == "continuous" and not engine.placement.continuous_batching:
        options = dataclasses.replace(options, batching="static")
    kv_pool = None
    if options.batching == "continuous":
        # max_tokens 0 (an echo's prompt log-probabilities) generates nothing: the scheduler gives it no blocks
        kv_pool = pool_size(engine, [(len(r.prompt), r.max_tokens) for r in todo
                                     if isinstance(r, CompletionRequest) and r.max_tokens
                                     for _ in range(r.n)], options.kv_pool_mb)
    return schedule, options, kv_pool, sizing


def longest_score_sequence(requests: Sequence[Request]) -> int:
    """Tokens of the longest scoring sequence (a context and one candidate, its last token read, not fed)."""
    return max((len(ctx) + len(c.token_ids) - 1 for r in requests if isinstance(r, ScoreRequest)
                for ctx in r.contexts for c in r.candidates), default=0)


def engine_settings(engine: Engine) -> dict:
    """What decides an engine's results, for the journal's header and each result's system_fingerprint. A caller
    that knows more (launch.serve: offload and prediction options) passes its own."""
    return {"model": engine.name, "dtype": engine.dtype.name, "kernels": engine.kernels.describe(),
            "layers": engine.config.num_layers, "layout": None if engine.layout is None else str(engine.layout)}


def with_seed(request: Request, nonce: int, rid: str) -> Request:
    """A completion without a seed gets one of its own, drawn from the run's nonce and the request's id: different
    for every request and run, the same when a journal is resumed (it keeps its nonce). It is in the result."""
    if not isinstance(request, CompletionRequest) or request.sampling.seed is not None:
        return request
    digest = hashlib.blake2b(f"{nonce}:{rid}".encode(), digest_size=8).digest()
    seed = int.from_bytes(digest, "little") >> 1
    return dataclasses.replace(request, sampling=dataclasses.replace(request.sampling, seed=seed))


def explain_lines(engine: Engine, lines: Sequence[str], options: ServingOptions = SERVING_DEFAULTS) -> str:
    """The schedule for `lines` as text; loads no weights and runs nothing. options.max_batch_tokens None sizes scoring
    batches from the device (moejax.sched.batch_size)."""
    _, _, todo, schedule, runner = _prepare(engine, lines, None, options)
    refused = unservable_lines(engine, lines)
    warning = (f"\nrefused (400) lines {line_list(refused)}: {engine.placement.no_generation}" if refused else "")
    return describe(schedule, runner, engine) + warning


def serve_lines(engine: Engine, lines: Sequence[str], output: str | None, options: ServingOptions = SERVING_DEFAULTS,
                *, progress: Callable[[int], Progress | None] | None = None, peak: float | None = None,
                settings: dict | None = None, seed_nonce: int | None = None, error_file: str | None = None,
                done_s: dict[int, float] | None = None) -> dict:
    """Serve `lines` (JSONL request strings) into `output` (None: stdout). Lines already in `output` or its
    journal from an interrupted run with the same settings are skipped; results made with other settings raise
    results.SettingsMismatch before anything is written. options: how to batch and cache (ServingOptions; its
    fields say each). settings: what decides the results (default engine_settings); seed_nonce: what requests
    without a seed draw theirs from (default: random); progress(total) -> a callback of the requests done (or
    None); error_file: also write the failed lines there; done_s: filled with each served line's seconds from the
    run's start to its result (benchmarks: how long each request waited). A result that cannot be written raises
    results.WriteFailed (the journal keeps what it has). Another runner holding the
    output's or error file's lock raises output_lock.OutputLockError before anything is read or written. Returns
    the run summary."""
    with output_lock.hold(output, error_file):
        entries, store, todo, schedule, runner = _prepare(engine, lines, output, options, settings=settings,
                                                          seed_nonce=seed_nonce, progress=progress)
        with store:
            bad = write_invalid(store, entries)
            metrics = runner.run()
            if done_s is not None:
                done_s.update(runner.done_s)
            if runner.progress is not None:
                runner.progress(None, metrics)
            store.finish(error_file)
    metrics.requests_batch_failed = metrics.requests_failed  # the runner's failures: 500s, retried by a rerun
    metrics.requests_failed += bad
    metrics.requests_invalid = sum(isinstance(e, BadLine) for e in entries)  # their 400s, new or resumed
    metrics.requests_resumed = store.resumed
    device = jax.devices()[0]
    assert runner.batch_size is not None  # _prepare sizes the scoring batches
    return {"device": f"{device.platform}:{device.device_kind}", "lines": len(entries), "kv_cache": schedule.reason,
            "batches_planned": len(schedule.batches), "pool_blocks": runner.pool_blocks, "batching": runner.batching,
            "score_batch": runner.batch_size.as_dict(), **metrics.summary(peak),
            "scheduler": runner.scheduler_stats, "offload": engine.stats()}
