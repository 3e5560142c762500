"""Analytic FLOPs and parameter counts of a ModelConfig: pure functions, no JAX devices needed.

Conventions (shared by cost models, planners and benchmarks):
- A matmul [m, k] x [k, n] costs 2*m*n*k FLOPs. Elementwise work (norms, rope, softmax, activations,
  the routing weights' combine) is not counted, nor are biases.
- Prefill = one forward over B sequences of T tokens each, starting from an empty cache.
- Attention scores + values: each visible (query, key) pair of each head costs 2*d_qk + 2*d_v.
  Causal: a sequence of T tokens has T*(T+1)/2 pairs; a sliding window w (a key at distance
  < w is visible, as in moejax) caps each query at min(t, w) keys.
- GQA projections: q (D -> H*hd), k and v (D -> Hkv*hd), o (H*hd -> D). MLA as moejax prefills it
  (expanded form): q (D -> H*(nope+rope)) or q_a (D -> r_q) + q_b (r_q -> H*(nope+rope)),
  kv_a (D -> r_kv + rope), kv_b (r_kv -> H*(nope+v)), o (H*v -> D); scores use d_qk = nope+rope.
- MoE layer: router 2*D*E per token; routed experts 6*D*I per token per active expert (k of E:
  gate, up, down); shared expert 6*D*S (+ 2*D for its gate). Dense-MLP layers 6*D*F per token.
- lm_head: 2*D*V per token at every position (`Engine.logits` scores every position) unless
  `all_logits=False` (one position per sequence).
- Parameter counts include biases, norms, embeddings and the lm_head; "active" counts the k routed
  experts a token uses instead of all E.
"""
from __future__ import annotations

import dataclasses

from moejax.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class PrefillFlops:
    attn_proj: int
    attn_scores: int
    router: int
    experts: int
    shared_experts: int
    dense_mlp: int
    lm_head: int

    @property
    def total(self) -> int:
        return sum(dataclasses.astuple(self))

    def as_dict(self) -> dict[str, int]:
        return {**dataclasses.asdict(self), "total": self.total}


def causal_pairs(T: int, window: int | None = None) -> int:
    """Visible (query, key) pairs in one causal sequence of T tokens: sum over t=1..T of min(t, w)."""
    w = T if window is None else min(window, T)
    return w * (w + 1) // 2 + (T - w) * w


def _attn_proj_params(cfg: ModelConfig) -> int:
    D, H = cfg.hidden_size, cfg.num_heads
    if cfg.attention == "mla":
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        q = D * cfg.q_lora_rank + cfg.q_lora_rank * H * qk if cfg.q_lora_rank else D * H * qk
        kv = D * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank * H * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        return q + kv + H * cfg.v_head_dim * D
    hd = cfg.head_dim
    return D * (H + 2 * cfg.num_kv_heads) * hd + H * hd * D


def _window(cfg: ModelConfig, layer: int) -> int | None:
    types = cfg.layer_types
    return cfg.sliding_window if types and types[layer] == "sliding" else None


def prefill_flops(cfg: ModelConfig, batch: int, seq: int, *, all_logits: bool = True) -> PrefillFlops:
    """FLOPs of one prefill forward of `batch` sequences of `seq` tokens (see module docstring)."""
    B, T, D = batch, seq, cfg.hidden_size
    N = B * T
    d_qk, d_v = (cfg.q_head_dim, cfg.v_head_dim) if cfg.attention == "mla" else (cfg.head_dim, cfg.head_dim)
    parts = {f.name: 0 for f in dataclasses.fields(PrefillFlops)}
    for layer in range(cfg.num_layers):
        parts["attn_proj"] += 2 * N * _attn_proj_params(cfg)
        parts["attn_scores"] += B * cfg.num_heads * causal_pairs(T, _window(cfg, layer)) * 2 * (d_qk + d_v)
        if cfg.is_moe(layer):
            parts["router"] += 2 * N * D * cfg.num_experts
            parts["experts"] += 6 * N * cfg.num_experts_per_tok * D * cfg.moe_intermediate_size
            if cfg.shared_expert_size:
                parts["shared_experts"] += 6 * N * D * cfg.shared_expert_size + 2 * N * D * cfg.shared_expert_gate
        else:
            parts["dense_mlp"] += 6 * N * D * cfg.intermediate_size
    parts["lm_head"] = 2 * (N if all_logits else B) * D * cfg.vocab_size
    return PrefillFlops(**parts)


def _layer_params(cfg: ModelConfig, layer: int, active: bool) -> int:
    D, H = cfg.hidden_size, cfg.num_heads
    n = 2 * D + _attn_proj_params(cfg)  # two norms + projections
    if cfg.attention == "mla":
        n += cfg.kv_lora_rank + (cfg.q_lora_rank or 0)  # latent norms
        if cfg.mla_bias:
            n += (cfg.q_lora_rank or 0) + cfg.kv_lora_rank + cfg.qk_rope_head_dim + D
    else:
        hd, K = cfg.head_dim, cfg.num_kv_heads
        n += (H + 2 * K) * hd * cfg.qkv_bias + D * cfg.o_bias + 2 * hd * cfg.qk_norm + H * cfg.sinks
    if not cfg.is_moe(layer):
        return n + 3 * D * cfg.intermediate_size + (2 * cfg.intermediate_size + D) * cfg.mlp_bias
    E, I, S = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_size
    n += D * E + E * (cfg.router_bias + cfg.score_correction_bias)
    experts = cfg.num_experts_per_tok if active else E
    n += experts * (3 * D * I + (2 * I + D) * cfg.expert_bias)
    if S:
        n += 3 * D * S + (2 * S + D) * cfg.mlp_bias + D * cfg.shared_expert_gate
    return n


def param_count(cfg: ModelConfig, *, active: bool = False) -> int:
    """Parameters of the model (`active=True`: those one token uses, k of the E routed experts)."""
    D = cfg.hidden_size
    head = 0 if cfg.tie_word_embeddings else D * cfg.vocab_size
    return cfg.vocab_size * D + head + D + sum(_layer_params(cfg, i, active) for i in range(cfg.num_layers))


def active_param_count(cfg: ModelConfig) -> int:
    return param_count(cfg, active=True)


def layer_flops_per_token(cfg: ModelConfig) -> float:
    """Matmul FLOPs per token through the decoder layers (embedding and head excluded; attention scores too)."""
    return 2.0 * (active_param_count(cfg) - 2 * cfg.vocab_size * cfg.hidden_size)
