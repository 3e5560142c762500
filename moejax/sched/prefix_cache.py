"""Prefix KV cache table: blocks of BLOCK tokens named by a hash chained over the parent block, held in a
fixed number of pool slots with LRU eviction. Host-side only: the KV lives in the device pool (moejax.models.kv_pool);
this table says which hash is in which slot. Deterministic, so `--explain` can replay it without a model."""
from __future__ import annotations

import functools
import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

from moejax.engine import Engine
from moejax.models.kv_pool import BLOCK


class BlockHolder(Protocol):
    """What holds prefix blocks: a PrefixCache, or a frontend's mirror of a replica's (moejax.replicas.frontend)."""
    def readable(self, hashes: Sequence[bytes]) -> int:
        """How many of the leading `hashes` it holds."""
        ...


def cache_blocks(engine: Engine, megabytes: float) -> int:
    """Blocks of BLOCK tokens' KV that `megabytes` of prefix cache hold on `engine`."""
    return int(megabytes * 2**20 // (engine.kv_bytes_per_token() * BLOCK))


def block_hashes(tokens: Sequence[int], limit: int | None = None) -> list[bytes]:
    """Hash of every full block of `tokens` (at most `limit`); block k's hash covers blocks 0..k."""
    hashes = _chain(tuple(tokens))
    return list(hashes if limit is None else hashes[:limit])


@functools.lru_cache(maxsize=1 << 16)
def _chain(tokens: tuple[int, ...]) -> tuple[bytes, ...]:
    # Memoized: the planner and the packer hash the same contexts.
    out, parent = [], b""
    for k in range(len(tokens) // BLOCK):
        chunk = ",".join(map(str, tokens[k * BLOCK:(k + 1) * BLOCK])).encode()
        parent = hashlib.blake2b(parent + b"|" + chunk, digest_size=16).digest()
        out.append(parent)
    return tuple(out)


class PrefixCache:
    def __init__(self, capacity_blocks: int, *, record: bool = False):
        """record: keep the table's lifecycle events (`take_events`) for a frontend that mirrors it
        (moejax.replicas.frontend): ("stored", hash), ("evicted", hash), ("cleared",)."""
        self.capacity = int(capacity_blocks)
        self._events: list[tuple] | None = [] if record else None
        self._slots: OrderedDict[bytes, int] = OrderedDict()  # hash -> pool slot, least recently used first
        self._free = list(range(self.capacity - 1, -1, -1))
        self._fresh: set[int] = set()  # slots written by the batch being planned: never evicted inside it
        self.evictions = 0

    def hashes(self) -> set[bytes]:
        """The blocks it holds (what a frontend's mirror of it should hold)."""
        return set(self._slots)

    def take_events(self) -> list[tuple]:
        """The events since the last call (record=True), oldest first."""
        if self._events is None:
            return []
        out, self._events = self._events, []
        return out

    def clear(self) -> None:
        """Forget every block (their KV is gone: a failed batch took the pool with it)."""
        self._slots.clear()
        self._free = list(range(self.capacity - 1, -1, -1))
        self._fresh.clear()
        self._note("cleared")

    def _note(self, *event: bytes | str) -> None:
        if self._events is not None:
            self._events.append(tuple(event))

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, h: bytes) -> bool:
        return h in self._slots

    def match(self, hashes: Sequence[bytes]) -> list[int]:
        """Slots of the longest run of leading hashes whose KV is in the pool (marked as recently used). Blocks
        the current batch will store are not there yet."""
        found = []
        for h in hashes[: self.readable(hashes)]:
            self._slots.move_to_end(h)
            found.append(self._slots[h])
        return found

    def readable(self, hashes: Sequence[bytes]) -> int:
        """How many leading hashes `match` would find, without marking them used (for planning)."""
        n = 0
        for h in hashes:
            slot = self._slots.get(h)
            if slot is None or slot in self._fresh:
                break
            n += 1
        return n

    def begin_batch(self) -> None:
        self._fresh.clear()

    def allocate(self, h: bytes) -> int | None:
        """A slot for a new block (evicting the least recently used one), or None when every slot is taken by
        the current batch. The slot holds valid KV once the batch that stores it has run."""
        if h in self._slots:
            return None
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((k for k, s in self._slots.items() if s not in self._fresh), None)
            if victim is None:
                return None
            slot = self._slots.pop(victim)
            self.evictions += 1
            self._note("evicted", victim)
        self._slots[h] = slot
        self._note("stored", h)
        self._fresh.add(slot)
        return slot
