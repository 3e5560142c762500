"""One engine replica serving a run in shares (moejax.replicas.run routes them): each share is scheduled and run
as `serve_lines` would run it, against one prefix cache and device pool that last across shares (so a prefix a
later share repeats is read, not recomputed), and reports its results and its cache's lifecycle events for the
frontend's mirror (MoE-Prefill App. B.3). No Ray here: the Ray actor wraps this, and tests call it directly."""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

from moejax.compiles import counting
from moejax.engine import Engine
from moejax.models.kv_pool import Layer
from moejax.requests.parse import Request
from moejax.requests.results import ResultStore
from moejax.sched.batch import kv_cache_mode, plan_requests
from moejax.sched.prefix_cache import PrefixCache
from moejax.sched.prefix_cache import cache_blocks as prefix_cache_blocks
from moejax.sched.runner import Runner
from moejax.sched.serving_options import ServingOptions


@dataclasses.dataclass
class ShareDone:
    """What a replica reports for one share: each line's result (the JSON text a ResultStore writes), its prefix
    cache's events since the last share, and the share's counters."""
    results: dict[int, str]
    events: list[tuple]
    metrics: dict
    busy_s: float
    compile_s: float  # of busy_s, tracing, lowering and compiling programs this engine had not compiled before


class ReplicaSession:
    def __init__(self, engine: Engine, options: ServingOptions, settings: dict):
        """options: as for serve_lines; settings: the run's (the driver's ResultStore), so every result carries the
        run's system_fingerprint."""
        # a placement without a prefix pool runs kv_cache auto as off (and refuses on), as one engine does
        options = dataclasses.replace(options, kv_cache=kv_cache_mode(engine, options.kv_cache)[0])
        self.engine, self.options, self.settings = engine, options, settings
        blocks = 0 if options.kv_cache == "off" else prefix_cache_blocks(engine, options.prefix_cache_mb)
        self.cache = PrefixCache(blocks, record=True) if blocks else None
        self.pool: list[Layer] | None = None  # the cache's device pool, made by the first share's runner

    def serve(self, requests: Sequence[Request], ids: dict[int, str], keep: frozenset[bytes] = frozenset()
              ) -> ShareDone:
        """Run `requests` (parsed and seeded by the driver; ids: line -> result id) -> their results. keep: blocks
        later shares read (stored even where this share's own plan would not keep them)."""
        start = time.perf_counter()
        store = ResultStore(None, {r.line: r.custom_id for r in requests}, ids, settings=self.settings)
        # the share's own plan keeps the blocks its batches reuse (--kv-cache auto) or all (on); the driver adds the
        # ones later shares reuse (keep): this share sees only its own requests
        schedule, options, kv_pool, sizing = plan_requests(self.engine, requests, self.options)
        runner = Runner(self.engine, schedule, list(requests), store, options=options, kv_pool=kv_pool,
                        batch_size=sizing, cache=self.cache, pool=self.pool, keep=keep)
        with counting() as compiles:
            metrics = runner.run()
        self.pool = runner.pool  # (a failed batch cleared the cache in place and made a new pool)
        events = self.cache.take_events() if self.cache is not None else []
        summary = metrics.summary(None)
        summary["scheduler"] = runner.scheduler_stats
        return ShareDone(store.texts(), events, summary, time.perf_counter() - start, sum(compiles.seconds.values()))

    def table(self) -> set[bytes]:
        """The prefix blocks this replica's cache holds now (what the frontend's mirror should equal)."""
        return self.cache.hashes() if self.cache is not None else set()
