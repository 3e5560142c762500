"""Built-in models. Presets: HF-style config dicts, weights drawn at random from a seed (no download); `tiny-*` and
`micro-*` run on a CPU in seconds, the others have the real models' shapes, for benchmarks and memory planning
(build them with `num_layers=` to run a slice). Embedded: trained checkpoint directories shipped inside the package
(moejax/assets/<name>, written by `python -m launch.train`), loaded like any checkpoint directory."""
from __future__ import annotations

import copy
import os

EMBEDDED = ("pycode-moe",)  # a Qwen3-MoE trained on the Python standard library's sources (its README.md)
DEFAULT_MODEL = "pycode-moe"

_QWEN3_30B = dict(
    model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
    num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
    num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], rope_theta=1e6,
    max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=151643,
    eos_token_id=151645)

_MIXTRAL_8X7B = dict(
    model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, rope_theta=1e6,
    max_position_embeddings=32768, rms_norm_eps=1e-5, sliding_window=None, tie_word_embeddings=False,
    bos_token_id=1, eos_token_id=2)

_DEEPSEEK_V2_LITE = dict(
    model_type="deepseek_v2", vocab_size=102400, hidden_size=2048, intermediate_size=10944,
    moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
    n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1, kv_lora_rank=512,
    q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, topk_method="greedy",
    n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False, rope_theta=10000,
    rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
                      mscale=0.707, mscale_all_dim=0.707),
    max_position_embeddings=163840, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=100000,
    eos_token_id=100001)

_GPT_OSS_20B = dict(
    model_type="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
    num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
    sliding_window=128, layer_types=["sliding_attention", "full_attention"] * 12, rope_theta=150000,
    rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                      original_max_position_embeddings=4096),
    max_position_embeddings=131072, swiglu_limit=7.0, rms_norm_eps=1e-5, attention_bias=True,
    tie_word_embeddings=False, eos_token_id=200002)

_TINY_QWEN3 = dict(
    model_type="qwen3_moe", vocab_size=1024, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
    num_experts_per_tok=2, norm_topk_prob=True, rope_theta=10000.0, max_position_embeddings=2048,
    rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=0)

# A model whose compute per step is negligible, so a generation benchmark measures the scheduler's own work
# (`launch.bench generate --workload long-tail`).
_MICRO_QWEN3 = dict(
    model_type="qwen3_moe", vocab_size=320, hidden_size=48, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=12, num_experts=8,
    num_experts_per_tok=2, norm_topk_prob=True, rope_theta=10000.0, max_position_embeddings=2048,
    rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=0)

# The micro model 12 layers deep: what compiling and running a deep model costs, on a CPU (the GPU check's full-depth
# steps in their dry run).
_MICRO_QWEN3_DEEP = dict(_MICRO_QWEN3, num_hidden_layers=12)

# Experts wide enough that copying them outweighs computing with them, even on a CPU: a decode step of the cached or
# streamed placement is then bound by its copies, as on a GPU behind PCIe (`launch.bench tpot-sweep`, the TPOT bound
# of moejax.offload.tpot_bound). 12 MiB per expert in float32.
_TINY_WIDE_EXPERTS = dict(
    model_type="qwen3_moe", vocab_size=320, hidden_size=256, intermediate_size=512, moe_intermediate_size=4096,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=8,
    num_experts_per_tok=2, norm_topk_prob=True, rope_theta=10000.0, max_position_embeddings=4096,
    rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=0)

PRESETS = {
    "tiny-qwen3-moe": _TINY_QWEN3,
    "micro-qwen3-moe": _MICRO_QWEN3,
    "micro-qwen3-moe-deep": _MICRO_QWEN3_DEEP,
    "tiny-wide-experts": _TINY_WIDE_EXPERTS,
    "qwen3-30b-a3b": _QWEN3_30B,
    "mixtral-8x7b": _MIXTRAL_8X7B,
    "deepseek-v2-lite": _DEEPSEEK_V2_LITE,
    "gpt-oss-20b": _GPT_OSS_20B,
}


def embedded_dir(name: str) -> str | None:
    """The directory of an embedded trained model, or None when `name` is not one (or its files are missing)."""
    if name not in EMBEDDED:
        return None
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", name)
    return path if os.path.isfile(os.path.join(path, "config.json")) else None


def resolve_embedded(model: str) -> str:
    """An embedded model's name -> its directory (a directory of that name in the working directory wins);
    anything else unchanged."""
    if model in EMBEDDED and not os.path.isdir(model):
        return embedded_dir(model) or model
    return model


def preset_config(name: str) -> dict:
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    return copy.deepcopy(PRESETS[name])
