"""`moejax.load`'s lightning decisions: the memory budget of placement 'lightning' (its policy resolved from the
options and the search, the KV cache of its batch checked against host and device memory), and placement 'auto''s
question whether the requested batch's KV cache fits the device at all (if not, the policy search decides)."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from moejax.config import ModelConfig
from moejax.lightning.policy import FIELDS, check_kv_fits, host_memory_bytes, resolve_plan
from moejax.models.decoder import MoEModel
from moejax.offload.memory_budget import MemoryBudget, MemoryBudgetError, size
from moejax.offload.settings import PlacementSettings
from moejax.offload.setup import budget_for
from moejax.plan.engine_plan import Workload
from moejax.plan.hardware import Profile


def kv_bytes_per_token(cfg: ModelConfig, dtype: DTypeLike) -> int:
    """KV cache bytes of one token over every layer, before the engine exists (MoEModel.kv_bytes_per_token)."""
    return nnx.eval_shape(lambda: MoEModel(cfg, dtype)).kv_bytes_per_token()


def lightning_budget(cfg: ModelConfig, shapes: dict, settings: PlacementSettings, workload: Workload,
                     dtype: DTypeLike, profile: Callable[[], Profile]) -> tuple[MemoryBudget, str]:
    """-> (the budget of placement 'lightning', a line on its KV cache); ValueError naming what does not fit."""
    host_bytes = host_memory_bytes(settings.host_memory_gb)

    def here() -> Profile:  # the search sizes the KV as the check below does: this dtype, this host's memory
        found = profile()
        return dataclasses.replace(found, dtype_bytes=jnp.dtype(dtype).itemsize,
                                   host=dataclasses.replace(found.host, memory_bytes=float(host_bytes)))
    try:
        plan = resolve_plan(cfg, {f: getattr(settings, f) for f in FIELDS}, prompt_len=workload.seq_len,
                            gen_len=workload.gen_len, profile=here)
        budget = budget_for(cfg, shapes, dataclasses.replace(settings, placement="lightning"), lightning=plan)
        free = None if budget.budget_bytes is None else budget.budget_bytes - budget.reserve_bytes - budget.device_bytes
        text = check_kv_fits(plan, kv_bytes_per_token(cfg, dtype), cfg.num_layers, workload.seq_len + workload.gen_len,
                             host_bytes=host_bytes, device_free=free,
                             where="placement 'lightning'")
    except MemoryBudgetError as e:
        raise ValueError(f"moejax.load: {e}") from None
    return budget, f"placement lightning: {plan.describe()}; {text}"


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

