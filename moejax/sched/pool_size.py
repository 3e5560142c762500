"""How many blocks the continuous-batching KV pool gets: a size given in MiB, else what the device budget leaves
after the weights (less half the memory budget's reserve, for activations), else DEFAULT_MB. Never more than the
run's sequences could hold at once (every prompt and max_tokens: a zeroed pool costs memory and time to make, and
blocks past that are never used), and without a given size never less than the longest sequence needs (taken from
the reserve), so every request runs. A given size the device cannot hold beside the weights is refused (PoolTooLarge)
before anything is allocated. Requests with max_tokens 0 generate nothing and take no blocks (their prompt's
log-probabilities come from a scoring pass)."""
from __future__ import annotations

import dataclasses

from moejax.engine import Engine
from moejax.models.kv_pool import BLOCK
from moejax.offload.memory_budget import RESERVE_FRACTION, MemoryBudget, device_budget_bytes, size

DEFAULT_MB = 1024.0


class PoolTooLarge(ValueError):
    """A KV pool size given in MiB that the device cannot hold beside the weights."""


@dataclasses.dataclass(frozen=True)
class PoolSize:
    blocks: int
    block_bytes: int
    source: str  # where the size came from

    def describe(self) -> str:
        return (f"KV pool (continuous batching): {self.blocks} blocks of {BLOCK} tokens = "
                f"{size(self.blocks * self.block_bytes)} ({self.source})")


def pool_size(engine: Engine, sequences: list[tuple[int, int]], kv_pool_mb: float | None = None) -> PoolSize:
    """sequences: (prompt tokens, max_tokens) of every sequence to generate (each choice counts; max_tokens >= 1)."""
    block_bytes = engine.kv_bytes_per_token() * BLOCK
    budget: MemoryBudget | float | None  # the memory budget, then the pool's bytes (below)
    budget = engine.memory_budget
    device = budget.budget_bytes if budget is not None and budget.budget_bytes else device_budget_bytes(None)
    weights = budget.device_bytes if budget is not None else engine.param_bytes()
    each = [-(-(p + m) // BLOCK) for p, m in sequences]
    elsewhere = engine.placement.decode_pool_room(engine.config)
    if elsewhere is not None:  # the pool is not (all) in device memory: lightning's host KV cache
        limit, where = elsewhere
        budget, source = (kv_pool_mb * 2**20, f"--kv-pool-mb {kv_pool_mb:g}") if kv_pool_mb is not None else \
            (limit, where)
        if kv_pool_mb is not None and min(budget, sum(each) * block_bytes) > limit:
            raise PoolTooLarge(f"--kv-pool-mb {kv_pool_mb:g}: more than the {size(limit)} ({where}) this placement's "
                               "KV pool may take; give at most that")
    elif kv_pool_mb is not None:
        budget, source = kv_pool_mb * 2**20, f"--kv-pool-mb {kv_pool_mb:g}"
        room = None if device is None else max(device - weights, 0)
        # what is allocated: the given size, capped at the run's use (below)
        if device is not None and room is not None and min(budget, sum(each) * block_bytes) > room:
            raise PoolTooLarge(
                f"--kv-pool-mb {kv_pool_mb:g}: the device budget {size(device)} less {size(weights)} of weights "
                f"leaves {size(room)} ({room / 2**20:.1f} MiB), too little for this pool; give at most that")
    elif device is None:
        budget, source = DEFAULT_MB * 2**20, f"no device memory cap here: the default {DEFAULT_MB:g} MiB"
    else:
        # The memory budget keeps RESERVE_FRACTION of the budget for activations and KV: half of it at least
        # stays for activations.
        budget = max(device * (1 - RESERVE_FRACTION / 2) - weights, 0)
        source = (f"device budget {size(device)} less {size(weights)} of weights and {RESERVE_FRACTION / 2:.0%} "
                  "for activations")
    blocks = int(budget // block_bytes)
    if not sequences:
        return PoolSize(1, block_bytes, source + "; no request generates tokens (max_tokens 0 only): the "
                                                 "smallest pool")
    if sum(each) < blocks:
        source += (f" = {blocks} blocks; capped at the {sum(each)} these {len(sequences)} sequences can hold at once "
                   "(more would never be used)")
        blocks = sum(each)
    elif kv_pool_mb is None and max(each) > blocks:  # from the reserve: every sequence can run, alone
        blocks, source = max(each), source + "; raised to hold the longest sequence (taken from the reserve)"
    elif max(each) > blocks:  # a given size is kept: the sequences that cannot fit are refused, each on its own
        source += (f"; {sum(e > blocks for e in each)} of {len(each)} sequences need more (up to {max(each)} "
                   f"blocks = {max(each) * block_bytes / 2**20:.2f} MiB) and are refused")
    return PoolSize(max(blocks, 1), block_bytes, source)
