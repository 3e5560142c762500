"""Device memory of a benchmark run: the peak XLA reports, beside what moejax's memory budget expects the run to hold.

XLA's allocator counts `peak_bytes_in_use` per device from the process's start and has no reset, so a row's reading
is the peak of every row up to it: a row whose reading is above the one before raised it, and that reading is its own.
CPU backends give no memory stats (`memory_stats()` is None): the reading is null there and says why.

The estimate is the one the batch runner sizes scoring batches by (moejax.sched.batch_size): the weights the memory
budget places on the device, the prefix KV cache's pool, and activations of one full scoring batch at
activation_bytes_per_token (counted generously: XLA may keep a layer's intermediates alive together)."""
from __future__ import annotations

from typing import Any

import jax

from moejax.engine import Engine
from moejax.kernels.attention.blocked import BLOCK as QUERY_BLOCK
from moejax.models.kv_pool import BLOCK
from moejax.sched.batch_size import activation_bytes_per_token


def peak() -> dict[str, Any]:
    """The devices' peak bytes in use so far (the largest of the local devices'), or null with the reason."""
    stats = [d.memory_stats() for d in jax.local_devices()]
    if not all(s and "peak_bytes_in_use" in s for s in stats):
        platform = jax.local_devices()[0].platform
        return dict(peak_bytes_in_use=None, bytes_in_use=None, bytes_limit=None,
                    source=f"none: the {platform} backend gives no peak_bytes_in_use (memory_stats() "
                           f"{'is None' if not any(stats) else 'lacks it'})")
    return dict(peak_bytes_in_use=max(int(s["peak_bytes_in_use"]) for s in stats),
                bytes_in_use=max(int(s.get("bytes_in_use", 0)) for s in stats),
                bytes_limit=max(int(s.get("bytes_limit", 0)) for s in stats) or None,
                source=f"XLA memory_stats() of {len(stats)} device(s), the largest; the peak since the process started")


def estimate(engine: Engine, *, pool_blocks: int, batch_tokens: int, longest: int) -> dict[str, Any]:
    """What the run is expected to hold on a device: the budget's weights, a prefix pool of `pool_blocks` blocks and
    the activations of a scoring batch of `batch_tokens` tokens whose longest sequence is `longest` tokens."""
    budget = engine.memory_budget
    keys = longest + 2 * QUERY_BLOCK  # a query block reads its tree's keys, its window rounded to whole blocks
    per_token = activation_bytes_per_token(engine.config, engine.dtype.itemsize, keys)
    pool = pool_blocks * BLOCK * engine.kv_bytes_per_token()
    weights = budget.device_bytes
    return dict(weights_bytes=weights, prefix_pool_bytes=pool, activation_bytes=per_token * batch_tokens,
                activation_bytes_per_token=per_token, batch_tokens=batch_tokens, keys_per_query=keys,
                total_bytes=weights + pool + per_token * batch_tokens, budget_bytes=budget.budget_bytes,
                placement=budget.placement,
                counted="memory budget's device weights + prefix pool blocks x 16 x KV bytes per token + "
                        "activation_bytes_per_token x the scoring batch's token budget (moejax.sched.batch_size)")
