"""Bytes a decode step must read from device memory: what MBU (model bandwidth utilisation) divides by the step
time and the measured copy ceiling (launch.bench generate --decode-batches).

A step makes one token for each of `rows` sequences. It reads every weight but the routed experts and the
embedding table once (attention, norms, routers, dense and shared MLPs, the head), the embedding rows of its tokens,
in each MoE layer the routed experts its tokens route to, and each row's KV up to its context. Routing is counted
as uniform: `rows` tokens each picking k of E experts leave an expert unread with probability (1 - k/E)^rows, so a
layer reads E·(1 - (1 - k/E)^rows) experts on average (random-weight presets route near uniformly; a trained
router's skew makes the true count lower, and MBU from this count an upper bound)."""
from __future__ import annotations

from moejax.config import ModelConfig


def expected_experts(experts: int, top_k: int, tokens: int) -> float:
    """Distinct experts `tokens` tokens hit on average, each picking top_k of `experts` uniformly (without
    replacement within a token, independently across tokens)."""
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


def expert_bytes(cfg: ModelConfig, dtype_bytes: int) -> int:
    """One routed expert of one layer: its gate, up and down projections (and biases)."""
    D, I = cfg.hidden_size, cfg.moe_intermediate_size
    return (3 * D * I + (2 * I + D) * cfg.expert_bias) * dtype_bytes


def iterations_bytes(cfg: ModelConfig, param_bytes: int, dtype_bytes: int, kv_bytes_per_token: int,
                     iterations: list[tuple[int, int]]) -> dict:
    """The bytes of decode token iterations [(rows, tokens those rows attend to in all)], summed by part."""
    total = dict.fromkeys(("dense_weights", "embedding_rows", "routed_experts", "kv", "total"), 0.0)
    for rows, attended in iterations:
        one = decode_step_bytes(cfg, param_bytes, dtype_bytes, kv_bytes_per_token, rows, attended / rows)
        for k in total:
            total[k] += one[k]
    some = decode_step_bytes(cfg, param_bytes, dtype_bytes, kv_bytes_per_token, 1, 1)
    return dict(total, iterations=len(iterations), tokens=sum(r for r, _ in iterations),
                kv_bytes_per_token=kv_bytes_per_token, expert_bytes=some["expert_bytes"],
                moe_layers=some["moe_layers"], counted=some["counted"])


def decode_step_bytes(cfg: ModelConfig, param_bytes: int, dtype_bytes: int, kv_bytes_per_token: int, rows: int,
                      context: float) -> dict:
    """The bytes one decode step of `rows` rows reads, each row attending to `context` tokens on average.
    param_bytes: all the model's weights (Engine.param_bytes)."""
    moe_layers = sum(cfg.is_moe(i) for i in range(cfg.num_layers))
    one_expert = expert_bytes(cfg, dtype_bytes)
    embedding = cfg.vocab_size * cfg.hidden_size * dtype_bytes
    routed_all = moe_layers * cfg.num_experts * one_expert
    hit = expected_experts(cfg.num_experts, cfg.num_experts_per_tok, rows) if moe_layers else 0.0
    parts = dict(dense_weights=param_bytes - routed_all - embedding,  # attention, norms, routers, MLPs, head
                 embedding_rows=min(rows, cfg.vocab_size) * cfg.hidden_size * dtype_bytes,
                 routed_experts=moe_layers * hit * one_expert,
                 kv=rows * context * kv_bytes_per_token)
    return dict(parts, total=sum(parts.values()), experts_per_layer=hit, expert_bytes=one_expert,
                moe_layers=moe_layers, rows=rows, context=context, kv_bytes_per_token=kv_bytes_per_token,
                counted=__doc__.split("\n\n")[1].replace("\n", " "))
