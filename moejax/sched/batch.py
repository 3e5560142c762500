"""Serve a list of request lines on an Engine: parse, plan, run, and write one result per line (the body of
`python -m launch.serve`, callable in-process by tests and benchmarks)."""
from __future__ import annotations

import jax

from moejax.buckets import bucket
from moejax.kv_pool import BLOCK
from moejax.sched.explain import describe
from moejax.sched.planner import make_plan
from moejax.sched.requests import BadLine, parse_lines
from moejax.sched.results import ResultStore, error_line, request_id
from moejax.sched.runner import Runner


def _prepare(engine, lines, store_path, *, max_batch_tokens, kv_cache, prefix_cache_mb):
    cfg = engine.config
    entries = parse_lines(lines, tokenizer=engine.tokenizer, vocab_size=cfg.vocab_size,
                          max_context=cfg.max_position_embeddings)
    store = ResultStore(store_path, {e.line: e.custom_id for e in entries},
                        {e.line: request_id(e.line, lines[e.line - 1]) for e in entries})
    todo = [e for e in entries if not isinstance(e, BadLine) and not store.done(e.line)]
    if engine.saturation is not None:  # streamed experts: batches of at least Θ FLOPs hide the copies
        max_batch_tokens = max(max_batch_tokens, bucket(engine.saturation.theta_tokens, 16))
    cache_blocks = int(prefix_cache_mb * 2**20 // (engine.kv_bytes_per_token() * BLOCK))
    plan = make_plan(list(enumerate(todo)), max_batch_tokens=max_batch_tokens, kv_cache=kv_cache,
                     cache_blocks=cache_blocks)
    return entries, store, todo, plan


def explain_lines(engine, lines, *, max_batch_tokens=8192, kv_cache="auto", prefix_cache_mb=1024.0) -> str:
    """The plan for `lines` as text; loads no weights and runs nothing."""
    _, _, todo, plan = _prepare(engine, lines, None, max_batch_tokens=max_batch_tokens, kv_cache=kv_cache,
                                prefix_cache_mb=prefix_cache_mb)
    return describe(plan, Runner(engine, plan, todo, None), engine)


def serve_lines(engine, lines, output: str | None, *, max_batch_tokens=8192, kv_cache="auto",
                prefix_cache_mb=1024.0, progress=None, peak=None) -> dict:
    """Serve `lines` (JSONL request strings) into `output` (None: stdout). Lines already in `output` or its
    journal from an interrupted run are skipped. Returns the run summary."""
    entries, store, todo, plan = _prepare(engine, lines, output, max_batch_tokens=max_batch_tokens,
                                          kv_cache=kv_cache, prefix_cache_mb=prefix_cache_mb)
    bad = 0
    with store:
        for e in entries:
            if isinstance(e, BadLine) and not store.done(e.line):
                store.write(e.line, error_line(e.line, e.custom_id, e.message, rid=store.ids[e.line]))
                bad += 1
        bar = progress(len(todo)) if progress is not None else None
        metrics = Runner(engine, plan, todo, store, progress=bar).run()
        if bar is not None:
            bar(None, metrics)
        store.finish()
    metrics.requests_batch_failed = metrics.requests_failed  # the runner's failures: 500s, retried by a rerun
    metrics.requests_failed += bad
    metrics.requests_invalid = sum(isinstance(e, BadLine) for e in entries)  # their 400s, new or resumed
    metrics.requests_resumed = store.resumed
    device = jax.devices()[0]
    return {"device": f"{device.platform}:{device.device_kind}", "lines": len(entries), "kv_cache": plan.reason,
            "batches_planned": len(plan.batches), **metrics.summary(peak), "offload": engine.stats()}
