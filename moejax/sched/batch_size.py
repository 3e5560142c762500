"""How many tokens one scoring batch holds. `--max-batch-tokens`, when given, wins. Otherwise, on a GPU: enough to
keep the device busy, bounded by the memory the memory budget leaves; elsewhere (CPUs) DEFAULT_TOKENS, as before.

The GPU's size is the FLOPs floor of the engine's placement, in tokens: an offloading engine's Θ (profiled, or Eq. 1
on the hardware profile), else Θ by Eq. 1 on the profile (moejax.plan.theta), the batch whose compute covers copying a
layer's experts from the host (resident experts=async_ep too: its own Θ, of the all-gather, is a floor the batches
are filled to, not the size). A resident engine copies nothing, but a batch that could hide that copy is one that
fills the device: on the first H200 run (2026-11-26) resident prefill of the qwen3-30b-a3b 4-layer slice ran at 0.79
of its 131K-token rate with 16K tokens per call and at 0.97 with 65K (0.95 Θ as profiled there).

The memory bound: what the memory budget leaves (its budget less the weights it places and the prefix KV cache's pool),
divided by activation_bytes_per_token, per device that holds a share of the rows. Rows stay as long as before
(trees of at most DEFAULT_TOKENS): a larger batch has more rows, so its attention costs what it did, and its jit
unrolls as many query blocks."""
from __future__ import annotations

import dataclasses

import jax

from moejax.config import ModelConfig
from moejax.engine import Engine
from moejax.kernels.attention.blocked import BLOCK as QUERY_BLOCK
from moejax.offload.memory_budget import size
from moejax.plan.hardware import Profile
from moejax.plan.resolve import profile_for
from moejax.plan.theta import theta_eq1

DEFAULT_TOKENS = 8192  # launch.serve's budget before batches were sized from the device; CPUs and completions keep it
_F32 = 4


@dataclasses.dataclass(frozen=True)
class ScoreBatchSize:
    tokens: int  # token budget of one scoring batch, padding included
    cap: int | None  # the most tokens the memory budget leaves room for (None: no bound known); caps Θ's growth too
    tree_tokens: int  # the most tokens of one prefix tree, and so of a row
    source: str  # why this size, for --explain and the run summary

    def describe(self) -> str:
        return f"scoring batches: up to {self.tokens} tokens ({self.source})"

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def activation_bytes_per_token(cfg: ModelConfig, dtype_bytes: int, keys: int) -> int:
    """Device bytes one token of a scoring step may hold at once, counted generously (XLA may keep all of a layer's
    intermediates alive together): the float32 residual stream, its norm and the layer's output; attention's q, k, v
    and output in the model dtype and its float32 scores and weights over `keys` keys per head; the widest MLP, either
    top-k routed copies of the token with their gate/up, activation and (float32) down outputs plus the router's
    float32 logits, or a dense or shared MLP's gate/up and activation."""
    D, H, b = cfg.hidden_size, cfg.num_heads, dtype_bytes
    q_dim, v_dim = cfg.q_head_dim, cfg.v_head_dim if cfg.attention == "mla" else cfg.head_dim
    kv_heads = H if cfg.attention == "mla" else cfg.num_kv_heads  # MLA prefills the expanded form
    attention = (H * q_dim + kv_heads * (q_dim + v_dim) + H * v_dim) * b + 2 * H * keys * _F32
    k, I = cfg.num_experts_per_tok, cfg.moe_intermediate_size
    routed = k * (D + 3 * I) * b + k * D * _F32 + cfg.num_experts * _F32 if cfg.num_experts else 0
    dense = 3 * max(cfg.intermediate_size, cfg.shared_expert_size) * b
    return 3 * D * _F32 + attention + routed + dense


def score_batch_size(engine: Engine, asked: int | None, *, longest: int, reserved_bytes: float = 0.0,
                     platform: str | None = None, profile: Profile | None = None) -> ScoreBatchSize:
    """The scoring batch budget of `engine` (see the module docstring). asked: --max-batch-tokens (None: not given);
    longest: the longest scoring sequence (context + candidate) in tokens, which bounds the keys a query reads;
    reserved_bytes: device memory the run keeps besides the weights (the prefix KV cache's pool). platform and
    profile are the devices' own unless given (a test sizes a GPU's batches on a CPU)."""
    if asked is not None:
        return ScoreBatchSize(asked, None, asked, f"--max-batch-tokens {asked}, as given; it wins over the device's "
                              "size")
    platform = platform or jax.devices()[0].platform
    if platform != "gpu":
        return ScoreBatchSize(DEFAULT_TOKENS, None, DEFAULT_TOKENS, f"the default on {platform}")
    cfg = engine.config
    if engine.saturation is not None and engine.memory_budget.offloads:
        # Θ of host copies; resident AsyncEP's (its all-gather) is often far below a full device: batch.py still
        # fills batches to it, the budget is a full device's below
        theta = engine.saturation
        floor = f"Θ of the streamed experts, {theta.source}"
        tokens = theta.theta_tokens
    else:
        if profile is None:
            try:
                profile = profile_for(jax.devices()[0].device_kind, len(jax.devices()),
                                      engine.plan.profile if engine.plan is not None else None)
            except ValueError as e:
                return ScoreBatchSize(DEFAULT_TOKENS, None, DEFAULT_TOKENS, f"the default: {e}")
        theta = theta_eq1(cfg, profile)
        floor = f"a full device: Θ by Eq. 1 on profile {profile.name} ({profile.source})"
        tokens = theta.theta_tokens * engine.row_multiple
    cap, bound = _memory_cap(engine, longest, reserved_bytes)
    if cap is not None and cap < tokens:
        tokens, floor = max(cap, 1), f"{floor} asks {tokens} tokens"
    return ScoreBatchSize(tokens, cap, min(tokens, DEFAULT_TOKENS),
                          f"sized for the GPU: {floor}" + (f"; {bound}" if bound else ""))


def _memory_cap(engine: Engine, longest: int, reserved_bytes: float) -> tuple[int | None, str]:
    """(the most tokens the memory budget leaves activations room for, how it was counted); (None, "") without a
    budget."""
    budget = engine.memory_budget
    if budget is None or budget.budget_bytes is None:
        return None, ""
    keys = longest + 2 * QUERY_BLOCK  # a query block reads its tree's keys, its window rounded to whole blocks
    per_token = activation_bytes_per_token(engine.config, engine.dtype.itemsize, keys)
    free = max(budget.budget_bytes - budget.device_bytes - reserved_bytes, 0)
    cap = int(free // per_token) * engine.row_multiple
    return cap, (f"memory: budget {size(budget.budget_bytes)} less weights {size(budget.device_bytes)} and "
                 f"{size(reserved_bytes)} of prefix cache leaves {size(free)}, at {size(per_token)} of activations "
                 f"per token ({keys} keys a query) {cap} tokens")
