"""Prefix-cache table and tree packing: chained block hashes, LRU eviction within a bounded pool, blocks of the
batch being planned are never read or evicted by it, and packed rows compute each shared token once."""
from moejax.sched.packing import HIDDEN, ScoreSeq, pack_row, tree_size
from moejax.sched.prefix_cache import PrefixCache, block_hashes


def test_block_hashes_chain_over_the_parent():
    a = list(range(40))
    b = [99] + a[1:]
    assert len(block_hashes(a)) == 2 and len(block_hashes(a[:15])) == 0
    assert block_hashes(a)[1] != block_hashes(b)[1]  # same second block, different history
    assert block_hashes(a)[:1] == block_hashes(a[:20])
    assert block_hashes(a, limit=1) == block_hashes(a)[:1]


def test_lru_eviction_and_fresh_blocks():
    cache = PrefixCache(2)
    h = block_hashes(list(range(16 * 4)))
    cache.begin_batch()
    s0, s1 = cache.allocate(h[0]), cache.allocate(h[1])
    assert {s0, s1} == {0, 1}
    assert cache.match(h) == []  # being written by this batch: not readable yet
    assert cache.allocate(h[2]) is None  # every slot belongs to this batch: nothing to evict
    cache.begin_batch()
    assert cache.match(h) == [s0, s1]  # h[0] then h[1] become most recently used
    cache.match(h[:1])  # h[0] most recent: h[1] is the LRU victim
    s2 = cache.allocate(h[2])
    assert s2 == s1 and cache.evictions == 1 and h[1] not in cache and h[0] in cache
    assert len(cache) == 2


def test_pack_row_shares_prefixes_and_reuses_cached_blocks():
    prompt = tuple(range(1, 41))
    seqs = [ScoreSeq(prompt + (100 + i,), 41, ("r", i), ((40, 7, ("r", i, 0)),)) for i in range(3)]
    row = pack_row(seqs)
    assert len(row.tokens) == tree_size(seqs) == 40 + 3
    assert row.reads and len(row.targets) == 3 and not row.prior_slots
    cache = PrefixCache(8)
    cache.begin_batch()
    first = pack_row(seqs, cache, want_store=lambda h: True)
    assert len(first.stores) == 2  # the two full blocks of the shared prompt, stored once
    cache.begin_batch()
    second = pack_row(seqs, cache)
    assert len(second.prior_slots) == 2 and len(second.tokens) == 40 + 3 - 32
    assert second.cached == {("r", i): 32 for i in range(3)}
    # a read token inside a cached block is recomputed, and its cached copy is hidden
    short = [ScoreSeq(prompt[:16], 16, "s", ((15, 5, "t"),))]
    cache.begin_batch()
    row = pack_row(short, cache)
    assert len(row.prior_slots) == 1 and row.positions == [15]
    assert row.prior_pre[15] == HIDDEN and HIDDEN not in row.prior_pre[:15] and row.cached == {"s": 15}
