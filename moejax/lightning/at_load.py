"""`moejax.load`'s lightning questions (the placement, moejax.placements.lightning, asks them): the KV cache's bytes
per token, and whether the requested batch's KV cache fits the device at all beside a budget's weights."""
from __future__ import annotations

from flax import nnx
from jax.typing import DTypeLike

from moejax.config import ModelConfig
from moejax.models.decoder import MoEModel
from moejax.offload.memory_budget import MemoryBudget, size
from moejax.plan.engine_plan import Workload


def kv_bytes_per_token(cfg: ModelConfig, dtype: DTypeLike) -> int:
    """KV cache bytes of one token over every layer, before the engine exists (MoEModel.kv_bytes_per_token)."""
    return nnx.eval_shape(lambda: MoEModel(cfg, dtype)).kv_bytes_per_token()


def kv_fits_device(cfg: ModelConfig, budget: MemoryBudget, workload: Workload, dtype: DTypeLike) -> str | None:
    """None when the workload's batch (tokens / seq_len rows of seq_len + gen_len tokens) has room for its KV cache
    beside the budget's weights, or no cap is known; else why not."""
    if budget.budget_bytes is None:
        return None
    rows = max(workload.tokens // workload.seq_len, 1)
    need = rows * (workload.seq_len + workload.gen_len) * kv_bytes_per_token(cfg, dtype)
    free = budget.budget_bytes - budget.device_bytes
    if need <= free:
        return None
    return (f"the KV cache of {rows} rows x {workload.seq_len + workload.gen_len} tokens ({size(need)}) does not fit "
            f"the {size(max(free, 0))} the device budget {size(budget.budget_bytes)} leaves after the weights of "
            f"placement {budget.placement}")

