"""The batch schedule of a file of requests: scoring sequences grouped into prefix trees and packed into rows,
rows and completions packed into batches under a token budget, and the prefix-cache policy. A schedule is data:
`describe` prints it (`--explain`) and the runner executes it."""
from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Literal

from moejax.buckets import bucket, fine_bucket
from moejax.config import ModelConfig
from moejax.costs import true_prefill_flops
from moejax.models.kv_pool import BLOCK
from moejax.requests.parse import CompletionRequest, ScoreRequest
from moejax.sched.batch_size import ScoreBatchSize
from moejax.sched.packing import MIN_ROW, ScoreSeq, _lcp, tree_size
from moejax.sched.prefix_cache import BlockHolder, PrefixCache, block_hashes

KV_MODES = ("auto", "on", "off")
# The order scoring batches are made and run in: longest trees first, filled to Θ under streamed experts (moejax's),
# or shortest estimated prefill first (PrefillOnly's, a baseline: pack_spf_batches)
ORDERS = ("longest", "spf")


@dataclasses.dataclass
class ScoreBatch:
    rows: list[list[ScoreSeq]]
    kind: Literal["score"] = "score"


@dataclasses.dataclass
class CompletionBatch:
    requests: list[CompletionRequest]
    kind: Literal["completion"] = "completion"


@dataclasses.dataclass
class BatchSchedule:
    batches: list[ScoreBatch | CompletionBatch]
    kv_cache: bool  # keep a cross-batch prefix KV cache
    store_all: bool  # store every full context block (on), or only blocks a later batch will read (auto)
    reason: str
    pool_blocks: int  # prefix-cache pool size (blocks); 0 when off
    uses: list[set[bytes]]  # block hashes each batch could read or store


def score_sequences(index: int, req: ScoreRequest) -> list[ScoreSeq]:
    """One sequence per (sibling, candidate): context + candidate[:-1], reading every candidate token.
    Tags are (request index, sibling, candidate)."""
    out = []
    for s, ctx in enumerate(req.contexts):
        for j, cand in enumerate(req.candidates):
            toks = cand.token_ids
            reads = tuple((len(ctx) - 1 + k, toks[k], (index, s, j)) for k in range(len(toks)))
            out.append(ScoreSeq(ctx + toks[:-1], len(ctx), (index, s), reads))
    return out


def group_trees(seqs: Sequence[tuple[int, ScoreSeq]], cap: int) -> list[list[ScoreSeq]]:
    """Sort sequences so shared prefixes are adjacent, then cut them into trees of at most `cap` tokens. A
    sequence joins the tree before it when it belongs to the same request or shares at least one block."""
    ordered = sorted(seqs, key=lambda x: x[1].tokens)
    trees: list[list[ScoreSeq]] = []
    prev: tuple[int, ...] = ()
    size, prev_req = 0, None
    for req, s in ordered:
        lcp = _lcp(prev, s.tokens)
        grow = len(s.tokens) - lcp
        if trees and (req == prev_req or lcp >= BLOCK) and size + grow <= cap:
            trees[-1].append(s)
            size += grow
        else:
            trees.append([s])
            size = len(s.tokens)
        prev, prev_req = s.tokens, req
    return trees


def row_length(largest: int) -> int:
    """Rows as long as the largest tree (fine buckets keep its padding under a third). Attention reads each
    query's own tree (blocked tree attention), but a row of several trees pays the widest window for every query,
    so rows longer than a tree only add work; smaller trees still share a row."""
    return fine_bucket(largest, MIN_ROW)


def pack_score_batches(trees: list[list[ScoreSeq]], max_batch_tokens: int, min_flops: float = 0.0,
                       flops_of: Callable[[list[ScoreSeq], PrefixCache | None], float] | None = None,
                       max_tokens: int | None = None, cache: PrefixCache | None = None) -> list[ScoreBatch]:
    """Longest first; each batch fills its rows by placing the next tree into the row with the fewest tokens
    (MoE-Lightning, Alg. 2); trees that no longer fit wait for the next batch. With a FLOPs floor (MoE-Prefill's
    Θ: streamed experts are hidden only behind that much compute), a batch doubles its rows past the token budget
    until the FLOPs of what it holds (`flops_of(tree, cache)`, Eq. 2, in Θ's unit: `tree_flops`) reach the floor,
    nothing is left to add or twice the rows would pass `max_tokens` (what memory allows). `cache`: the cross-batch
    prefix cache, replayed here as the batches are made (each batch stores its contexts' blocks), so a batch's FLOPs
    do not count as new the context blocks earlier batches left there."""
    pending = sorted(((tree_size(t), t) for t in trees), key=lambda x: -x[0])
    batches = []
    while pending:
        total = sum(size for size, _ in pending)
        T = row_length(pending[0][0])
        most = -(-total // T)
        nrows = min(1 << (max(1, max_batch_tokens // T).bit_length() - 1), most)
        while True:
            rows: list[list[ScoreSeq]] = [[] for _ in range(nrows)]
            sums, left = [0] * nrows, []
            for size, tree in pending:
                r = min(range(nrows), key=sums.__getitem__)
                if sums[r] + size <= T:
                    rows[r].extend(tree)
                    sums[r] += size
                else:
                    left.append((size, tree))
            room = max_tokens is None or 2 * nrows * T <= max_tokens
            if not (min_flops and left and nrows < most and room):
                break
            assert flops_of is not None  # a FLOPs floor comes with its counter
            if sum(flops_of(t, cache) for _, t in pending) - sum(flops_of(t, cache) for _, t in left) >= min_flops:
                break
            nrows = min(2 * nrows, most)
        batches.append(ScoreBatch([r for r in rows if r]))
        if cache is not None:
            _store_contexts(cache, batches[-1])
        pending = left
    return batches


def pack_spf_batches(trees: list[list[ScoreSeq]], max_batch_tokens: int,
                     flops_of: Callable[[list[ScoreSeq], PrefixCache | None], float],
                     cache: PrefixCache | None = None) -> list[ScoreBatch]:
    """Shortest prefill first, the scheduler of PrefillOnly (arXiv 2505.07203), MoE-Prefill's baseline (§8.1): each
    batch takes the trees of least estimated prefill time, in that order, while they fit its rows (rows as long as
    its largest tree, as many as the token budget holds, each tree into the row with the fewest tokens); no FLOPs
    floor. The estimate is continuous: before each batch every waiting tree is priced again (`flops_of(tree,
    cache)`: true FLOPs, Eq. 2, proportional to the prefill time at a fixed rate) against the prefix cache as the
    batches before it leave it (`cache`, replayed here), so a request whose prefix an earlier batch stored moves
    ahead. Ties keep the trees' order."""
    pending = [(tree_size(t), t) for t in trees]
    batches: list[ScoreBatch] = []
    while pending:
        order = sorted(range(len(pending)), key=lambda i: flops_of(pending[i][1], cache))
        taken: list[int] = []
        rows: list[list[ScoreSeq]] = [[]]
        for i in order:
            trial = _fill_rows([pending[j] for j in taken + [i]], max_batch_tokens)
            if trial is None:
                break
            taken.append(i)
            rows = trial
        batches.append(ScoreBatch([r for r in rows if r]))
        if cache is not None:
            _store_contexts(cache, batches[-1])
        chosen = set(taken)
        pending = [p for i, p in enumerate(pending) if i not in chosen]
    return batches


def _fill_rows(trees: list[tuple[int, list[ScoreSeq]]], max_batch_tokens: int) -> list[list[ScoreSeq]] | None:
    """`trees` (size, tree), in order, into one batch's rows (pack_score_batches' rows: as long as the largest tree,
    a power of two of them within the token budget, each tree to the row with the fewest tokens) -> the rows, or None
    when one does not fit (a single tree always does)."""
    T = row_length(max(size for size, _ in trees))
    nrows = 1 << (max(1, max_batch_tokens // T).bit_length() - 1)
    rows: list[list[ScoreSeq]] = [[] for _ in range(nrows)]
    sums = [0] * nrows
    for size, tree in trees:
        r = min(range(nrows), key=sums.__getitem__)
        if sums[r] + size > T:
            return None
        rows[r].extend(tree)
        sums[r] += size
    return rows


def _store_contexts(cache: PrefixCache, batch: ScoreBatch) -> None:
    """What running `batch` does to the prefix cache, as packing.pack_row does it row by row: read each context's
    cached blocks, then store its other full blocks. Every block is stored, as under kv_cache "on"; "auto" keeps
    only blocks a later batch reads (in a pool no larger), so this counts no more cache hits than it will find."""
    cache.begin_batch()
    for row in batch.rows:
        contexts = {s.tokens[: s.context_len] for s in row}
        hashes = [block_hashes(ctx) for ctx in contexts]
        for h in hashes:
            cache.match(h)
        for h in hashes:
            for block in h:
                if block not in cache:
                    cache.allocate(block)
    cache.begin_batch()  # what this batch stored is readable by the next


def tree_flops(cfg: ModelConfig) -> Callable[[list[ScoreSeq], BlockHolder | None], float]:
    """-> flops_of(tree, cache=None): MoE-Prefill Eq. 2 summed over a prefix tree's sequences, each computing the
    tokens it does not share with the one before it (sorted), after the shared part. With the cross-batch prefix
    `cache` (what earlier batches stored), a sequence's leading context blocks found there are context, not new
    tokens (their KV is read; attention to them still costs), up to its last context token, which is read and so
    recomputed (packing.pack_row). The cache is counted per sequence, by its own context's blocks. True FLOPs,
    attention included (moejax.costs.true_prefill_flops): the unit Θ is in, Eq. 1 and Eq. 3 alike, so a batch
    admitted at Θ holds the compute Θ stands for."""
    def flops_of(tree: list[ScoreSeq], cache: BlockHolder | None = None) -> float:
        total = 0.0
        prev: tuple[int, ...] = ()
        for s in sorted(tree, key=lambda s: s.tokens):
            done = _lcp(prev, s.tokens)
            if cache is not None:
                hits = cache.readable(block_hashes(s.tokens[: s.context_len]))
                done = max(done, min(hits * BLOCK, s.context_len - 1))
            total += true_prefill_flops(cfg, len(s.tokens) - done, done)
            prev = s.tokens
        return total
    return flops_of


def pack_completion_batches(reqs: Sequence[CompletionRequest], max_batch_tokens: int) -> list[CompletionBatch]:
    """Longest (prompt + max_tokens) first; a batch grows while rows (one per choice) x padded cache length fits
    the budget."""
    ordered = sorted(reqs, key=lambda r: -(len(r.prompt) + r.max_tokens))
    batches: list[CompletionBatch] = []
    cur: list[CompletionRequest] = []
    for r in ordered:
        trial = cur + [r]
        cache = bucket(max(len(x.prompt) for x in trial), MIN_ROW) + bucket(max(x.max_tokens for x in trial), MIN_ROW)
        if cur and bucket(sum(x.n for x in trial)) * cache > max_batch_tokens:
            batches.append(CompletionBatch(cur))
            trial = [r]
        cur = trial
    if cur:
        batches.append(CompletionBatch(cur))
    return batches


def batch_hashes(batch: ScoreBatch | CompletionBatch) -> set[bytes]:
    if batch.kind == "score":
        return {h for row in batch.rows for s in row for h in block_hashes(s.tokens[: s.context_len])}
    return {h for r in batch.requests for h in block_hashes(r.prompt)}


def schedule_batches(requests: Sequence[tuple[int, ScoreRequest | CompletionRequest]], *, max_batch_tokens: int,
                     kv_cache: str = "auto", cache_blocks: int = 0, min_batch_flops: float = 0.0,
                     config: ModelConfig | None = None, score_batch: ScoreBatchSize | None = None,
                     order: str = "longest") -> BatchSchedule:
    """requests: (index, request). max_batch_tokens: the token budget of a batch; score_batch: the scoring batches'
    own, when they were sized apart (from the device: moejax.sched.batch_size), with the most tokens of one tree and
    of one batch. cache_blocks: the most blocks the prefix cache may hold. min_batch_flops: a FLOPs floor for scoring
    batches (Θ; needs the model's `config` to count FLOPs), in which context tokens that the prefix cache will
    supply (kv_cache not off) count as attended context, not as new tokens. order: how scoring batches are made and
    ordered (ORDERS): longest (pack_score_batches) or spf (pack_spf_batches: needs `config`; no FLOPs floor)."""
    if kv_cache not in KV_MODES:
        raise ValueError(f"kv_cache must be one of {KV_MODES}; got {kv_cache!r}")
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}; got {order!r}")
    sized = score_batch or ScoreBatchSize(max_batch_tokens, None, max_batch_tokens, "")
    seqs = [(i, s) for i, r in requests if isinstance(r, ScoreRequest) for s in score_sequences(i, r)]
    flops_of = None
    if min_batch_flops:
        assert config is not None, "schedule_batches: a FLOPs floor needs the model's config"
        flops_of = tree_flops(config)
    # The FLOPs floor counts context the prefix cache will supply as context (replayed as the batches are made)
    replay = PrefixCache(cache_blocks) if flops_of is not None and kv_cache != "off" else None
    trees = group_trees(seqs, sized.tree_tokens)
    batches: list[ScoreBatch | CompletionBatch] = []
    if order == "spf":
        assert config is not None, "schedule_batches: shortest prefill first needs the model's config"
        batches += pack_spf_batches(trees, sized.tokens, tree_flops(config),
                                    PrefixCache(cache_blocks) if kv_cache != "off" else None)
    else:
        batches += pack_score_batches(trees, sized.tokens, min_batch_flops, flops_of, sized.cap, replay)
    batches += pack_completion_batches([r for _, r in requests if isinstance(r, CompletionRequest)],
                                       max_batch_tokens)
    uses = [batch_hashes(b) for b in batches]
    counts = Counter(h for u in uses for h in u)
    shared = sum(1 for n in counts.values() if n > 1)
    if kv_cache == "off":
        on, reason = False, "off (--kv-cache off): scoring keeps no KV"
    elif kv_cache == "on":
        on, reason = True, f"on (--kv-cache on): every prompt block is kept (LRU); {shared} recur across batches"
    else:
        on = shared > 0
        reason = (f"auto: on, {shared} prefix blocks recur across batches; only those are kept" if on else
                  "auto: off, no prefix block recurs across batches (scoring keeps no KV)")
    pool = min(cache_blocks, len(counts) if kv_cache == "on" else shared) if on else 0
    return BatchSchedule(batches, on, kv_cache == "on", reason, pool, uses)
