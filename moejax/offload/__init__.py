"""Expert offloading on one device: routed expert weights in host memory, streamed or cached on the device.

host_store (pinned host arrays) -> streamed / cached (layer runtimes) run by layered (the steps, layer by layer);
expert_cache (slot bookkeeping, eviction), predict (expert predictors), memory_budget (what every budget shares;
each placement's rules are moejax.placements'), saturation (Θ for streamed prefill), setup (the predictor at load),
stats (Engine.stats())."""
from moejax.offload.expert_cache import POLICIES, ExpertCache
from moejax.offload.host_store import HOST_LIMIT_ENV, HostStore, is_routed_expert, pinned_host_limit_bytes
from moejax.offload.memory_budget import MemoryBudget, MemoryBudgetError

__all__ = ["HOST_LIMIT_ENV", "POLICIES", "ExpertCache", "HostStore", "MemoryBudget", "MemoryBudgetError",
           "is_routed_expert", "pinned_host_limit_bytes"]
