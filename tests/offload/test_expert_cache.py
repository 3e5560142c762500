"""The expert cache's bookkeeping: hand-checked eviction traces per policy, prefetch protection, errors,
stats, and invariants over a long random trace."""
import random

import pytest

from moejax.offload.expert_cache import POLICIES, ExpertCache

A, B, C, D, E = (0, 1), (0, 2), (0, 3), (0, 4), (1, 0)


def run(cache, *requests):
    """Request each key list in turn; return the evicted lists, one per request."""
    return [cache.request(keys)[2] for keys in requests]


# ---- eviction traces, one per policy ----

@pytest.mark.parametrize("policy", POLICIES)
def test_ties_fall_back_to_lru(policy):
    cache = ExpertCache(3, policy)
    # A, B, C fill slots 0, 1, 2; A is used again at t4; D needs a slot at t5.
    # lru: recencies A=4, B=2, C=3 -> B.  lfu: counts A=2, B=1, C=1, B older than C -> B.
    # priority: nothing scored, every (count + 1) * 0.0 is 0 -> LRU -> B.
    assert run(cache, [A], [B], [C], [A], [D]) == [[], [], [], [], [B]]
    assert cache.resident() == {A: 0, D: 1, C: 2}  # D took B's slot


def test_lru_evicts_least_recently_used():
    cache = ExpertCache(3, "lru")
    # t1 A->0, t2 A hit, t3 B->1, t4 C->2; t5 D: recencies A=2, B=3, C=4 -> A; t6 B hit.
    assert run(cache, [A], [A], [B], [C], [D], [B]) == [[], [], [], [], [A], []]
    assert cache.resident() == {D: 0, B: 1, C: 2}


def test_lfu_evicts_least_frequently_used_and_keeps_counts_after_eviction():
    cache = ExpertCache(3, "lfu")
    # Same trace as LRU: t5 D: counts A=2, B=1, C=1, B older -> B (D->1).
    # t6 B misses: counts A=2, C=1, D=1, C older -> C (B->2).
    assert run(cache, [A], [A], [B], [C], [D], [B]) == [[], [], [], [], [B], [C]]
    assert cache.resident() == {A: 0, D: 1, B: 2}
    # t7 E: counts A=2, D=1, B=2 (its t3 use survived its eviction) -> D.
    assert run(cache, [E]) == [[D]]


def test_lfu_counts_a_hit_as_one_use():
    c = ExpertCache(2, "lfu")
    Y, X, Z, W = (0, 1), (0, 2), (0, 3), (0, 4)
    c.request([Y])  # Y: 1 use (a miss)
    c.request([Y])  # Y: 2 uses (a hit counts once)
    c.request([X])  # X: 1
    assert c.request([Z])[2] == [X]  # X 1 < Y 2
    assert c.request([X])[2] == [Z]  # Z 1 < Y 2; X now 2 uses, more recent than Y
    assert c.request([W])[2] == [Y]  # X and Y both 2: the older, Y, goes (were hits counted twice, X would)


def test_duplicates_collapse_into_one_use():
    cache = ExpertCache(2, "lfu")
    hits, loads, evicted = cache.request([A, A, B, A])
    assert (hits, loads, evicted) == ([], [(A, 0), (B, 1)], [])
    assert cache.stats()["misses"] == 2
    cache.request([B])
    # counts A=1 (not 3), B=2 -> C evicts A.
    assert run(cache, [C]) == [[A]]


def test_priority_evicts_lowest_frequency_times_probability():
    cache = ExpertCache(2, "priority")
    cache.set_scores({A: 0.3, B: 0.5})
    # t5 C: A = (3 + 1) * 0.3 = 1.2, B = (1 + 1) * 0.5 = 1.0 -> B, though LRU and probability alone say A.
    assert run(cache, [A], [A], [A], [B], [C]) == [[], [], [], [], [B]]
    cache.set_scores({A: 0.1})  # only A changes; C keeps 0.0
    # t6 B: A = 4 * 0.1 = 0.4, C = 2 * 0.0 = 0 -> C.
    assert run(cache, [B]) == [[C]]
    # t7 D: A = 0.4, B = (2 + 1) * 0.5 = 1.5 -> A.
    assert run(cache, [D]) == [[A]]


def test_priority_frequency_is_count_plus_one():
    cache = ExpertCache(2, "priority")
    cache.prefetch([A], scores={A: 0.9})  # never requested: (0 + 1) * 0.9 = 0.9, not 0
    cache.set_scores({B: 0.4})
    cache.request([B])  # (1 + 1) * 0.4 = 0.8
    assert run(cache, [C]) == [[B]]


# ---- prefetch ----

def test_prefetch_takes_only_what_fits_and_never_evicts_its_own_keys():
    cache = ExpertCache(2)
    assert cache.prefetch([A, B, C, D]) == ([(A, 0), (B, 1)], [])
    assert cache.resident() == {A: 0, B: 1}


def test_prefetch_never_evicts_a_key_of_the_same_call_even_if_already_resident():
    cache = ExpertCache(2, "lru")
    cache.request([A])
    cache.request([B])
    # A is the LRU key, but it is named in this call (skipped as resident), so C replaces B.
    assert cache.prefetch([C, A]) == ([(C, 1)], [B])


def test_prefetch_never_evicts_an_unused_prefetch():
    cache = ExpertCache(2, "lru")
    cache.prefetch([A])  # A->0, not used yet
    cache.request([B])  # B->1
    assert cache.prefetch([C]) == ([(C, 1)], [B])  # A is protected although older than B
    assert cache.prefetch([D]) == ([], [])  # A and C both unused prefetches: nothing to evict, no error
    cache.request([A])  # A used: no longer protected
    assert cache.prefetch([D]) == ([(D, 0)], [A])  # C still unused
    # A request may evict an unused prefetch.
    assert cache.request([E, D])[2] == [C]


def test_prefetch_is_not_a_use_but_sets_recency_of_what_it_loads():
    cache = ExpertCache(3, "lru")
    cache.request([A])  # t1
    cache.request([B])  # t2
    assert cache.prefetch([A, C]) == ([(C, 2)], [])  # t3: A skipped, its recency stays 1
    # t4 D: recencies A=1, B=2, C=3 (prefetch time) -> A.
    assert run(cache, [D]) == [[A]]
    cache = ExpertCache(2, "lfu")
    cache.request([A])
    cache.request([B])
    cache.prefetch([A])  # skipped, A's count stays 1
    assert run(cache, [B], [C]) == [[], [A]]


def test_prefetch_scores_merge_into_set_scores():
    cache = ExpertCache(2, "priority")
    cache.set_scores({A: 0.1, B: 0.9})
    cache.request([A])
    cache.request([B])
    cache.prefetch([], scores={A: 0.8})  # B keeps 0.9
    # C: A = 2 * 0.8 = 1.6, B = 2 * 0.9 = 1.8 -> A.
    assert run(cache, [C]) == [[A]]


# ---- errors ----

def test_request_larger_than_the_cache_names_both_numbers():
    cache = ExpertCache(2)
    cache.request([A])
    with pytest.raises(ValueError, match=r"3 distinct experts .* only 2 slots"):
        cache.request([A, B, C, C])
    assert cache.resident() == {A: 0} and cache.stats()["hits"] == 0  # untouched


@pytest.mark.parametrize("num_slots", [0, -1, 2.0, True])
def test_bad_num_slots(num_slots):
    with pytest.raises(ValueError, match=rf"num_slots must be an int >= 1, got {num_slots!r}"):
        ExpertCache(num_slots)


def test_bad_policy_names_the_allowed_ones():
    with pytest.raises(ValueError, match=r"one of \('lru', 'lfu', 'priority'\), got 'fifo'"):
        ExpertCache(2, "fifo")


# ---- stats ----

def test_stats_against_a_hand_checked_trace():
    cache = ExpertCache(2, "lru")
    assert cache.prefetch([A, B]) == ([(A, 0), (B, 1)], [])  # 2 prefetch loads
    assert cache.request([A, C]) == ([(A, 0)], [(C, 1)], [B])  # A hit (prefetch used), C miss evicts B
    assert cache.request([A]) == ([(A, 0)], [], [])  # hit; A's prefetch already counted
    assert cache.prefetch([B]) == ([(B, 1)], [C])  # recencies A=3, C=2 -> C
    assert cache.request([B, C]) == ([(B, 1)], [(C, 0)], [A])  # B hit (prefetch used), C miss evicts A
    assert cache.stats() == {"hits": 3, "misses": 2, "prefetch_loads": 3, "prefetch_used": 2, "evictions": 3}
    assert len(cache) == 2 and B in cache and A not in cache and cache.slot(C) == 0 and cache.slot(A) is None


def test_a_prefetch_evicted_unused_is_not_counted_when_a_request_loads_it_again():
    cache = ExpertCache(1, "lru")
    cache.prefetch([A])  # A->0
    assert cache.request([B])[2] == [A]  # A evicted before any use
    cache.request([A])  # miss: loaded by the request, not by a prefetch
    cache.request([A])  # hit, but not a prefetch paying off
    assert cache.stats() == {"hits": 1, "misses": 2, "prefetch_loads": 1, "prefetch_used": 0, "evictions": 2}


def test_numpy_style_slot_counts_are_accepted():
    class Index:  # what numpy integers look like to operator.index
        def __index__(self):
            return 3
    assert ExpertCache(Index()).num_slots == 3


# ---- random trace ----

@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("num_slots", [1, 3, 8])
def test_random_trace_keeps_invariants(policy, num_slots):
    rng = random.Random(1234 + num_slots)
    universe = [(layer, expert) for layer in range(4) for expert in range(6)]
    cache = ExpertCache(num_slots, policy)
    distinct_requested = evicted_total = prefetch_loads = 0
    for _ in range(2000):
        before = cache.resident()
        if rng.random() < 0.7:
            keys = rng.choices(universe, k=rng.randint(1, num_slots + 2))
            if len(set(keys)) > num_slots:
                with pytest.raises(ValueError):
                    cache.request(keys)
                continue
            hits, loads, evicted = cache.request(keys)
            distinct_requested += len(set(keys))
            assert len(hits) + len(loads) == len(set(keys)) and {k for k, _ in hits + loads} == set(keys)
            assert all(cache.slot(k) == s for k, s in hits + loads)
            assert {k for k, _ in hits} == set(keys) & set(before)
            assert not set(evicted) & set(keys)
        else:
            keys = rng.sample(universe, rng.randint(0, num_slots + 2))
            scores = {k: rng.random() for k in rng.sample(universe, 3)} if rng.random() < 0.5 else None
            loads, evicted = cache.prefetch(keys, scores)
            prefetch_loads += len(loads)
            assert all(cache.slot(k) == s and k not in before for k, s in loads)
            assert not set(evicted) & set(keys)
        evicted_total += len(evicted)
        assert all(k in before and k not in cache for k in evicted)
        if evicted:
            assert len(cache) == num_slots  # free slots are used before anything is evicted
        resident = cache.resident()
        assert len(cache) == len(resident) <= num_slots
        assert len(set(resident.values())) == len(resident)
        assert all(0 <= s < num_slots for s in resident.values())
        stats = cache.stats()
        assert stats["hits"] + stats["misses"] == distinct_requested
        assert stats["evictions"] == evicted_total and stats["prefetch_loads"] == prefetch_loads
        assert stats["prefetch_used"] <= stats["prefetch_loads"]
