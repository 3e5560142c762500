"""How many blocks the continuous-batching KV pool gets: a size given in MiB, else what the device budget leaves
after the weights (less a reserve for activations), else DEFAULT_MB; never more than the run's sequences could
hold at once (every prompt and max_tokens), since a zeroed pool costs memory and time to make."""
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
            budget = max(device * (1 - RESERVE_FRACTION) - weights, 0)
            source = (f"device budget {size(device)} less {RESERVE_FRACTION:.0%} reserve and {size(weights)} of "
                      "weights")
    blocks = int(budget // block_bytes)
    need = sum(-(-(p + m) // BLOCK) for p, m in sequences)
    if need < blocks:
        blocks, source = need, source + f"; capped at what these {len(sequences)} sequences can hold at once"
    return PoolSize(max(blocks, 1), block_bytes, source)
