"""ModelConfig: every supported MoE family as one frozen dataclass, built from a HF config.json."""
from __future__ import annotations

import dataclasses
import math
from typing import Any

FAMILIES = ("qwen3_moe", "mixtral", "qwen2_moe", "deepseek_v2", "deepseek_v3", "gpt_oss")
ROPE_TYPES = ("default", "linear", "yarn", "llama3")


class ConfigError(ValueError):
    """A config.json field that moejax cannot serve; the message names the field and value."""


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # one of ROPE_TYPES
    factor: float = 1.0
    original_max_position: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    interleaved: bool = False  # rotate (x0,x1),(x2,x3)… pairs instead of halves (DeepSeek)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP width
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    rope: RopeConfig = RopeConfig()
    # attention
    attention: str = "gqa"  # "gqa" or "mla"
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    sinks: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()  # per layer: "full" or "sliding"
    softmax_scale: float = 1.0  # attention logit scale
    # MLA (DeepSeek)
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    mla_bias: bool = False
    # MLP / MoE
    mlp_bias: bool = False
    moe_layers: tuple[bool, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    router_scoring: str = "softmax"  # "softmax" or "sigmoid"
    router_bias: bool = False
    score_correction_bias: bool = False  # DeepSeek-V3 e_score_correction_bias (selection only)
    topk_groups: tuple[int, int] | None = None  # (n_group, topk_group) for group-limited routing
    group_score: str = "max"  # "max" (V2) or "top2_sum" (V3)
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    shared_expert_size: int = 0  # 0: no shared expert
    shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid(x @ w) scales the shared expert
    expert_bias: bool = False
    expert_act: str = "silu"  # "silu" or "swiglu_clamp" (GPT-OSS)
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    extra_layers: int = 0  # layers stored after the decoder that moejax does not run (DeepSeek-V3 MTP)

    @property
    def q_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.attention == "mla" else self.head_dim

    @property
    def rotary_dim(self) -> int:
        return self.qk_rope_head_dim if self.attention == "mla" else self.head_dim

    def is_moe(self, layer: int) -> bool:
        return self.moe_layers[layer]

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with fields changed; a smaller `num_layers` also trims the per-layer tables."""
        n = changes.get("num_layers", self.num_layers)
        if n > self.num_layers:
            raise ConfigError(f"num_layers={n}: a config can only be cut to fewer than its {self.num_layers} layers")
        changes.setdefault("moe_layers", self.moe_layers[:n])
        changes.setdefault("layer_types", self.layer_types[:n])
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> ModelConfig:
        return _from_hf(config)


def _need(c: dict, *names: str, default: Any = KeyError) -> Any:
    for n in names:
        if c.get(n) is not None:
            return c[n]
    if default is KeyError:
        raise ConfigError(f"config.json: missing field {' / '.join(repr(n) for n in names)}")
    return default


def _rope(c: dict, interleaved: bool) -> RopeConfig:
    params = dict(c.get("rope_parameters") or {})
    if params and all(isinstance(v, dict) for v in params.values()):  # per-layer-type rope (5.x)
        variants = list(params.values())
        if any(v != variants[0] for v in variants):
            raise ConfigError(f"config.json: 'rope_parameters' differs per layer type ({sorted(params)}); unsupported")
        params = dict(variants[0])
    scaling = c.get("rope_scaling") or {}
    merged = {**scaling, **params}
    kind = merged.get("rope_type", merged.get("type", "default")) or "default"
    if kind not in ROPE_TYPES:
        raise ConfigError(f"config.json: unsupported rope type {kind!r} in 'rope_parameters'/'rope_scaling' "
                          f"(supported: {', '.join(ROPE_TYPES)})")
    theta = merged.get("rope_theta", c.get("rope_theta", 10000.0))
    orig = merged.get("original_max_position_embeddings", c.get("original_max_position_embeddings"))
    if kind in ("yarn", "llama3") and orig is None:
        orig = c.get("max_position_embeddings")
    factor = merged.get("factor")
    if factor is None:
        if kind == "yarn" and orig:
            factor = c["max_position_embeddings"] / orig
        elif kind != "default":
            raise ConfigError(f"config.json: rope type {kind!r} needs 'factor'")
    return RopeConfig(
        theta=float(theta), kind=kind, factor=float(factor or 1.0), original_max_position=orig,
        beta_fast=float(merged.get("beta_fast") or 32.0), beta_slow=float(merged.get("beta_slow") or 1.0),
        mscale=merged.get("mscale"), mscale_all_dim=merged.get("mscale_all_dim"),
        attention_factor=merged.get("attention_factor"), truncate=bool(merged.get("truncate", True)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)), interleaved=interleaved)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _eos(c: dict) -> tuple[int, ...]:
    e = c.get("eos_token_id")
    return () if e is None else tuple(e) if isinstance(e, (list, tuple)) else (int(e),)


def _layer_types(c: dict, n: int, default_sliding: bool) -> tuple[str, ...]:
    names = c.get("layer_types")
    if names is None:
        return ("sliding" if default_sliding else "full",) * n
    out = []
    for i, t in enumerate(names[:n]):
        if t not in ("full_attention", "sliding_attention"):
            raise ConfigError(f"config.json: 'layer_types[{i}]' = {t!r} (expected full_attention or sliding_attention)")
        out.append("sliding" if t == "sliding_attention" else "full")
    if len(out) != n:
        raise ConfigError(f"config.json: 'layer_types' has {len(names)} entries for {n} layers")
    return tuple(out)


def _from_hf(c: dict[str, Any]) -> ModelConfig:
    mt = c.get("model_type")
    if mt not in FAMILIES:
        raise ConfigError(f"config.json: unsupported 'model_type' {mt!r} (supported: {', '.join(FAMILIES)})")
    quant = c.get("quantization_config")
    if quant:
        raise ConfigError(f"config.json: quantized checkpoints are not supported yet ('quantization_config' "
                          f"quant_method={quant.get('quant_method')!r}); use a bfloat16/float32 checkpoint")
    act = c.get("hidden_act", "silu")
    if mt != "gpt_oss" and act not in ("silu", "swish"):
        raise ConfigError(f"config.json: unsupported 'hidden_act' {act!r} (supported: silu)")
    n = int(_need(c, "num_hidden_layers"))
    heads = int(_need(c, "num_attention_heads"))
    hidden = int(_need(c, "hidden_size"))
    base: dict[str, Any] = dict(
        model_type=mt, vocab_size=int(_need(c, "vocab_size")), hidden_size=hidden, num_layers=n,
        num_heads=heads, num_kv_heads=int(_need(c, "num_key_value_heads", default=heads)),
        head_dim=int(_need(c, "head_dim", default=hidden // heads)),
        intermediate_size=int(_need(c, "intermediate_size", default=0)),
        rms_norm_eps=float(_need(c, "rms_norm_eps", default=1e-6)),
        max_position_embeddings=int(_need(c, "max_position_embeddings", default=4096)),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        num_experts=int(_need(c, "num_experts", "num_local_experts", "n_routed_experts")),
        num_experts_per_tok=int(_need(c, "num_experts_per_tok")),
        bos_token_id=c.get("bos_token_id"), eos_token_ids=_eos(c))
    moe_size: Any = c.get("moe_intermediate_size")  # int() below: a missing one fails there, as before
    window: Any = c.get("sliding_window")

    if mt in ("qwen3_moe", "qwen2_moe"):
        step = int(c.get("decoder_sparse_step", 1) or 1)
        only = set(c.get("mlp_only_layers") or [])
        moe = tuple(i not in only and base["num_experts"] > 0 and (i + 1) % step == 0 for i in range(n))
        if mt == "qwen3_moe":
            use_window = bool(c.get("use_sliding_window", False)) and window is not None
            extra: dict[str, Any] = dict(qk_norm=True, qkv_bias=bool(c.get("attention_bias", False)),
                         o_bias=bool(c.get("attention_bias", False)),
                         layer_types=("sliding" if use_window else "full",) * n)
        else:
            use_window = bool(c.get("use_sliding_window", False))
            if c.get("layer_types") is not None:
                types = _layer_types(c, n, False)
            else:  # transformers' default: odd-numbered layers below max_window_layers slide
                mwl = int(c.get("max_window_layers", n))
                types = tuple("sliding" if (i + 1) % 2 and i < mwl and use_window else "full" for i in range(n))
            shared = int(c.get("shared_expert_intermediate_size") or 0)
            extra = dict(qkv_bias=bool(c.get("qkv_bias", True)), layer_types=types,
                         shared_expert_size=shared, shared_expert_gate=shared > 0)
            use_window = use_window and "sliding" in types
        return ModelConfig(**base, rope=_rope(c, False), moe_layers=moe, moe_intermediate_size=int(moe_size),
                           sliding_window=int(window) if use_window else None,
                           norm_topk_prob=bool(c.get("norm_topk_prob", False)),
                           softmax_scale=base["head_dim"] ** -0.5, **extra)

    if mt == "mixtral":
        return ModelConfig(**base, rope=_rope(c, False), moe_layers=(True,) * n,
                           moe_intermediate_size=int(base["intermediate_size"]),
                           sliding_window=int(window) if window else None,
                           layer_types=("sliding" if window else "full",) * n, norm_topk_prob=True,
                           softmax_scale=base["head_dim"] ** -0.5)

    if mt == "gpt_oss":
        types = _layer_types(c, n, False) if c.get("layer_types") is not None else tuple(
            "sliding" if (i + 1) % 2 else "full" for i in range(n))
        if c.get("rope_parameters") is None and c.get("rope_scaling") is None:
            c = {**c, "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                        "truncate": False, "original_max_position_embeddings": 4096}}
        bias = bool(c.get("attention_bias", True))
        return ModelConfig(**base, rope=_rope(c, False), moe_layers=(True,) * n,
                           moe_intermediate_size=int(base["intermediate_size"]), qkv_bias=bias, o_bias=bias,
                           sinks=True, sliding_window=int(window or 128), layer_types=types,
                           router_bias=True, norm_topk_prob=True, expert_bias=True, expert_act="swiglu_clamp",
                           swiglu_limit=float(c.get("swiglu_limit", 7.0)),
                           swiglu_alpha=float(c.get("swiglu_alpha", 1.702)),
                           softmax_scale=base["head_dim"] ** -0.5)

    # deepseek_v2 / deepseek_v3: MLA attention
    rope = _rope(c, interleaved=True if mt == "deepseek_v2" else bool(c.get("rope_interleave", True)))
    nope, rdim = int(_need(c, "qk_nope_head_dim")), int(_need(c, "qk_rope_head_dim"))
    scale = (nope + rdim) ** -0.5
    if rope.kind != "default" and rope.mscale_all_dim:
        scale *= yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
    first_dense = int(c.get("first_k_dense_replace", 0) or 0)
    freq = int(c.get("moe_layer_freq", 1) or 1)
    moe = tuple(i >= first_dense and i % freq == 0 for i in range(n))
    shared = int(c.get("n_shared_experts") or 0) * int(moe_size)
    scoring = c.get("scoring_func", "softmax" if mt == "deepseek_v2" else "sigmoid")
    if scoring != ("softmax" if mt == "deepseek_v2" else "sigmoid"):
        raise ConfigError(f"config.json: unsupported 'scoring_func' {scoring!r} for {mt}")
    if mt == "deepseek_v2":
        method = c.get("topk_method", "greedy")
        if method not in ("greedy", "group_limited_greedy"):
            raise ConfigError(f"config.json: unsupported 'topk_method' {method!r} for deepseek_v2 "
                              "(supported: greedy, group_limited_greedy)")
        groups = (int(c["n_group"]), int(c["topk_group"])) if method == "group_limited_greedy" else None
        routing: dict[str, Any] = dict(router_scoring="softmax", topk_groups=groups, group_score="max",
                                       norm_topk_prob=False)
    else:
        method = c.get("topk_method", "noaux_tc")
        if method != "noaux_tc":
            raise ConfigError(f"config.json: unsupported 'topk_method' {method!r} for deepseek_v3 "
                              "(supported: noaux_tc)")
        routing = dict(router_scoring="sigmoid", score_correction_bias=True,
                       topk_groups=(int(c.get("n_group") or 1), int(c.get("topk_group") or 1)),
                       group_score="top2_sum", norm_topk_prob=bool(c.get("norm_topk_prob", True)))
    if routing["topk_groups"] and base["num_experts"] % routing["topk_groups"][0]:
        raise ConfigError(f"config.json: 'n_group' {routing['topk_groups'][0]} does not divide "
                          f"{base['num_experts']} experts")
    q_lora = c.get("q_lora_rank")
    return ModelConfig(**{**base, "head_dim": rdim}, rope=rope, attention="mla", softmax_scale=scale,
                       q_lora_rank=int(q_lora) if q_lora else None, kv_lora_rank=int(_need(c, "kv_lora_rank")),
                       qk_nope_head_dim=nope, qk_rope_head_dim=rdim, v_head_dim=int(_need(c, "v_head_dim")),
                       mla_bias=bool(c.get("attention_bias", False)), mlp_bias=bool(c.get("mlp_bias", False)),
                       layer_types=("full",) * n, moe_layers=moe, moe_intermediate_size=int(moe_size),
                       routed_scaling_factor=float(c.get("routed_scaling_factor", 1.0) or 1.0),
                       shared_expert_size=shared, extra_layers=int(c.get("num_nextn_predict_layers") or 0),
                       **routing)
