"""How many blocks the continuous-batching KV pool gets: a size given in MiB, else what the device budget leaves
after the weights (less half the memory plan's reserve, for activations), else DEFAULT_MB. Never more than the
run's sequences could hold at once (every prompt and max_tokens: a zeroed pool costs memory and time to make), and
without a given size never less than the longest sequence needs (taken from the reserve), so every request runs."""
from __future__ import annotations

import dataclasses

from moejax.kv_pool import BLOCK
from moejax.offload.memory_plan import RESERVE_FRACTION, device_budget_bytes, size

DEFAULT_MB = 1024.0


@dataclasses.dataclass(frozen=True)
class PoolSize:
    blocks: int
    block_bytes: int
    source: str  # where the size came from

    def describe(self) -> str:
        return (f"KV pool (continuous batching): {self.blocks} blocks of {BLOCK} tokens = "
                f"{size(self.blocks * self.block_bytes)} ({self.source})")


def pool_size(engine, sequences: list[tuple[int, int]], kv_pool_mb: float | None = None) -> PoolSize:
    """sequences: (prompt tokens, max_tokens) of every sequence to generate (each choice counts)."""
    block_bytes = engine.kv_bytes_per_token() * BLOCK
    if kv_pool_mb is not None:
        budget, source = kv_pool_mb * 2**20, f"--kv-pool-mb {kv_pool_mb:g}"
    else:
        plan = engine.memory_plan
        device = plan.budget_bytes if plan is not None and plan.budget_bytes else device_budget_bytes(None)
        if device is None:
            budget, source = DEFAULT_MB * 2**20, f"no device memory cap here: the default {DEFAULT_MB:g} MiB"
        else:
            weights = plan.device_bytes if plan is not None else engine.param_bytes()
            # The memory plan keeps RESERVE_FRACTION of the budget for activations and KV: half of it at least
            # stays for activations.
            budget = max(device * (1 - RESERVE_FRACTION / 2) - weights, 0)
            source = (f"device budget {size(device)} less {size(weights)} of weights and {RESERVE_FRACTION / 2:.0%} "
                      "for activations")
    blocks = int(budget // block_bytes)
    each = [-(-(p + m) // BLOCK) for p, m in sequences]
    if sum(each) < blocks:
        blocks, source = sum(each), source + f"; capped at what these {len(sequences)} sequences can hold at once"
    elif kv_pool_mb is None and each and max(each) > blocks:  # from the reserve: every sequence can run, alone
        blocks, source = max(each), source + "; raised to hold the longest sequence (taken from the reserve)"
    return PoolSize(max(blocks, 1), block_bytes, source)
