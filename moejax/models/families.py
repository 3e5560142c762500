"""Per-family checkpoint key mapping, table-driven.

Maps each parameter of `MoEModel` (an nnx path such as ('layers', 3, 'attn', 'wq')) to the Hugging Face
tensors it is made from. HF linear weights are [out, in]; ours are [in, out] (`T` transposes).
Expert tensors come either per expert (`mlp.experts.{e}.gate_proj.weight`, the hub layout) or fused
(`mlp.experts.gate_up_proj`, what transformers 5 keeps in memory; GPT-OSS's native layout).
"""
from __future__ import annotations

import dataclasses
import re

from moejax.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Tensor:
    key: str
    transpose: bool = False


@dataclasses.dataclass(frozen=True)
class Experts:
    """An [E, ...] expert tensor. `part`: gate_up | down | gate_up_bias | down_bias."""
    prefix: str  # e.g. "model.layers.3.mlp.experts."
    part: str
    interleaved: bool = False  # GPT-OSS fuses gate/up as alternating columns


# Hub spellings renamed to the one spelling the tables below use (as transformers' loader does).
_RENAMES = {
    "mixtral": [(r"\.block_sparse_moe\.", ".mlp."), (r"\.experts\.(\d+)\.w1\.", r".experts.\1.gate_proj."),
                (r"\.experts\.(\d+)\.w3\.", r".experts.\1.up_proj."),
                (r"\.experts\.(\d+)\.w2\.", r".experts.\1.down_proj.")],
}
# Tensors that checkpoints may carry but that hold no parameter (recomputed buffers).
NON_PARAMETERS = re.compile(r"\.rotary_emb\.inv_freq$")

_GQA = {"wq": ("self_attn.q_proj.weight", True), "wk": ("self_attn.k_proj.weight", True),
        "wv": ("self_attn.v_proj.weight", True), "wo": ("self_attn.o_proj.weight", True),
        "bq": ("self_attn.q_proj.bias", False), "bk": ("self_attn.k_proj.bias", False),
        "bv": ("self_attn.v_proj.bias", False), "bo": ("self_attn.o_proj.bias", False),
        "q_norm.weight": ("self_attn.q_norm.weight", False), "k_norm.weight": ("self_attn.k_norm.weight", False),
        "sinks": ("self_attn.sinks", False)}
_MLA = {"wq": ("self_attn.q_proj.weight", True), "wq_a": ("self_attn.q_a_proj.weight", True),
        "bq_a": ("self_attn.q_a_proj.bias", False), "q_a_norm.weight": ("self_attn.q_a_layernorm.weight", False),
        "wq_b": ("self_attn.q_b_proj.weight", True), "wkv_a": ("self_attn.kv_a_proj_with_mqa.weight", True),
        "bkv_a": ("self_attn.kv_a_proj_with_mqa.bias", False),
        "kv_a_norm.weight": ("self_attn.kv_a_layernorm.weight", False),
        "wkv_b": ("self_attn.kv_b_proj.weight", True), "wo": ("self_attn.o_proj.weight", True),
        "bo": ("self_attn.o_proj.bias", False)}
_MLP = {"w_gate": ("gate_proj.weight", True), "w_up": ("up_proj.weight", True),
        "w_down": ("down_proj.weight", True), "b_gate": ("gate_proj.bias", False),
        "b_up": ("up_proj.bias", False), "b_down": ("down_proj.bias", False)}
_NORMS = {"attn_norm.weight": "input_layernorm.weight", "mlp_norm.weight": "post_attention_layernorm.weight"}
_EXPERT_PARTS = {"we_gate_up": "gate_up", "we_down": "down", "be_gate_up": "gate_up_bias", "be_down": "down_bias"}


def normalize_key(cfg: ModelConfig, key: str) -> str:
    for pattern, repl in _RENAMES.get(cfg.model_type, ()):
        key = re.sub(pattern, repl, key)
    return key


def source(cfg: ModelConfig, path: tuple) -> Tensor | Experts:
    """Where the parameter at `path` comes from in a (normalized) HF checkpoint."""
    name = ".".join(str(p) for p in path)
    if name == "embed":
        return Tensor("model.embed_tokens.weight")
    if name == "final_norm.weight":
        return Tensor("model.norm.weight")
    if name == "lm_head":
        return Tensor("lm_head.weight", True)
    _, layer, block, *rest = path
    p = f"model.layers.{layer}."
    local = ".".join(str(r) for r in rest)
    if block in ("attn_norm", "mlp_norm"):
        return Tensor(p + _NORMS[f"{block}.{local}"])
    if block == "attn":
        key, t = (_MLA if cfg.attention == "mla" else _GQA)[local]
        return Tensor(p + key, t)
    # block == "mlp"
    if local in _EXPERT_PARTS:
        return Experts(p + "mlp.experts.", _EXPERT_PARTS[local], interleaved=cfg.model_type == "gpt_oss")
    router = "mlp.router." if cfg.model_type == "gpt_oss" else "mlp.gate."
    if local == "router":
        return Tensor(p + router + "weight", True)
    if local == "router_bias":
        return Tensor(p + router + "bias")
    if local == "correction_bias":
        return Tensor(p + "mlp.gate.e_score_correction_bias")
    if local == "shared_gate":
        return Tensor(p + "mlp.shared_expert_gate.weight", True)
    if local.startswith("shared."):
        shared = "mlp.shared_expert." if cfg.model_type == "qwen2_moe" else "mlp.shared_experts."
        key, t = _MLP[local[len("shared."):]]
        return Tensor(p + shared + key, t)
    key, t = _MLP[local]
    return Tensor(p + "mlp." + key, t)
