"""Continuous batching: a Python loop feeding jit-compiled paged steps (moejax.steps.paged_phases) over one KV block
pool.

Each iteration
1. admits waiting sequences, oldest first, while rows and blocks (and a pipelined placement's batch KV limit, MoE-
   Lightning's Alg. 2) allow: a sequence takes the published blocks of
   its longest indexed prefix (shared, never copied or written) and new blocks for the rest of its context;
   one whose next prefix block another sequence is computing right now waits for it instead of computing it too;
2. runs one chunked-prefill step: prompt chunks of the admitted sequences under a token budget (separate from
   decode steps: one shape family each);
3. runs one decode step: up to `decode_steps` tokens for every decoding sequence in one jit call, taking blocks
   as rows grow and preempting the youngest sequence (freeing its blocks; it is recomputed from its prompt and
   tokens so far when readmitted) when the pool runs out;
4. retires sequences at a stop token, a stop string or max_tokens and releases their blocks.
Steps run one behind the host, as vLLM's async scheduling does: the decode step is dispatched right behind the
chunk step, before the chunk's tokens are read, and in iterations without a chunk step before the previous decode
step's tokens are read; a row's input token that the host has not read yet (a prompt's first from the chunk, the
previous decode's last) is taken on the device, from the steps' `carry` (moejax.steps.paged_phases). So the host reads a
step's tokens, retires, admits and prepares the next steps while the device runs the one after it, and an iteration
waits on the device once. Where a chunk step runs, the previous decode step is read while the device runs the
chunk, so no decode row is spent on a sequence that has ended; otherwise a row whose sequence ended on a stop token
makes nothing, and one that ended on a stop string (which only the host sees) makes a step of tokens that are
dropped. Results of retired sequences (detokenisation, stop strings, writing) are delivered while a step runs.
`Stats.times` says where the time went (moejax.sched.step_times). Step shapes come from a small fixed set
(MIN_DECODE_ROWS and the comment above it), so a run compiles a handful of programs however many requests it
serves."""
from __future__ import annotations

import dataclasses
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
import numpy as np

from moejax.buckets import bucket, rows_bucket
from moejax.engine import Engine
from moejax.kernels.attention.paged_xla import blocks_per_step
from moejax.lightning.balance import BatchLimit
from moejax.models.kv_pool import BLOCK, Layer
from moejax.sampling import Sampling, SamplingParams, StepArray
from moejax.sched.block_pool import BlockPool
from moejax.sched.prefix_cache import block_hashes
from moejax.sched.step_times import StepTimes
from moejax.steps.rows import ChunkRows, PagedDecodeRows

# Step shapes come from a small fixed set, whatever the number of requests: chunk steps always have the chunk's
# most rows of row_tokens tokens; decode steps 16, 32, 64, ... rows (at most max_rows, bucketed); block tables
# 32, 64, 128, ... blocks. On a CPU a tiny model's program took about 3.5 s to compile (2026-11-26: 12 shapes, 41 s
# of XLA compiling, for 60 requests of a 1.5 s run), so a shape saved is worth far more than the padding it costs.
# A table's width costs next to nothing: paged attention reads only the blocks a row's queries see (XLA and Pallas
# alike), so the smallest width is wide (512 tokens) and most runs have one.
MIN_TABLE_BLOCKS, MIN_CHUNK, MIN_DECODE_ROWS = 32, 16, 16
# A decode row's work besides attention (projections, experts, head), in blocks of keys attention reads: measured
# on CPU with pycode-moe (64 rows: 77 ms per token at 8 blocks, 211 ms at 64), so a call's cost is about
# rows x (blocks its longest row reads + this).
ROW_COST_BLOCKS = 24


def _read_blocks(blocks: int) -> int:
    """Key blocks a row of `blocks` blocks costs in a decode call: attention runs whole loop steps
    (moejax.kernels.attention.paged_xla), up to the call's longest row."""
    step = blocks_per_step(BLOCK)
    return step * max(-(-blocks // step), 1)


@dataclasses.dataclass
class GenRequest:
    """One sequence to generate. key: raw PRNG key data (jax.random.key_data) its tokens are sampled with."""
    prompt: Sequence[int]
    max_tokens: int
    key: np.ndarray
    stop_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    sampling: SamplingParams = SamplingParams()  # its seed unused: `key` is this sequence's
    tag: object = None
    # the text stop strings are looked for in, of the generated tokens (None: the scheduler's decode_text)
    text: Callable[[Sequence[int]], str | None] | None = None


@dataclasses.dataclass
class Stats:
    chunk_steps: int = 0
    decode_steps: int = 0
    prefill_tokens: int = 0  # prompt (and recomputed) tokens run through the model
    prefill_slots: int = 0  # chunk steps' rows x length, padding included
    decode_rows_useful: int = 0  # tokens made by decode steps
    decode_rows_computed: int = 0  # rows x tokens the decode steps computed (padding and stopped rows included)
    chained_rows: int = 0  # decode rows dispatched before the step sampling their input token was read
    preemptions: int = 0
    kv_deferred: int = 0  # requests the batch's KV limit (batch_limit: Alg. 2's abort) put off to a later batch
    shared_tokens: int = 0  # prompt tokens taken from shared blocks
    peak_blocks: int = 0
    peak_rows: int = 0  # the most sequences one decode step carried
    run_s: float = 0.0  # wall time of the whole run
    chunk_s: float = 0.0  # wall time of chunk steps, dispatch to result (host work in between included)
    decode_s: float = 0.0  # the same for decode steps
    shapes: set = dataclasses.field(default_factory=set)  # (step, rows, length, table width, ...) compiled
    times: StepTimes = dataclasses.field(default_factory=StepTimes)  # where the wall time went, by phase

    def as_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "times"}
        d["shapes"] = len(self.shapes)
        d["breakdown"] = self.times.as_dict()
        d["slot_utilisation"] = (self.decode_rows_useful / self.decode_rows_computed
                                 if self.decode_rows_computed else None)
        return d


@dataclasses.dataclass(eq=False)
class _Seq:
    req: GenRequest
    out: list = dataclasses.field(default_factory=list)
    blocks: list = dataclasses.field(default_factory=list)
    order: int = -1  # admission order: preemption takes the youngest
    computed: int = 0  # leading context positions whose KV is in the pool
    published: int = 0  # leading blocks published or shared
    cached_tokens: int | None = None  # shared prompt tokens at first admission (what usage reports)
    done: bool = False
    slot: int | None = None  # its entry in the steps' carry while running (None: waiting or retired)
    ahead: int = 0  # tokens that dispatched steps sample for it and the host has not read yet

    @property
    def context(self) -> list[int]:
        return list(self.req.prompt) + self.out

    @property
    def target(self) -> int:
        """Positions prefill computes: the prompt, or after a preemption the prompt and every token but the last
        (decode writes the last one's KV as it makes the next)."""
        return len(self.req.prompt) + max(len(self.out) - 1, 0)

    @property
    def prefilling(self) -> bool:
        return self.computed < self.target


def _blocks_for(positions: int) -> int:
    return -(-positions // BLOCK)


# A chunk step's row: (sequence, tokens, first position)
_ChunkRow = tuple[_Seq, int, int]
# A dispatched chunk step (_launch_chunk): (rows, the rows sampled, riders, tokens on the device, shape, start time)
_ChunkLaunch = tuple[list[_ChunkRow], list[int], dict[_Seq, tuple[int, int]], jax.Array, tuple, float]
# A dispatched decode call: (its sequences, rows, their budgets, tokens on the device)
_DecodeCall = tuple[list[_Seq], int, np.ndarray, jax.Array]


class Scheduler:
    def __init__(self, engine: Engine, num_blocks: int, *, max_rows: int = 64, chunk_tokens: int = 512,
                 row_tokens: int = 64, decode_steps: int = 8, mixed: bool = False,
                 decode_text: Callable | None = None, decode_calls: int = 3,
                 batch_limit: BatchLimit | None = None) -> None:
        """chunk_tokens: a chunk step's budget (rows x row_tokens); row_tokens: its row length. mixed: while
        sequences prefill, decoding ones ride along in the chunk steps (one token each) instead of
        running their own decode steps. decode_text(tokens) -> str: for stop strings (a sequence with stop strings
        needs it). decode_calls: the most calls a decode step's rows are split into by length (_groups; a
        pipelined placement splits them itself and takes one). batch_limit: MoE-Lightning's Alg. 2 limits on the
        running batch (placement lightning's): a waiting request whose prompt and max_tokens Alg. 2 would not place
        beside the running ones' waits for a later batch, and shorter ones behind it may go first; a micro-batch's
        limit is raised to the run's longest request (prompt and max_tokens) where that is over it, and one request
        alone in the batch always runs."""
        if min(max_rows, chunk_tokens, row_tokens, decode_steps) < 1:
            raise ValueError(f"max_rows, chunk_tokens, row_tokens and decode_steps must be >= 1; got {max_rows}, "
                             f"{chunk_tokens}, {row_tokens}, {decode_steps}")
        self.engine, self.num_blocks = engine, int(num_blocks)
        self.max_rows, self.chunk_tokens, self.decode_steps = max_rows, chunk_tokens, decode_steps
        self.row_tokens = min(row_tokens, chunk_tokens)
        self.decode_text, self.mixed, self.decode_calls = decode_text, mixed, decode_calls
        self.batch_limit = batch_limit
        self._limit = batch_limit  # this run's: raised to hold its longest request (run)
        self.stats = Stats()
        self.blocks = BlockPool(self.num_blocks)
        self.pool: list[Layer] | None = None
        self.carry: jax.Array | None = None
        self._order = 0
        self._inflight: list[_DecodeCall] = []  # the decode step dispatched, not read yet

    # -- the loop ---------------------------------------------------------------------------------------------
    def run(self, requests: Sequence[GenRequest], on_finish: Callable, on_fail: Callable) -> Stats:
        """Generate every request. on_finish(request, tokens, cached_tokens) for each that ends;
        on_fail(request, message) for each that cannot be served (its own fault, or its step failed)."""
        t0 = time.perf_counter()
        self.waiting = [_Seq(r) for r in requests]
        self.running: list[_Seq] = []
        self._pending: dict[bytes, _Seq] = {}  # prompt block hash -> the running sequence computing it
        self._results: list[_Seq] = []
        self.on_finish, self._delivering = on_finish, False
        self._deferred: set[int] = set()  # id() of the sequences batch_limit has put off (each counted once)
        self._limit = self.batch_limit
        longest = max((len(r.prompt) + r.max_tokens for r in requests), default=0)
        if self._limit is not None and longest > self._limit.cache_tokens:  # as pool_size does: every request fits
            self._limit = dataclasses.replace(self._limit, cache_tokens=longest)
        if self.pool is None:
            self.pool = self.engine.init_pool(self.num_blocks, decode=True)
        self._slots = list(range(self.max_rows))[::-1]
        self.carry = jax.device_put(np.full((self.max_rows,), -1, np.int32))
        for s in list(self.waiting):
            # max_tokens 0: nothing to generate, so no KV blocks (an echo's log-probabilities come from the
            # caller's scoring pass), and never refused for the pool's size
            if s.req.max_tokens == 0:
                self.waiting.remove(s)
                on_finish(s.req, [], 0)
                continue
            why = self._refuse(s.req)
            if why:
                self.waiting.remove(s)
                on_fail(s.req, why)
        with self.stats.times.listening():
            self._loop(on_fail)
        self.stats.run_s += time.perf_counter() - t0
        return self.stats

    def _loop(self, on_fail: Callable[[GenRequest, str], None]) -> None:
        times = self.stats.times
        while self.waiting or self.running:
            times.steps["loop"] += 1  # iterations
            with times.phase("loop", "admit"):
                self._admit()
            try:
                prefilling = any(s.prefilling for s in self.running)
                riding = []
                if self.mixed and prefilling:  # decoding sequences ride in the chunk, their tokens from the host
                    self._read_decode()
                    riding = [s for s in self.running if not s.prefilling and not s.done]
                chunk = self._launch_chunk(self._grow(riding, 1) if riding else {}) if prefilling else None
                if riding:  # the riders' rows make a chunk (cast, not assert: a None fails here as before)
                    self._finish_chunk(cast("_ChunkLaunch", chunk))
                else:
                    if chunk is not None and self._inflight:
                        self._read_decode()  # while the device runs the chunk: no decode row for an ended sequence
                    # with the prompts the chunk completes, their first tokens still on the device
                    decoding = [s for s in self.running if not s.prefilling and not s.done]
                    if decoding or self._inflight:  # behind the chunk step, before its tokens are read
                        self._decode_step(decoding, chunk)
                    elif chunk is not None:
                        self._finish_chunk(chunk)
            except Exception as e:  # a failing step costs only the sequences in flight
                if self._delivering:  # raised by on_finish (e.g. results that cannot be written): not a step's
                    raise
                traceback.print_exc(file=sys.stderr)
                self._fail_running(f"{type(e).__name__}: {e}", on_fail)
                continue
            with times.phase("loop", "retire"):
                self._retire()
        self._inflight = []  # rows of ended sequences only
        with times.phase("loop", "deliver"):
            self._deliver()

    def _refuse(self, req: GenRequest) -> str | None:
        need = _blocks_for(len(req.prompt) + req.max_tokens)
        if need > self.num_blocks:
            return (f"needs {need} KV blocks of {BLOCK} tokens for its prompt and max_tokens, and the pool has "
                    f"{self.num_blocks}: raise the KV pool size (launch.serve --kv-pool-mb)")
        if req.stop_strings and self.decode_text is None and req.text is None:
            return "stop strings need a tokenizer to decode the text"
        return None

    # -- admission and release -------------------------------------------------------------------------------
    def _admit(self) -> None:
        for s in list(self.waiting):
            if len(self.running) >= self.max_rows:
                return
            assert not s.ahead, "a preempted sequence's tokens are read before it is readmitted"
            if not self._fits_batch(s):
                continue  # Alg. 2's abort: a later batch; a shorter request behind it may still fit this one
            ctx = s.context
            hashes = block_hashes(ctx, (len(ctx) - 1) // BLOCK)  # at least one token is computed
            shared = self.blocks.match(hashes)
            if len(shared) < len(hashes) and hashes[len(shared)] in self._pending:
                self.blocks.release(shared)  # another sequence is computing it: take it when published
                self.blocks.shared_hits -= len(shared)
                continue
            need = _blocks_for(len(ctx)) - len(shared)
            if need > self.blocks.available():
                self.blocks.release(shared)
                self.blocks.shared_hits -= len(shared)
                return  # oldest first: the next ones wait too
            s.blocks = shared + self.blocks.allocate(need)
            s.computed, s.published = len(shared) * BLOCK, len(shared)
            if s.cached_tokens is None:
                s.cached_tokens = len(shared) * BLOCK
                self.stats.shared_tokens += len(shared) * BLOCK
            for h in hashes[len(shared): len(s.req.prompt) // BLOCK]:
                self._pending.setdefault(h, s)
            s.order, self._order = self._order, self._order + 1
            s.slot = self._slots.pop()
            self.waiting.remove(s)
            self.running.append(s)
            self.stats.peak_blocks = max(self.stats.peak_blocks, self.blocks.in_use())

    def _fits_batch(self, s: _Seq) -> bool:
        """Whether batch_limit (None: no limit) lets s join the running sequences; counts the ones put off."""
        if self._limit is None or not self.running:
            return True
        need = lambda q: (len(q.req.prompt), q.req.max_tokens)  # noqa: E731  Alg. 2's input_len and gen_len
        if self._limit.admits([need(q) for q in self.running], need(s)):
            return True
        if id(s) not in self._deferred:
            self._deferred.add(id(s))
            self.stats.kv_deferred += 1
        return False

    def _release(self, s: _Seq) -> None:
        """Free its blocks and slot (steps dispatched before still write them: later steps run after those)."""
        self.blocks.release(s.blocks)
        s.blocks = []
        assert s.slot is not None  # a running sequence holds a slot
        self._slots.append(s.slot)
        s.slot = None
        for h in [h for h, owner in self._pending.items() if owner is s]:
            del self._pending[h]

    def _preempt(self, s: _Seq) -> None:
        """Free a running sequence's blocks; it is readmitted first and recomputes its context."""
        self._release(s)
        s.computed = s.published = 0
        self.running.remove(s)
        self.waiting.insert(0, s)
        self.stats.preemptions += 1

    def _retire(self) -> None:
        for s in [s for s in self.running if s.done]:
            self._release(s)
            self.running.remove(s)
            self._results.append(s)

    def _deliver(self) -> None:
        """Hand retired sequences to on_finish (called while a step is in flight)."""
        results, self._results = self._results, []
        self._delivering = True
        for s in results:
            self.on_finish(s.req, s.out, s.cached_tokens or 0)
        self._delivering = False

    def _fail_running(self, message: str, on_fail: Callable[[GenRequest, str], None]) -> None:
        for s in self.running:
            on_fail(s.req, f"step failed: {message}")
        for h in list(self._pending):
            del self._pending[h]
        for s in self.waiting:  # preempted with tokens unread: they are sampled again (the same) when readmitted
            s.ahead = 0
        self.running, self._inflight = [], []
        self.blocks = BlockPool(self.num_blocks)  # the pool may be gone (donated into the failed call)
        self.pool = self.engine.init_pool(self.num_blocks, decode=True)
        self._slots = list(range(self.max_rows))[::-1]
        self.carry = jax.device_put(np.full((self.max_rows,), -1, np.int32))

    # -- steps ------------------------------------------------------------------------------------------------
    def _wait(self, x: jax.Array, kind: str) -> np.ndarray:
        """The step's output on the host; retired sequences' results are delivered while it runs."""
        with self.stats.times.phase(kind, "deliver"):
            self._deliver()
        with self.stats.times.phase(kind, "wait"):
            return np.asarray(x)

    def _call(self, kind: str, shape: tuple, step: Callable[..., tuple[list[Layer], jax.Array, jax.Array]],
              rows: ChunkRows | PagedDecodeRows, **static: Any) -> jax.Array:
        """Call a step on its rows (moejax.steps.rows, of numpy arrays: the jitted call copies them, the keys as raw
        data); the call of a shape not run before traces and compiles (timed apart)."""
        times = self.stats.times
        new = shape not in self.stats.shapes
        self.stats.shapes.add(shape)
        times.steps[kind] += 1
        with times.phase(kind, "compile" if new else "dispatch"):
            self.pool, self.carry, out = step(self.pool, self.carry, rows, **static)
        return out

    def _table(self, seqs: Sequence[_Seq], rows: int) -> np.ndarray:
        width = bucket(max(len(s.blocks) for s in seqs), MIN_TABLE_BLOCKS)
        table = np.zeros((rows, width), np.int32)
        for r, s in enumerate(seqs):
            table[r, : len(s.blocks)] = s.blocks
        return table

    def _sampling(self, seqs: Sequence[_Seq], rows: int) -> Sampling:
        """The rows' Sampling, its keys as raw key data (the steps wrap them on the device)."""
        pad = rows - len(seqs)  # built as lists, converted once: a row at a time costs more (host time per step)
        count = np.array([len(s.out) + s.ahead for s in seqs] + [0] * pad, np.int32)
        keys = np.zeros((rows, *np.shape(seqs[0].req.key)), np.uint32)
        keys[: len(seqs)] = [s.req.key for s in seqs]
        return Sampling.of([s.req.sampling for s in seqs], keys, count, rows)

    def _launch_chunk(self, riders: dict[_Seq, tuple[int, int]]) -> _ChunkLaunch | None:
        """Dispatch one chunked-prefill step: the prefilling sequences' next tokens (oldest first) cut into rows of
        up to `row_tokens`, at most chunk_tokens // row_tokens rows. A long prompt fills several rows of one step:
        each layer writes every row's keys before any row attends, so a row reads the rows before it. With
        `riders` ({decoding sequence: (position, 1)}, mixed steps) their next token rides along as a 1-token row.
        -> what _finish_chunk reads the sampled tokens of, or None (no rows). Steps after it may be dispatched
        before it is read: they take the pool it returns, so the device runs them in order."""
        times = self.stats.times
        with times.phase("chunk", "prepare"):
            prepared = self._chunk_inputs(riders)
        if prepared is None:
            return None
        rows, sampled, shape, inputs, fresh = prepared
        t0 = time.perf_counter()
        tok = self._call("chunk", shape, self.engine.paged_chunk, inputs, fresh=fresh)
        with times.phase("chunk", "update"):
            for s, take, _ in rows:
                s.computed += take
            for r in sampled:
                rows[r][0].ahead += 1
            for s in {s for s, _, _ in rows if s not in riders}:
                self._publish(s)
        return rows, sampled, riders, tok, shape, t0

    def _finish_chunk(self, launched: _ChunkLaunch) -> None:
        """The chunk step's sampled tokens: a prompt's first token, a rider's next. A sequence preempted since the
        dispatch keeps its first token (sampled from its prompt's KV, which the step wrote before any later step
        reused its blocks) and recomputes the prompt when readmitted."""
        tok: StepArray  # on the device, then read to the host
        rows, sampled, riders, tok, shape, t0 = launched
        tok = self._wait(tok, "chunk")
        self.stats.chunk_s += time.perf_counter() - t0
        with self.stats.times.phase("chunk", "update"):
            self._chunk_results(rows, sampled, riders, tok, shape)

    def _chunk_inputs(self, riders: dict[_Seq, tuple[int, int]]
                      ) -> tuple[list[_ChunkRow], list[int], tuple, ChunkRows, bool] | None:
        """-> (rows [(sequence, tokens, first position)], the rows whose sampled token is their sequence's next (a
        rider's; a prompt's first, not a resumed sequence's), shape, ChunkRows, fresh), or None without rows."""
        rows = [(s, 1, start) for s, (start, _) in riders.items()]
        free = max(self.chunk_tokens // self.row_tokens - len(rows), 1)
        for s in sorted([s for s in self.running if s.prefilling], key=lambda s: s.order):
            pos = s.computed
            while pos < s.target and free:
                take = min(self.row_tokens, s.target - pos)
                rows.append((s, take, pos))
                pos, free = pos + take, free - 1
            if not free:
                break
        if not rows:
            return None
        seqs = [s for s, _, _ in rows]
        B = rows_bucket(max(len(rows), self.chunk_tokens // self.row_tokens), self.engine.row_multiple)
        T = bucket(self.row_tokens, MIN_CHUNK)
        tokens = np.zeros((B, T), np.int32)
        start, n = np.zeros((B,), np.int32), np.zeros((B,), np.int32)
        slot = np.full((B,), self.max_rows, np.int32)  # out of the carry's range: the row's token is not kept
        sampled = [r for r, (s, take, first) in enumerate(rows)
                   if s in riders or (first + take == s.target and not s.out)]
        for r in sampled:
            slot[r] = cast(int, rows[r][0].slot)  # a running sequence holds a slot
        for r, (s, take, first) in enumerate(rows):
            tokens[r, :take] = s.context[first: first + take]
            start[r], n[r] = first, take
            self.blocks.check_writable(s.blocks[first // BLOCK: _blocks_for(first + take)])
        table = self._table(seqs, B)
        fresh = not start.any()
        inputs = ChunkRows(tokens, start, n, table, slot, self._sampling(seqs, B))
        return rows, sampled, ("chunk", B, T, table.shape[1], fresh), inputs, fresh

    def _chunk_results(self, rows: list[_ChunkRow], sampled: list[int], riders: dict, tok: np.ndarray, shape: tuple
                       ) -> None:
        _, B, T, _, _ = shape
        self.stats.chunk_steps += 1
        self.stats.prefill_tokens += sum(t for s, t, _ in rows if s not in riders)
        self.stats.prefill_slots += B * T
        self.stats.decode_rows_useful += len(riders)
        for r in sampled:
            rows[r][0].ahead -= 1
            self._took(rows[r][0], [int(tok[r])])
        self.stats.decode_rows_computed += len(riders) * T  # a rider's row is as wide as the chunk

    def _publish(self, s: _Seq) -> None:
        """Index the prompt blocks a dispatched step has completed (later steps read them written)."""
        full = min(s.computed, len(s.req.prompt)) // BLOCK
        if full > s.published:
            hashes = block_hashes(s.req.prompt, full)
            for j in range(s.published, full):
                self.blocks.publish(s.blocks[j], hashes[j])
                if self._pending.get(hashes[j]) is s:
                    del self._pending[hashes[j]]
            s.published = full

    def _grow(self, decoding: list[_Seq], tokens: int) -> dict:
        """Blocks for up to `tokens` more tokens of each decoding sequence after those in flight (as if every row
        makes its whole budget), oldest first, preempting the youngest running sequence while the pool is out of
        blocks. -> {sequence: (first position written, tokens)}; a sequence whose max_tokens are all in flight
        gets none."""
        want = {}
        for s in sorted(decoding, key=lambda s: s.order):
            start = len(s.req.prompt) + len(s.out) + s.ahead - 1
            if s.req.max_tokens - len(s.out) - s.ahead < 1:
                continue
            while s.slot is not None and (len(s.blocks) + self.blocks.available()) * BLOCK - start < 1:
                self._preempt(max(self.running, key=lambda q: q.order))
            if s.slot is None:  # preempted itself (the youngest), or for an older one before
                continue
            fit = (len(s.blocks) + self.blocks.available()) * BLOCK - start
            wanted = min(tokens, s.req.max_tokens - len(s.out) - s.ahead, fit)
            extra = _blocks_for(start + wanted) - len(s.blocks)
            if extra > 0:
                s.blocks += self.blocks.allocate(extra)
            self.blocks.check_writable(s.blocks[start // BLOCK: _blocks_for(start + wanted)])
            want[s] = (start, wanted)
        want = {s: w for s, w in want.items() if s.slot is not None}
        self.stats.peak_blocks = max(self.stats.peak_blocks, self.blocks.in_use())
        return want

    def _decode_step(self, decoding: list[_Seq], chunk: _ChunkLaunch | None = None) -> None:
        """Dispatch up to decode_steps tokens for every decoding sequence (one jit call per group of rows:
        _groups), then read `chunk` (a chunk step dispatched just before: _launch_chunk) and the decode step
        dispatched in the iteration before, while the new one runs. A row whose input token is not read yet
        takes it on the device (chain)."""
        K, times = self.decode_steps, self.stats.times
        with times.phase("decode", "prepare"):
            want = self._grow(decoding, K)
            seqs = [s for s in decoding if s in want]
            self.stats.peak_rows = max(self.stats.peak_rows, len(seqs))
            groups = self._groups(seqs, self.decode_calls) if seqs else []
        t0, calls = time.perf_counter(), []
        for group in groups:
            with times.phase("decode", "prepare"):
                B = self._decode_rows(len(group))
                pad = [0] * (B - len(group))
                start = np.array([want[s][0] for s in group] + pad, np.int32)
                budget = np.array([want[s][1] for s in group] + pad, np.int32)
                slot = np.array([s.slot for s in group] + [self.max_rows] * len(pad), np.int32)
                chain = np.array([s.ahead > 0 for s in group] + pad, bool)
                last = np.array([0 if s.ahead else s.out[-1] for s in group] + pad, np.int32)
                width = bucket(max(len(s.req.stop_ids) for s in group), 4)
                stops = np.full((B, width), -1, np.int32)
                for r, s in enumerate(group):
                    if s.req.stop_ids:
                        stops[r, : len(s.req.stop_ids)] = s.req.stop_ids
                table = self._table(group, B)
                inputs = PagedDecodeRows(last, chain, start, budget, table, slot, stops, self._sampling(group, B))
                for s in group:
                    s.ahead += want[s][1]
                self.stats.chained_rows += int(chain.sum())
            shape = ("decode", B, K, table.shape[1], width)  # width: of the stop-id lists
            out = self._call("decode", shape, self.engine.paged_decode, inputs, steps=K)
            calls.append((group, B, budget[: len(group)], out))
        previous, self._inflight = self._inflight, calls
        self._read_decode(previous)
        if chunk is not None:
            self._finish_chunk(chunk)
        if calls or previous:
            self.stats.decode_s += time.perf_counter() - t0

    def _read_decode(self, calls: list[_DecodeCall] | None = None) -> None:
        """Read a dispatched decode step's tokens (by default the one in flight). A sequence ended since it was
        dispatched (on a stop string) drops them; one preempted since keeps them (sampled from KV the step read
        before any later step reused its blocks)."""
        if calls is None:
            calls, self._inflight = self._inflight, []
        times = self.stats.times
        out: StepArray  # on the device, then read to the host
        for group, B, budget, out in calls:
            out = self._wait(out, "decode")
            with times.phase("decode", "update"):
                made = (out[: len(group)] >= 0).sum(axis=1)
                self.stats.decode_steps += 1
                self.stats.decode_rows_computed += B * int(made.max())
                for r, s in enumerate(group):
                    s.ahead -= int(budget[r])
                    if s.done:
                        continue
                    self.stats.decode_rows_useful += int(made[r])
                    if s.slot is not None:  # running (a preempted sequence recomputes its context)
                        s.computed += int(made[r])
                    self._took(s, out[r, : made[r]].tolist())

    def _took(self, s: _Seq, tokens: list[int]) -> None:
        """A dispatched step's tokens for s; a preempted sequence they end goes to the results from the waiting."""
        self._extend(s, tokens)
        if s.done and s in self.waiting:
            self.waiting.remove(s)
            self._results.append(s)

    def _decode_rows(self, n: int) -> int:
        """A decode call's rows for n sequences: powers of two from MIN_DECODE_ROWS up to max_rows' (a few shapes
        for any run), rounded to a multiple of the devices that split rows."""
        return rows_bucket(min(max(n, MIN_DECODE_ROWS), self.max_rows), self.engine.row_multiple)

    def _cost(self, seqs: Sequence[_Seq]) -> int:
        """A decode call's work, in row-blocks: rows x (blocks its longest row reads + ROW_COST_BLOCKS)."""
        return self._decode_rows(len(seqs)) * (_read_blocks(max(len(s.blocks) for s in seqs)) + ROW_COST_BLOCKS)

    def _groups(self, seqs: list[_Seq], most: int = 3) -> list[list[_Seq]]:
        """Decode rows in up to `most` calls by length, where that costs less: a call computes every row's
        attention up to its longest row's keys, so short rows in a call with long ones pay for them."""
        seqs = sorted(seqs, key=lambda s: len(s.blocks))
        reads = [_read_blocks(len(s.blocks)) for s in seqs]
        best, cut = self._cost(seqs), None
        for i in range(1, len(seqs) if most > 1 else 0):
            if reads[i] != reads[i - 1] and self._cost(seqs[:i]) + self._cost(seqs[i:]) < best:
                best, cut = self._cost(seqs[:i]) + self._cost(seqs[i:]), i
        return [seqs] if cut is None else self._groups(seqs[:cut], most - 1) + [seqs[cut:]]

    def _extend(self, s: _Seq, tokens: list[int]) -> None:
        """Append new tokens; the sequence is done at a stop token, a stop string or max_tokens."""
        s.out += tokens
        r = s.req
        if len(s.out) >= r.max_tokens or (s.out and s.out[-1] in r.stop_ids):
            s.done = True
        elif r.stop_strings:
            decode = r.text or self.decode_text
            assert decode is not None  # `_refuse` refuses stop strings without one
            text = decode(s.out)
            s.done = text is not None and any(x in text for x in r.stop_strings)
