"""The policy the lightning placement runs, (N, μ, A_g, F_g, r_w, r_c) of MoE-Lightning §4.2: each field from the
options, the ones not given from the HRM policy search (moejax.plan.lightning.search_policy) for the workload, and
the checks that say what moejax cannot run and what does not fit."""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

from moejax.config import ModelConfig
from moejax.offload.memory_budget import MemoryBudgetError, size
from moejax.plan.hardware import Profile
from moejax.plan.lightning import CPU_USABLE, LightningPolicy, search_policy

FIELDS = ("decode_batch", "micro_batch", "attention_on", "ffn_on", "resident_share", "kv_device_share")


@dataclasses.dataclass(frozen=True)
class LightningPlan:
    N: int  # rows decoded together (the scheduler's decode batch)
    mu: int  # rows per micro-batch
    A_g: int  # attention on the device (1) or the host (0)
    F_g: int  # the MoE FFN on the device (1) or on the host over the experts in host memory (0)
    r_w: float  # share of each layer's experts resident on the device
    r_c: float  # share of the KV cache on the device: the first round(r_c L) layers'; under A_g = 1 the others' is
    # swapped in for attention on the device (FlexGen's S4)
    source: str  # which fields came from the options and which from the search
    searched: LightningPolicy | None = None  # the search's policy, with its predicted per-layer times

    @property
    def micro_batches(self) -> int:
        return -(-self.N // self.mu)

    def device_kv_layers(self, layers: int) -> int:
        return int(round(self.r_c * layers))

    def swaps_kv(self, layers: int) -> bool:
        """Attention on the device over layers whose KV is on the host: each swapped in per pass."""
        return bool(self.A_g) and self.device_kv_layers(layers) < layers

    def swapped_kv_layers(self, layers: int) -> int:
        """Layers of host KV on the device at once while swapping: the one attending and the next on its way."""
        return min(2, layers - self.device_kv_layers(layers)) if self.swaps_kv(layers) else 0

    def describe(self) -> str:
        where = "device" if self.A_g else "host"
        ffn = "device" if self.F_g else "host"
        return (f"N={self.N} mu={self.mu} ({self.micro_batches} micro-batches) A_g={self.A_g} (attention on the "
                f"{where}) F_g={self.F_g} (FFN on the {ffn}) r_w={self.r_w:.2f} r_c={self.r_c:.2f}; {self.source}")


def host_memory_bytes(host_memory_gb: float | None = None) -> int:
    """The host memory the KV cache and the paged experts may use: as given, else this machine's physical memory."""
    if host_memory_gb is not None:
        return int(host_memory_gb * 2**30)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def resolve_plan(cfg: ModelConfig, given: dict[str, object], *, prompt_len: int, gen_len: int,
                 profile: Callable[[], Profile]) -> LightningPlan:
    """given: the options by FIELDS name (None: not given). Fields not given come from the policy search for
    `prompt_len` and `gen_len` on `profile()`, except ffn_on, which is the device's unless the search runs for
    another field; MemoryBudgetError for what cannot run."""
    if all(given.get(f) is not None for f in FIELDS if f != "ffn_on"):  # no search for ffn_on alone
        given = {**given, "ffn_on": given.get("ffn_on") or "device"}
    missing = [f for f in FIELDS if given.get(f) is None]
    searched = None
    if missing:
        try:
            searched = search_policy(cfg, profile(), prompt_len=prompt_len, gen_len=max(gen_len, 2))
        except ValueError as e:
            raise MemoryBudgetError(f"placement 'lightning': {', '.join(missing)} not given and the policy search "
                                    f"cannot give them: {e}") from None
        searched = _runnable(searched)
    found = {} if searched is None else dict(decode_batch=searched.N, micro_batch=searched.mu,
                                             attention_on="device" if searched.A_g else "host",
                                             ffn_on="device" if searched.F_g else "host",
                                             resident_share=searched.r_w, kv_device_share=searched.r_c)
    value = {f: given[f] if given.get(f) is not None else found[f] for f in FIELDS}
    N, mu = int(value["decode_batch"]), int(value["micro_batch"])  # type: ignore[call-overload]
    A_g, F_g = int(value["attention_on"] == "device"), int(value["ffn_on"] == "device")
    r_w, r_c = float(value["resident_share"]), float(value["kv_device_share"])  # type: ignore[arg-type]
    if mu > N:
        raise MemoryBudgetError(f"placement 'lightning': micro_batch {mu} exceeds decode_batch {N}")
    source = ("every field from the options" if not missing else
              f"{', '.join(missing)} from the policy search (prompt {prompt_len}, gen {gen_len}, "
              f"{searched.hardware if searched else '?'})")
    return LightningPlan(N, mu, A_g, F_g, r_w, r_c, source, searched)


def _runnable(policy: LightningPolicy) -> LightningPolicy:
    """The search's best policy that moejax runs (its `executable`); the best overall when it runs."""
    for p in (policy, *policy.alternatives):
        if p.executable:
            return p
    raise MemoryBudgetError(f"placement 'lightning': no policy the search found runs here: {policy.note}")


def check_kv_fits(plan: LightningPlan, kv_bytes_per_token: int, layers: int, tokens_per_row: int, *,
                  host_bytes: int, device_free: int | None, where: str) -> str:
    """The KV of N rows of tokens_per_row tokens against the host's usable memory (its 1 - r_c share) and the
    device's free bytes (its r_c share, and under A_g = 1 two layers' swapped in: the one attending and the next)
    -> a line saying so; MemoryBudgetError naming the limit when it does not fit."""
    total = plan.N * tokens_per_row * kv_bytes_per_token
    swapped = plan.swapped_kv_layers(layers)
    on_host = total * (layers - plan.device_kv_layers(layers)) / layers
    on_device = total * (plan.device_kv_layers(layers) + swapped) / layers
    host_limit = CPU_USABLE * host_bytes
    if on_host > host_limit:
        raise MemoryBudgetError(
            f"{where}: the KV cache of {plan.N} rows x {tokens_per_row} tokens needs {size(on_host)} of host memory, "
            f"over the limit of {size(host_limit)} ({CPU_USABLE:.0%} of {size(host_bytes)} host memory; "
            "host_memory_gb sets it); give a smaller decode_batch or shorter sequences")
    if device_free is not None and on_device > device_free:
        raise MemoryBudgetError(
            f"{where}: the device's share of the KV cache (r_c = {plan.r_c:.2f}: {plan.device_kv_layers(layers)} of "
            f"{layers} layers, {swapped} swapped in) needs {size(on_device)}, over the {size(device_free)} the "
            "device budget leaves after the weights; give a smaller kv_device_share or decode_batch")
    return (f"KV cache for {plan.N} rows x {tokens_per_row} tokens: {size(on_host)} on the host (limit "
            f"{size(host_limit)}), {size(on_device)} on the device")
