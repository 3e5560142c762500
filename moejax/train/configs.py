"""Model shapes the trainer knows, as Hugging Face `qwen3_moe` config dicts (what the export writes).

`pycode-moe` is the shipped embedded model (moejax/assets/pycode-moe); `micro` is for tests (a few seconds)."""
from __future__ import annotations

import copy

_QWEN3_MOE = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_act="silu", norm_topk_prob=True,
    decoder_sparse_step=1, mlp_only_layers=[], rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
    attention_bias=False, attention_dropout=0.0, use_sliding_window=False, sliding_window=None,
    output_router_logits=False, initializer_range=0.02, use_cache=True, bos_token_id=None)

TRAIN_CONFIGS = {
    # Hidden 256, 6 layers, 16 experts top-2 of width 128: ~15M parameters, 30 MB in bfloat16.
    "pycode-moe": dict(_QWEN3_MOE, vocab_size=8192, hidden_size=256, intermediate_size=512,
                       moe_intermediate_size=128, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=64, num_experts=16, num_experts_per_tok=2, max_position_embeddings=1024),
    "micro": dict(_QWEN3_MOE, vocab_size=512, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=4,
                  num_experts_per_tok=2, max_position_embeddings=128),
}


def train_config(name: str, *, eos_token_id: int) -> dict:
    if name not in TRAIN_CONFIGS:
        raise KeyError(f"unknown training config {name!r}; known: {', '.join(TRAIN_CONFIGS)}")
    return dict(copy.deepcopy(TRAIN_CONFIGS[name]), eos_token_id=eos_token_id, pad_token_id=eos_token_id)
