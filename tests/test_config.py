"""ModelConfig.from_hf on hub-style (transformers 4.x) and save_pretrained-style (5.x) config.json."""
import math

import pytest

from moejax import ConfigError, ModelConfig

QWEN3_30B_HUB = {  # Qwen/Qwen3-30B-A3B config.json (transformers 4.51 spelling)
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
    "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe",
    "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936}

DEEPSEEK_V3_HUB = {  # deepseek-ai/DeepSeek-V3 config.json without its fp8 quantization_config
    "model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4,
    "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True, "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 3, "moe_layer_freq": 1, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "num_attention_heads": 128,
    "num_key_value_heads": 128, "num_hidden_layers": 61, "num_nextn_predict_layers": 1, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "vocab_size": 129280, "tie_word_embeddings": False,
    "hidden_act": "silu", "bos_token_id": 0, "eos_token_id": 1}

GPT_OSS_HUB = {  # openai/gpt-oss-20b config.json without its mxfp4 quantization_config
    "model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 24,
    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 32,
    "num_experts_per_tok": 4, "experts_per_token": 4, "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "rope_theta": 150000,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "max_position_embeddings": 131072, "swiglu_limit": 7.0, "rms_norm_eps": 1e-05, "attention_bias": True,
    "tie_word_embeddings": False, "vocab_size": 201088, "hidden_act": "silu", "eos_token_id": 200002}


def test_qwen3_hub_config():
    c = ModelConfig.from_hf(QWEN3_30B_HUB)
    assert (c.num_layers, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (48, 128, 8, 768)
    assert c.qk_norm and c.norm_topk_prob and all(c.moe_layers) and c.layer_types == ("full",) * 48
    assert c.rope.theta == 1e6 and c.rope.kind == "default" and c.sliding_window is None
    assert c.softmax_scale == pytest.approx(128 ** -0.5) and c.eos_token_ids == (151645,)


def test_transformers5_spelling_parses_the_same():
    v5 = {k: v for k, v in QWEN3_30B_HUB.items() if k not in ("num_experts", "rope_theta", "rope_scaling")}
    v5 |= {"num_local_experts": 128, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}
    assert ModelConfig.from_hf(v5) == ModelConfig.from_hf(QWEN3_30B_HUB)


def test_dense_layers_from_sparse_step_and_mlp_only_layers():
    c = ModelConfig.from_hf({**QWEN3_30B_HUB, "num_hidden_layers": 6, "decoder_sparse_step": 2,
                             "mlp_only_layers": [3]})
    assert c.moe_layers == (False, True, False, False, False, True)


def test_deepseek_v3_hub_config():
    c = ModelConfig.from_hf(DEEPSEEK_V3_HUB)
    assert c.attention == "mla" and c.q_lora_rank == 1536 and c.kv_lora_rank == 512
    assert c.moe_layers[:4] == (False, False, False, True) and c.shared_expert_size == 2048
    assert c.router_scoring == "sigmoid" and c.score_correction_bias and c.topk_groups == (8, 4)
    assert c.group_score == "top2_sum" and c.routed_scaling_factor == 2.5 and c.norm_topk_prob
    assert c.rope.kind == "yarn" and c.rope.factor == 40 and c.rope.interleaved
    mscale = 0.1 * 1.0 * math.log(40) + 1.0
    assert c.softmax_scale == pytest.approx(192 ** -0.5 * mscale ** 2)


def test_deepseek_v2_routing_variants():
    v2 = {**DEEPSEEK_V3_HUB, "model_type": "deepseek_v2", "scoring_func": "softmax", "topk_method": "greedy"}
    assert ModelConfig.from_hf(v2).topk_groups is None
    g = ModelConfig.from_hf({**v2, "topk_method": "group_limited_greedy"})
    assert g.topk_groups == (8, 4) and g.group_score == "max" and g.router_scoring == "softmax"


def test_gpt_oss_hub_config():
    c = ModelConfig.from_hf(GPT_OSS_HUB)
    assert c.sinks and c.qkv_bias and c.o_bias and c.router_bias and c.expert_bias
    assert c.layer_types[:2] == ("sliding", "full") and c.sliding_window == 128
    assert c.expert_act == "swiglu_clamp" and c.swiglu_limit == 7.0 and c.norm_topk_prob
    assert c.rope.kind == "yarn" and c.rope.truncate is False and c.rope.original_max_position == 4096


def test_replace_num_layers_trims_tables():
    c = ModelConfig.from_hf(DEEPSEEK_V3_HUB).replace(num_layers=5)
    assert c.num_layers == 5 and len(c.moe_layers) == 5 and len(c.layer_types) == 5


@pytest.mark.parametrize("change, field", [
    ({"model_type": "llama"}, "'model_type' 'llama'"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "unsupported rope type 'dynamic'"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "unsupported rope type 'longrope'"),
    ({"hidden_act": "gelu"}, "'hidden_act' 'gelu'"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quant_method='fp8'"),
    ({"num_experts_per_tok": None}, "missing field 'num_experts_per_tok'"),
])
def test_unsupported_settings_name_the_field(change, field):
    with pytest.raises(ConfigError, match=field.replace("(", r"\(").replace("'", "'")):
        ModelConfig.from_hf({**QWEN3_30B_HUB, **change})


def test_deepseek_unsupported_router_settings():
    with pytest.raises(ConfigError, match="'topk_method' 'weird'"):
        ModelConfig.from_hf({**DEEPSEEK_V3_HUB, "topk_method": "weird"})
    with pytest.raises(ConfigError, match="'scoring_func' 'softmax'"):
        ModelConfig.from_hf({**DEEPSEEK_V3_HUB, "scoring_func": "softmax"})
    with pytest.raises(ConfigError, match="'n_group' 7 does not divide 256"):
        ModelConfig.from_hf({**DEEPSEEK_V3_HUB, "n_group": 7})
