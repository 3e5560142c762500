"""Log-likelihoods of (context, continuation) token pairs through moejax's prefix-shared scoring.

Pairs are grouped by context: each distinct context is one scoring request whose candidates are its
continuations, so the planner (moejax.sched.batch_schedule) puts them in one token tree and the context is computed once
for all of them (sibling decomposition); contexts that share leading blocks (few-shot prompts) share them too, in
one tree or, across batches, through the prefix KV cache (the batch runner's `auto` policy: only blocks a later
batch reads are kept). Batch k+1 is packed and dispatched before batch k's results are read, as the runner does."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import numpy as np

from moejax.engine import Engine
from moejax.requests.parse import Candidate, ScoreRequest
from moejax.sched.batch import kv_cache_mode
from moejax.sched.batch_schedule import schedule_batches
from moejax.sched.batch_size import score_batch_size
from moejax.sched.packing import Row
from moejax.sched.prefix_cache import cache_blocks
from moejax.sched.runner import Runner


@dataclasses.dataclass
class ScoringStats:
    pairs: int = 0
    contexts: int = 0  # distinct contexts
    sequence_tokens: int = 0  # tokens of every pair as its own sequence (context + continuation, last not fed)
    computed_tokens: int = 0  # tokens run through the model after sharing (trees and the prefix cache)
    cached_tokens: int = 0  # context tokens whose KV came from the prefix cache (batches after the first)
    batches: int = 0


class Scorer:
    """Scores token pairs on one engine; its compiled steps are kept between calls."""

    def __init__(self, engine: Engine, *, max_batch_tokens: int | None = None, prefix_cache_mb: float = 1024.0,
                 kv_cache: str = "auto") -> None:
        self.engine = engine
        self.max_batch_tokens = max_batch_tokens
        self.prefix_cache_mb = prefix_cache_mb
        self.kv_cache = kv_cache
        kv_cache_mode(engine, kv_cache)  # kv_cache on where the placement keeps no prefix pool: refused here
        self.stats = ScoringStats()

    def score(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
              progress: Callable[[list[int]], None] | None = None) -> list[tuple[float, bool]]:
        """pairs: (context tokens, continuation tokens), both non-empty. -> (sum of the continuation's
        log-probabilities after the context, whether every continuation token is the greedy one), in pair order.
        progress(indices): called with the pairs each batch completes."""
        if not pairs:
            return []
        engine = self.engine
        limit = engine.config.max_position_embeddings
        contexts: dict[tuple[int, ...], dict[tuple[int, ...], list[int]]] = {}
        for i, (ctx, cont) in enumerate(pairs):
            ctx, cont = tuple(int(t) for t in ctx), tuple(int(t) for t in cont)
            if not ctx or not cont:
                raise ValueError(f"pair {i}: the context and the continuation need a token each; got "
                                 f"{len(ctx)} and {len(cont)}")
            if len(ctx) + len(cont) - 1 > limit:
                raise ValueError(f"pair {i}: {len(ctx)} context + {len(cont)} continuation tokens exceed the "
                                 f"model's context of {limit} (+1: the last token is read, not fed)")
            bad = [t for t in ctx + cont if not 0 <= t < engine.config.vocab_size]
            if bad:
                raise ValueError(f"pair {i}: token id {bad[0]} is outside the vocabulary [0, "
                                 f"{engine.config.vocab_size})")
            contexts.setdefault(ctx, {}).setdefault(cont, []).append(i)
        requests = [ScoreRequest(line=k + 1, custom_id="", prompt=ctx,
                                 suffixes=(), candidates=tuple(Candidate(None, c) for c in conts))
                    for k, (ctx, conts) in enumerate(contexts.items())]
        owners = [list(conts.values()) for conts in contexts.values()]  # [request][candidate] -> pair indices
        self.stats.pairs += len(pairs)
        self.stats.contexts += len(requests)
        self.stats.sequence_tokens += sum(len(c) + len(t) - 1 for c, t in pairs)
        return self._run(requests, owners, len(pairs), progress)

    def _run(self, requests: list[ScoreRequest], owners: list[list[list[int]]], n: int,
             progress: Callable[[list[int]], None] | None) -> list[tuple[float, bool]]:
        engine = self.engine
        longest = max((len(r.prompt) + len(c.token_ids) - 1 for r in requests for c in r.candidates), default=0)
        kv_cache, _ = kv_cache_mode(engine, self.kv_cache)  # a placement without a prefix pool: off
        reserved = 0.0 if kv_cache == "off" else self.prefix_cache_mb * 2**20
        sizing = score_batch_size(engine, self.max_batch_tokens, longest=longest, reserved_bytes=reserved)
        schedule = schedule_batches(list(enumerate(requests)), max_batch_tokens=sizing.tokens, kv_cache=kv_cache,
                                    cache_blocks=cache_blocks(engine, self.prefix_cache_mb), score_batch=sizing)
        # The batch runner's packing (prefix-cache table, blocks stored only while a later batch reads them), as
        # explain uses it; the step is the engine's greedy scoring (Engine.score_packed_greedy).
        packer = Runner(engine, schedule, requests, None)
        pool = engine.init_pool(schedule.pool_blocks) if schedule.pool_blocks else None
        logprob = np.zeros(n, np.float64)
        greedy = np.ones(n, bool)
        reads_left = [sum(len(c.token_ids) for c in r.candidates) for r in requests]  # until a context is done

        # a launched batch: (rows, their reads' tags (request, sibling, candidate), (logprobs, greedy) on the device)
        def launch(k: int) -> tuple[list[Row], list[list[tuple[int, int, int]]], tuple[jax.Array, jax.Array]]:
            rows, (arrays, tags, span) = packer.prepare(k)
            nonlocal pool
            out, pool = engine.score_packed_greedy(arrays, pool, span)
            return rows, tags, out

        def finish(launched: tuple[list[Row], list[list[tuple[int, int, int]]], tuple[jax.Array, jax.Array]]
                   ) -> None:
            lp: jax.Array | np.ndarray  # on the device, then on the host
            flags: jax.Array | np.ndarray
            rows, tags, (lp, flags) = launched
            lp, flags = engine.to_host(lp), engine.to_host(flags)
            self.stats.computed_tokens += sum(len(r.tokens) for r in rows)
            self.stats.cached_tokens += sum(n for r in rows for n in r.cached.values())
            self.stats.batches += 1
            done = []
            for b, row_tags in enumerate(tags):
                for g, (r, _, j) in enumerate(row_tags):
                    for i in owners[r][j]:
                        logprob[i] += float(lp[b, g])
                        greedy[i] &= bool(flags[b, g])
                    reads_left[r] -= 1
                    if not reads_left[r]:
                        done += [i for same in owners[r] for i in same]
            if progress is not None and done:
                progress(done)

        pending = None
        for k in range(len(schedule.batches)):
            launched = launch(k)  # dispatched before the one in flight is read: the device never waits for us
            if pending is not None:
                finish(pending)
            pending = launched
        if pending is not None:
            finish(pending)
        return [(float(logprob[i]), bool(greedy[i])) for i in range(n)]
