"""Bookkeeping of the device-side expert cache: which (layer, expert) key sits in which of `num_slots` slots,
which slot a miss is copied into, which key is evicted. No arrays here; the executor moves the weights.

Time is one logical clock, ticked once per `request`/`prefetch` call; all keys of a call share that time and,
inside the call, earlier keys count as older. Every requested key is one use; prefetching is not a use.
Free slots are filled lowest index first; a key that replaces an evicted one takes its slot.

Eviction policies (the victim is the resident key ranked lowest; ties always fall back to LRU):
- "lru": least recently used. A prefetched key's recency is its prefetch time, so it is not the next victim.
- "lfu": fewest requests since the cache was created (counts survive eviction).
- "priority": fMoE §4.5 "Expert eviction priority" (PRI_evict = 1 / (p * freq), highest evicted; the
  product form below avoids dividing by p = 0): the victim has the lowest (count + 1) * p, where count is the
  LFU request count (+1 so a never-requested key still has a frequency) and p the score from
  `set_scores`/`prefetch` (0.0 until scored).

Protection: a request never evicts one of its own keys. A prefetch never evicts a key named in the same
call, nor a key an earlier prefetch loaded that no request has used yet (use count 0 since it was loaded):
one prediction does not displace another that has not paid off. When no victim is allowed the rest of the
prefetch list is dropped.
"""
from __future__ import annotations

import heapq
import operator
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

POLICIES = ("lru", "lfu", "priority")
Key = tuple[int, int]  # (layer, expert)


def _key(key: Sequence[int]) -> Key:
    layer, expert = key
    return int(layer), int(expert)


def _distinct(keys: Iterable[Sequence[int]]) -> list[Key]:
    return list(dict.fromkeys(_key(k) for k in keys))


class ExpertCache:
    def __init__(self, num_slots: int, policy: str = "lru"):
        try:
            slots = operator.index(num_slots)  # ints, numpy ints; not floats
        except TypeError:
            slots = 0
        if isinstance(num_slots, bool) or slots < 1:
            raise ValueError(f"num_slots must be an int >= 1, got {num_slots!r}")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.num_slots = slots
        self.policy = policy
        self._slot_of: dict[Key, int] = {}
        self._free = list(range(slots))  # a heap: lowest free slot first
        self._clock = 0
        self._recency: dict[Key, tuple[int, int]] = {}  # (clock, position in its call)
        self._uses: dict[Key, int] = {}  # requests since creation, kept after eviction
        self._scores: dict[Key, float] = {}
        self._unused_prefetch: set[Key] = set()  # loaded by prefetch, not requested since
        self._stats = dict.fromkeys(("hits", "misses", "prefetch_loads", "prefetch_used", "evictions"), 0)

    def slot(self, key: Sequence[int]) -> int | None:
        return self._slot_of.get(_key(key))

    def __contains__(self, key: Sequence[int]) -> bool:
        return self.slot(key) is not None

    def __len__(self) -> int:
        return len(self._slot_of)

    def resident(self) -> dict[Key, int]:
        return dict(self._slot_of)

    def set_scores(self, scores: Mapping[Sequence[int], float]) -> None:
        for key, p in scores.items():
            self._scores[_key(key)] = float(p)

    def stats(self) -> dict:
        return dict(self._stats)

    def reset_stats(self) -> None:
        """Counters from now on (the keys, slots and use counts stay)."""
        self._stats = dict.fromkeys(self._stats, 0)

    def request(self, keys: Iterable[Sequence[int]]) -> tuple[list[tuple[Key, int]], list[tuple[Key, int]], list[Key]]:
        keys = _distinct(keys)
        if len(keys) > self.num_slots:
            raise ValueError(f"request needs {len(keys)} distinct experts but the cache has only "
                             f"{self.num_slots} slots")
        self._clock += 1
        for i, key in enumerate(keys):
            self._recency[key] = (self._clock, i)
            self._uses[key] = self._uses.get(key, 0) + 1
        hits: list[tuple[Key, int]] = []
        loads: list[tuple[Key, int]] = []
        evicted: list[Key] = []
        protected = set(keys)
        for key in keys:
            if key in self._slot_of:
                hits.append((key, self._slot_of[key]))
                if key in self._unused_prefetch:
                    self._unused_prefetch.discard(key)
                    self._stats["prefetch_used"] += 1
                continue
            # Fewer distinct keys than slots guarantees a victim outside `protected` when no slot is free.
            slot = self._place(key, protected, evicted)
            assert slot is not None
            loads.append((key, slot))
        self._stats["hits"] += len(hits)
        self._stats["misses"] += len(loads)
        return hits, loads, evicted

    def prefetch(self, keys: Iterable[Sequence[int]], scores: Mapping[Sequence[int], float] | None = None
                 ) -> tuple[list[tuple[Key, int]], list[Key]]:
        if scores:
            self.set_scores(scores)
        keys = _distinct(keys)
        self._clock += 1
        protected = set(keys) | self._unused_prefetch
        loads: list[tuple[Key, int]] = []
        evicted: list[Key] = []
        for i, key in enumerate(keys):
            if key in self._slot_of:
                continue
            slot = self._place(key, protected, evicted)
            if slot is None:
                break
            self._recency[key] = (self._clock, i)
            self._unused_prefetch.add(key)
            loads.append((key, slot))
        self._stats["prefetch_loads"] += len(loads)
        return loads, evicted

    def _place(self, key: Key, protected: set[Key], evicted: list[Key]) -> int | None:
        """Give `key` the lowest free slot, else the slot of the lowest-ranked unprotected key (None: none)."""
        if self._free:
            slot = heapq.heappop(self._free)
        else:
            candidates = [k for k in self._slot_of if k not in protected]
            if not candidates:
                return None
            victim = min(candidates, key=self._rank)
            slot = self._slot_of.pop(victim)
            self._unused_prefetch.discard(victim)
            evicted.append(victim)
            self._stats["evictions"] += 1
        self._slot_of[key] = slot
        return slot

    def _rank(self, key: Key) -> tuple:
        recency = self._recency.get(key, (0, 0))
        if self.policy == "lfu":
            return self._uses.get(key, 0), recency
        if self.policy == "priority":
            return (self._uses.get(key, 0) + 1) * self._scores.get(key, 0.0), recency
        return (recency,)


def prefetch_priority(p: np.ndarray, layer_position: int, now_position: int) -> np.ndarray:
    """fMoE §4.5: p / (l - l_now), positions counted in MoE layers (l > l_now; the layer itself counts as 1)."""
    return np.asarray(p, np.float64) / max(layer_position - now_position, 1)
