"""Execute a BatchSchedule on an Engine: pack each batch (replaying the prefix-cache table), run the jit step, turn
log-probabilities and tokens into result lines. `explain` replays the same packing without the model."""
from __future__ import annotations

import dataclasses
import functools
import sys
import time
import traceback
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from moejax.buckets import bucket
from moejax.costs import layer_flops_per_token
from moejax.engine import Engine
from moejax.models.kv_pool import BLOCK, Layer
from moejax.requests.bodies import Bodies, Choice
from moejax.requests.parse import MAX_LOGPROBS, CompletionRequest, Request, ScoreRequest
from moejax.requests.results import ResultStore, WriteFailed, error_line, ok_line
from moejax.sched import packing
from moejax.sched.batch_schedule import BatchSchedule, CompletionBatch, ScoreBatch
from moejax.sched.batch_size import ScoreBatchSize
from moejax.sched.continuous import GenRequest, Scheduler
from moejax.sched.pool_size import PoolSize
from moejax.sched.prefix_cache import PrefixCache, block_hashes
from moejax.sched.serving_options import SERVING_DEFAULTS, ServingOptions


@dataclasses.dataclass
class Metrics:
    requests_ok: int = 0
    requests_failed: int = 0  # this run: invalid lines and requests of failed batches
    requests_batch_failed: int = 0  # this run: requests of failed batches (500)
    requests_invalid: int = 0  # invalid input lines (400), written by this run or an earlier one
    requests_resumed: int = 0
    prompt_tokens: int = 0  # context tokens of all served requests (each sibling counts its whole context)
    cached_prompt_tokens: int = 0  # of those, taken from the cross-batch prefix cache
    computed_tokens: int = 0  # tokens actually run through the model in prefill (after all sharing)
    padded_tokens: int = 0  # batch slots including padding
    generated_tokens: int = 0
    decode_rows_useful: int = 0  # tokens made by decode steps
    decode_rows_computed: int = 0  # rows x decode iterations computed (padding and finished rows included)
    batches: int = 0
    wall_s: float = 0.0
    flops: float = 0.0  # matmul FLOPs of the computed tokens (attention scores excluded)

    def summary(self, peak_flops: float | None) -> dict:
        d = dataclasses.asdict(self)
        total = self.prompt_tokens + self.generated_tokens
        d["tokens_per_s"] = total / self.wall_s if self.wall_s else None
        d["prefix_cache_hit_rate"] = self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        d["shared_prefill_saving"] = 1 - self.computed_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        d["slot_utilisation"] = (self.decode_rows_useful / self.decode_rows_computed
                                 if self.decode_rows_computed else None)
        d["mfu_estimate"] = self.flops / self.wall_s / peak_flops if peak_flops and self.wall_s else None
        return d


# progress(requests just done, or None: the run ended; the metrics so far)
Progress = Callable[[int | None, Metrics], None]


@dataclasses.dataclass
class _Launched:
    """A scoring batch dispatched to the device (its log-probabilities not read yet), or the error that stopped it."""
    k: int
    rows: list | None = None
    padded_tokens: int = 0
    tags: list | None = None
    logprobs: jax.Array | None = None  # [B, G] on the device
    error: Exception | None = None


class Runner:
    def __init__(self, engine: Engine, schedule: BatchSchedule, requests: list, store: ResultStore | None, *,
                 progress: Progress | None = None, options: ServingOptions = SERVING_DEFAULTS,
                 kv_pool: PoolSize | None = None, batch_size: ScoreBatchSize | None = None,
                 cache: PrefixCache | None = None, pool: list[Layer] | None = None,
                 keep: frozenset[bytes] = frozenset()) -> None:
        """options.batching: "continuous" serves every completion through one scheduler (options' scheduler knobs)
        over a paged KV pool of kv_pool.blocks blocks (moejax.sched.continuous; explain shows how it was sized);
        "static" runs each planned completion batch as one prefill and one decode loop until its longest row ends.
        batch_size: how the schedule's scoring batches were sized (explain shows it). cache, pool: a prefix cache
        and its device pool that outlive this runner (an engine replica serving a run in shares,
        moejax.replicas.replica_session), used instead of the schedule's own; keep: blocks to store because a later
        share will read them (the schedule knows only its own batches)."""
        self.engine, self.schedule, self.requests, self.store = engine, schedule, requests, store
        self.progress = progress
        self.options, self.batching = options, options.batching
        self.kv_pool, self.kv_blocks = kv_pool, kv_pool.blocks if kv_pool is not None else 0
        self.batch_size = batch_size
        self.scheduler_stats: dict | None = None  # the continuous scheduler's counters, once it ran
        self.bodies = Bodies(engine.tokenizer, engine.name, store.fingerprint if store is not None else "")
        self.metrics = Metrics()
        self.done_s: dict[int, float] = {}  # input line -> seconds from the run's start to its result
        self._start = time.perf_counter()
        if cache is None and schedule.kv_cache:
            cache = PrefixCache(schedule.pool_blocks)
        self.cache, self.pool, self.keep = cache, pool, keep
        self.pool_blocks = cache.capacity if cache is not None else 0
        # static generation batches read and store prefix blocks where the placement's prefill can (lightning's
        # cannot: it computes every prompt token there, which changes no result)
        self._pooled_prefill = cache is not None and engine.placement.static_prefill_pool
        self.future = Counter(h for u in schedule.uses for h in u)
        # (request, sibling, candidate) -> summed logprob
        self._acc: defaultdict[tuple[int, int, int], float] = defaultdict(float)
        self._cached: dict[tuple[int, int], int] = {}  # (request, sibling) -> cached context tokens
        self._index = {r.line: i for i, r in enumerate(requests)}  # input line -> request index
        self._reads_left = {i: sum(len(r.contexts) * len(c.token_ids) for c in r.candidates)
                            for i, r in enumerate(requests) if isinstance(r, ScoreRequest)}
        cfg = engine.config
        self._flops_per_token = layer_flops_per_token(cfg)
        self._head_flops = 2 * cfg.vocab_size * cfg.hidden_size

    # -- packing (shared with explain) ----------------------------------------------------------------------
    def _want_store(self, h: bytes) -> bool:
        return self.schedule.store_all or self.future[h] > 0 or h in self.keep

    # -> score: (rows, (arrays, tags, span)) as packing.assemble gives them; completions: per request, (the prefix
    # blocks it reads, the (block, position) it stores). Any: which one is the batch's kind, not a type
    def prepare(self, k: int) -> tuple[Any, Any]:
        """Batch k's inputs: what it takes from and adds to the prefix cache, packed and padded."""
        for h in self.schedule.uses[k]:
            self.future[h] -= 1
        return self._pack(k)

    def _pack(self, k: int) -> tuple[Any, Any]:  # as prepare
        batch = self.schedule.batches[k]
        if self.cache is not None:
            self.cache.begin_batch()
        if batch.kind == "score":
            rows = [packing.pack_row(r, self.cache, self._want_store) for r in batch.rows]
            return rows, packing.assemble(rows, self.pool_blocks, self.engine.row_multiple)
        prior, stores = [], []
        for r in batch.requests:
            keep = []
            if self.cache is None or not self._pooled_prefill or not r.max_tokens:  # (echo only: no prefill runs)
                slots = []
            else:
                hashes = block_hashes(r.prompt)
                slots = self.cache.match(hashes[: (len(r.prompt) - 1) // BLOCK])
                for j, h in enumerate(hashes):
                    if h not in self.cache and self._want_store(h):
                        slot = self.cache.allocate(h)
                        if slot is not None:
                            keep.append((slot, j * BLOCK))
            prior.append(slots)
            stores.append(keep)
        return prior, stores

    # -- execution ------------------------------------------------------------------------------------------
    def run(self) -> Metrics:
        start = self._start = time.perf_counter()
        if self.pool_blocks and self.pool is None:
            self.pool = self.engine.init_pool(self.pool_blocks)
        continuous = []
        if self.batching == "continuous":  # completions do not read the scoring prefix cache: keep nothing for them
            for k, batch in enumerate(self.schedule.batches):
                if batch.kind != "score":
                    self.future.subtract(self.schedule.uses[k])
        pending = None  # the scoring batch on the device whose results are not read yet
        for k, batch in enumerate(self.schedule.batches):
            if batch.kind != "score" and self.batching == "continuous":
                continuous += batch.requests
                continue
            if batch.kind == "score":  # dispatched before the one in flight is read: the device never waits for us
                pending = self._finish_score(pending, self._launch_score(k, fresh=True))
                continue
            pending = self._finish_score(pending)
            try:
                self._run_completions(batch, *self.prepare(k))
            except WriteFailed:  # the results cannot be kept: stop (the journal keeps what it has)
                raise
            except Exception as e:  # a failing batch costs only its own requests
                traceback.print_exc(file=sys.stderr)
                self._fail_batch(batch, f"{type(e).__name__}: {e}")
            self.metrics.batches += 1
        self._finish_score(pending)
        if continuous:
            self._run_continuous(continuous)
        jax.effects_barrier()
        self.metrics.wall_s = time.perf_counter() - start
        return self.metrics

    def _launch_score(self, k: int, *, fresh: bool) -> _Launched:
        """Pack scoring batch k and dispatch it (JAX runs it asynchronously). fresh=False packs it again after the
        prefix cache was started afresh (a failed batch), without counting its uses a second time. An exception is
        kept, to be handled in batch order."""
        try:
            rows, (arrays, tags, span) = self.prepare(k) if fresh else self._pack(k)
            lp, self.pool = self.engine.score_packed(arrays, self.pool, span)
            return _Launched(k, rows, arrays["tokens"].size, tags, lp)
        except Exception as e:
            return _Launched(k, error=e)

    def _finish_score(self, launched: _Launched | None, following: _Launched | None = None) -> _Launched | None:
        """Read a launched batch's results (waiting for the device only here) and write them, or fail its requests;
        -> `following`, launched anew when the failure started the prefix cache afresh (it was packed against the
        old one, and results must not depend on the overlap)."""
        if launched is None:
            return following
        batch = self.schedule.batches[launched.k]
        error = launched.error
        if error is None:
            try:
                self._score_results(launched)
            except WriteFailed:  # the results cannot be kept: stop (the journal keeps what it has)
                raise
            except Exception as e:
                error = e
        if error is not None:  # a failing batch costs only its own requests
            traceback.print_exception(error, file=sys.stderr)
            self._fail_batch(batch, f"{type(error).__name__}: {error}")
            if self.cache is not None and following is not None:
                following = self._launch_score(following.k, fresh=False)
        self.metrics.batches += 1
        return following

    def _score_results(self, launched: _Launched) -> None:
        rows, tags = launched.rows, launched.tags
        assert rows is not None and tags is not None and launched.logprobs is not None  # launched without an error
        lp = self.engine.to_host(launched.logprobs)
        m = self.metrics
        m.computed_tokens += sum(len(r.tokens) for r in rows)
        m.padded_tokens += launched.padded_tokens
        m.flops += self._flops_per_token * sum(len(r.tokens) for r in rows) + \
            self._head_flops * sum(len(r.reads) for r in rows)
        finished = set()
        for b, row in enumerate(rows):
            self._cached.update(row.cached)
            for g, tag in enumerate(tags[b]):
                self._acc[tag] += float(lp[b, g])
                self._reads_left[tag[0]] -= 1
                if not self._reads_left[tag[0]]:
                    finished.add(tag[0])
        for i in sorted(finished):
            self._emit(i, self._score_body(i))

    def _score_body(self, i: int) -> dict:
        req = self.requests[i]
        lps = [[self._acc.pop((i, s, j)) for j in range(len(req.candidates))] for s in range(len(req.contexts))]
        cached = sum(self._cached.pop((i, s), 0) for s in range(len(req.contexts)))
        return self.bodies.score(req, self._rid(req), lps, cached)

    def _run_completions(self, batch: CompletionBatch, prior: list[list[int]], stores: list[list[tuple[int, int]]]
                         ) -> None:
        reqs = batch.requests
        gen = [k for k, r in enumerate(reqs) if r.max_tokens]  # max_tokens 0: echo of the prompt only
        gen_row = {k: i for i, k in enumerate(gen)}  # request -> its prefill row
        rows = [(k, c) for k in gen for c in range(reqs[k].n)]  # one decode row per choice
        stops = [self._stop_ids(reqs[k]) for k, _ in rows]
        outs: list[list[int]] = []
        if gen:  # (with_seed gave every request its seed)
            keys = jnp.stack([jax.random.fold_in(jax.random.key(cast(int, reqs[k].sampling.seed)), c) for k, c in rows])
            several = any(reqs[k].n > 1 for k in gen)
            outs, self.pool = self.engine.generate_rows(
                [list(reqs[k].prompt) for k in gen], [reqs[k].max_tokens for k, _ in rows],
                sampling=[reqs[k].sampling for k, _ in rows], keys=keys,
                stop_token_ids=stops, pool=self.pool,
                prior_blocks=[prior[k] for k in gen] if self._pooled_prefill else None,
                store_blocks=[stores[k] for k in gen] if self._pooled_prefill else None,
                expand=[gen_row[k] for k, _ in rows] if several else None)
        m = self.metrics
        new = [len(reqs[k].prompt) - BLOCK * len(prior[k]) for k in gen]
        m.computed_tokens += sum(new)
        if gen:
            m.padded_tokens += self.engine.padded_rows(len(gen)) * self.engine.padded_length(max(new))
            m.decode_rows_useful += sum(max(len(o) - 1, 0) for o in outs)  # the first token comes from prefill
            m.decode_rows_computed += self.engine.padded_rows(len(rows)) * max(max(map(len, outs)) - 1, 0)
        m.flops += self._flops_per_token * sum(new) + self._decode_flops(outs)
        self._finish_completions(reqs, {(k, c): out for (k, c), out in zip(rows, outs, strict=True)},
                                 {k: BLOCK * len(prior[k]) for k in range(len(reqs))})

    def _decode_flops(self, outs: Iterable[Sequence[int]]) -> float:
        return (self._flops_per_token + self._head_flops) * sum(map(len, outs))

    def _stop_ids(self, req: CompletionRequest) -> tuple[int, ...]:
        return tuple(req.stop_token_ids) + tuple(self.engine.config.eos_token_ids)

    def _finish_completions(self, reqs: Sequence[CompletionRequest], outs: dict, cached: dict) -> None:
        """Result bodies of completion requests from their choices' tokens (outs[(request, choice)]; cached[request]:
        prompt tokens taken from a cache): stop strings, log-probabilities, usage."""
        # An echo-only request (max_tokens 0) has one empty choice: the prompt, and its log-probabilities if asked.
        choices: dict[int, list[tuple[Choice, tuple[int, ...]]]] = {
            k: [] if r.max_tokens else [(Choice([], "length"), ())] for k, r in enumerate(reqs)}
        for k, r in enumerate(reqs):
            if r.max_tokens:
                choices[k] += [(Choice(outs[(k, c)], "length"), self._stop_ids(r)) for c in range(r.n)]
        logprobs = self._logprobs(reqs, choices)
        for k, r in enumerate(reqs):
            made, prompt_lps = [], logprobs.get((k, "prompt"))
            for c, (choice, st) in enumerate(choices[k]):
                if (k, c) in logprobs:
                    choice.logprobs, choice.top = logprobs[(k, c)]
                made.append(self.bodies.cut_at_stop(r, choice, st))
            self._emit(self._index[r.line], self.bodies.completion(r, self._rid(r), made, cached[k], prompt_lps))

    def _run_continuous(self, reqs: list[CompletionRequest]) -> None:
        """Every completion through one continuous-batching scheduler; a request's result is written when its
        last choice ends (while the next step runs)."""
        items: list[GenRequest] = []
        # request -> choice -> (tokens, cached prompt tokens)
        done: defaultdict[int, dict[int, tuple[list[int], int]]] = defaultdict(dict)
        failed: set[int] = set()
        for i, r in enumerate(reqs):
            assert r.sampling.seed is not None  # with_seed gave every request its seed
            for c in range(r.n if r.max_tokens else 1):
                key = jax.random.key_data(jax.random.fold_in(jax.random.key(r.sampling.seed), c))
                items.append(GenRequest(r.prompt, r.max_tokens, np.asarray(key), self._stop_ids(r), tuple(r.stop),
                                        r.sampling, tag=(i, c),
                                        text=functools.partial(self.bodies.generated_text, r)))

        def on_finish(g: GenRequest, tokens: list[int], cached: int) -> None:
            i, c = cast("tuple[int, int]", g.tag)  # (request, choice), as made above
            done[i][c] = (tokens, cached)
            r = reqs[i]
            if i in failed or len(done[i]) < (r.n if r.max_tokens else 1):
                return
            try:
                self._finish_completions([r], {(0, c): t for c, (t, _) in done[i].items()}, {0: done[i][0][1]})
            except WriteFailed:
                raise
            except Exception as e:
                traceback.print_exc(file=sys.stderr)
                on_fail(g, f"{type(e).__name__}: {e}")

        def on_fail(g: GenRequest, message: str) -> None:
            i = cast("tuple[int, int]", g.tag)[0]
            if i not in failed:
                failed.add(i)
                self._fail_requests([self._index[reqs[i].line]], message)

        options = {**self.engine.placement.scheduler_defaults(), **self.options.scheduler_keywords()}
        if self.engine.saturation is not None:  # streamed experts: chunk steps of at least Θ tokens hide the copies
            options.setdefault("chunk_tokens", max(512, bucket(self.engine.saturation.theta_tokens, 16)))
        sched = Scheduler(self.engine, self.kv_blocks, decode_text=self.bodies.decode, **options)
        stats = sched.run(items, on_finish, on_fail)
        m = self.metrics
        m.computed_tokens += stats.prefill_tokens
        m.padded_tokens += stats.prefill_slots
        m.decode_rows_useful += stats.decode_rows_useful
        m.decode_rows_computed += stats.decode_rows_computed
        m.flops += self._flops_per_token * stats.prefill_tokens + self._decode_flops(
            [t for i in done for t, _ in done[i].values()])
        self.scheduler_stats = stats.as_dict()

    def _logprobs(self, reqs: Sequence[CompletionRequest], choices: dict[int, list[tuple[Choice, tuple[int, ...]]]]
                  ) -> dict:
        """Log-probabilities of each choice's tokens (and, with echo, of the prompt's), from one teacher-forced
        pass over prompt + completion: {(request, choice): (logprobs, top), (request, "prompt"): ...}."""
        want = [k for k, r in enumerate(reqs) if r.logprobs is not None]
        if not want:
            return {}
        seqs, keys = [], []
        for k in want:
            r = reqs[k]
            for c, (choice, _) in enumerate(choices[k]):
                if choice.tokens or (r.echo and c == 0):
                    seqs.append(list(r.prompt) + choice.tokens)
                    keys.append((k, c))
        if not seqs:
            return {}
        top_k = 5 if max(cast(int, reqs[k].logprobs) for k in want) <= 5 else MAX_LOGPROBS  # (want: those given)
        out: dict[tuple[int, int | str], tuple[list[float], list[list[tuple[int, float]]]]] = {}
        for (k, c), (lp, top, ids) in zip(keys, self.engine.token_logprobs(seqs, top_k), strict=True):
            P = len(reqs[k].prompt)
            pairs = [list(zip(i.tolist(), v.tolist(), strict=True)) for i, v in zip(ids, top, strict=True)]
            out[(k, c)] = (lp[P - 1:].tolist(), pairs[P - 1:])
            if reqs[k].echo and c == 0:
                out[(k, "prompt")] = (lp[: P - 1].tolist(), pairs[: P - 1])
        return out

    def _rid(self, req: Request) -> str:
        return self.store.ids[req.line] if self.store is not None else f"req_{req.line}"

    def _emit(self, i: int, body: dict) -> None:
        req = self.requests[i]
        self.done_s[req.line] = time.perf_counter() - self._start
        self.metrics.requests_ok += 1
        self.metrics.prompt_tokens += body["usage"]["prompt_tokens"]
        self.metrics.cached_prompt_tokens += body["usage"]["cached_prompt_tokens"]
        self.metrics.generated_tokens += body["usage"].get("completion_tokens", 0)
        if self.store is not None:
            self.store.write(req.line, ok_line(req.line, req.custom_id, body, rid=self.store.ids[req.line]))
        if self.progress is not None:
            self.progress(1, self.metrics)

    def _fail_batch(self, batch: ScoreBatch | CompletionBatch, message: str) -> None:
        if batch.kind == "score":
            # a scoring read's tag: (request, sibling, candidate)
            idx = sorted({cast(tuple, tag)[0] for row in batch.rows for s in row for _, _, tag in s.reads})
        else:
            idx = [self._index[r.line] for r in batch.requests]
        self._fail_requests(idx, f"batch failed: {message}")
        if self.cache is not None:  # the pool may be gone (donated into the failed call): start it afresh
            self.cache.clear()
            self.pool = self.engine.init_pool(self.pool_blocks) if self.pool_blocks else None

    def _fail_requests(self, idx: Iterable[int], message: str) -> None:
        for i in idx:
            if i in self._reads_left:
                self._reads_left[i] = -1  # never emitted as ok
            req = self.requests[i]
            self.metrics.requests_failed += 1
            if self.store is not None:
                self.store.write(req.line, error_line(req.line, req.custom_id, message, code="internal_error",
                                                      status=500, rid=self.store.ids[req.line]))
