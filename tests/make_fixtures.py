#!/usr/bin/env python
"""Write tiny random Hugging Face MoE checkpoints + reference outputs for moejax tests.

Dev-only: needs torch, transformers (5.23) and tokenizers; moejax itself never imports them.

    python tests/make_fixtures.py              # all fixtures
    python tests/make_fixtures.py --only gpt_oss --only mixtral
    python tests/make_fixtures.py --embedded   # the shipped model's reference (after python -m launch.train)
    python tests/make_fixtures.py --deep       # the deep variants (tests/fixtures_deep/): runs of unlike layers

Each ``tests/fixtures/<name>/`` holds what ``save_pretrained`` writes plus ``reference.npz``:
  input_ids (2,16) int32, logits (2,16,V) float32 (eager fp32 full causal forward),
  prompt_{0,1,2} int32 (lengths 5, 11, 3), greedy_{0,1,2} int32 (8 tokens each, computed by a
  manual no-cache loop; every step's top-1 logit beats top-2 by >= 1e-3, no token is an eos id,
  and each continuation has >= 3 distinct tokens).
"""

import argparse
import dataclasses
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import transformers as tf
from safetensors import safe_open

OUT_DIR = Path(__file__).resolve().parent / "fixtures"
MAX_POS = 256
BATCH, SEQ = 2, 16
PROMPT_LENS = (5, 11, 3)
NEW_TOKENS = 8
MARGIN = 1e-3
W_STD, BIAS_STD, NORM_STD, SINK_STD, E_BIAS_STD = 0.15, 0.2, 0.1, 1.0, 0.15

YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
            beta_fast=32.0, beta_slow=1.0)


@dataclasses.dataclass
class Fixture:
    config: tf.PreTrainedConfig
    max_shard_size: int | None = None  # bytes; set => sharded save with an index json
    tokenizer: bool = False
    checks: tuple[Callable, ...] = ()


# ----------------------------------------------------------------------------- diagnostics
def _logit_diff(model, ids, mutate):
    """Max |logits| change when `mutate(model)` is applied (it returns an undo callable)."""
    with torch.no_grad():
        base = model(input_ids=ids).logits
        undo = mutate(model)
        alt = model(input_ids=ids).logits
        undo()
    return (base - alt).abs().max().item()


def check_sliding(model, ids):
    """Prove the sliding window is applied by the eager path: removing it changes logits."""
    def mutate(m):
        old = m.config.sliding_window
        m.config.sliding_window = 10**6
        return lambda: setattr(m.config, "sliding_window", old)
    d = _logit_diff(model, ids, mutate)
    print(f"  sliding_window={model.config.sliding_window}: max|dlogits| if window removed = {d:.3g}")
    assert d > 1e-3, "sliding window has no effect"


def _first_router(model):
    return next(m for m in model.modules() if type(m).__name__.lower().endswith("topkrouter"))


def _routes(model, ids, mutate=None):
    """Sorted top-k expert ids (tokens, k) chosen by the first MoE layer, optionally under `mutate(router)`."""
    router, got = _first_router(model), []
    hook = router.register_forward_hook(lambda mod, inp, out: got.append(out[2].sort(-1).values))
    undo = mutate(router) if mutate else (lambda: None)
    with torch.no_grad():
        model(input_ids=ids)
    undo()
    hook.remove()
    return got[0]


def _selection_change(model, ids, mutate):
    """Fraction of tokens whose top-k expert set changes in the first MoE layer under `mutate`."""
    return (_routes(model, ids) != _routes(model, ids, mutate)).any(-1).float().mean().item()


def check_routing(model, ids):
    """Routing must be non-trivial: many experts hit and many distinct top-k sets."""
    sel = _routes(model, ids)
    n_exp, n_sets = sel.unique().numel(), len({tuple(r) for r in sel.tolist()})
    print(f"  routing (first MoE layer, {len(sel)} tokens): {n_exp} experts hit, {n_sets} distinct top-k sets")
    assert n_exp >= 4 and n_sets >= 4


def check_score_bias(model, ids):
    def mutate(r):
        old = r.e_score_correction_bias.clone()
        r.e_score_correction_bias.zero_()
        return lambda: r.e_score_correction_bias.copy_(old)
    f = _selection_change(model, ids, mutate)
    print(f"  e_score_correction_bias: changes expert selection for {f:.0%} of tokens (first MoE layer)")
    assert f > 0.1


def check_group_limit(model, ids):
    def mutate(r):  # allow every group => plain (bias-corrected) top-k
        old, r.topk_group = r.topk_group, r.num_group
        return lambda: setattr(r, "topk_group", old)
    f = _selection_change(model, ids, mutate)
    print(f"  group-limited routing: changes expert selection for {f:.0%} of tokens (first MoE layer)")
    assert f > 0.05


def check_swiglu_clamp(model, ids):
    """gpt_oss: report how often the gate (upper) / up (both sides) clamps bind; gate/up interleaved."""
    cls, seen = type(next(m for m in model.modules() if type(m).__name__ == "GptOssExperts")), []
    orig = cls._apply_gate
    cls._apply_gate = lambda self, gate_up: (seen.append(gate_up), orig(self, gate_up))[1]
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        cls._apply_gate = orig
    x, lim = torch.cat(seen), model.config.swiglu_limit
    g, u = (x[..., ::2] > lim).float().mean(), (x[..., 1::2].abs() > lim).float().mean()
    print(f"  swiglu_limit={lim}: |pre-act| mean {x.abs().mean():.2f}; "
          f"clamped: gate(>lim) {g:.0%}, up(|.|>lim) {u:.0%}")
    assert g > 0.1 and u > 0.1


# ----------------------------------------------------------------------------- configs
def common(**kw):
    return dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_POS,
                vocab_size=128, rms_norm_eps=1e-6) | kw


def qwen3_moe():
    # mlp_only_layers=[1] => layer 1 dense, layers 0 and 2 sparse. head_dim*heads (64) != hidden (32).
    cfg = tf.Qwen3MoeConfig(**common(vocab_size=256), head_dim=16, num_hidden_layers=3, intermediate_size=64,
                            moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                            mlp_only_layers=[1], decoder_sparse_step=1, eos_token_id=0)
    return Fixture(cfg, tokenizer=True)


def qwen3_moe_nonorm():
    # decoder_sparse_step=2: layer i is sparse iff (i+1) % 2 == 0 => layers 1, 3 sparse; 0, 2 dense.
    cfg = tf.Qwen3MoeConfig(**common(), head_dim=8, num_hidden_layers=4, intermediate_size=48,
                            moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                            decoder_sparse_step=2, rope_parameters=dict(rope_type="default", rope_theta=1e6))
    return Fixture(cfg, max_shard_size=60_000)


def mixtral():
    cfg = tf.MixtralConfig(**common(), head_dim=8, num_hidden_layers=2, intermediate_size=24, num_local_experts=4,
                           num_experts_per_tok=2, sliding_window=6)
    return Fixture(cfg, checks=(check_sliding,))


def qwen2_moe():
    # qkv biases (no o bias), shared expert gated by sigmoid(shared_expert_gate(x)); layer 2 dense.
    cfg = tf.Qwen2MoeConfig(**common(), num_hidden_layers=3, intermediate_size=48, moe_intermediate_size=16,
                            shared_expert_intermediate_size=24, num_experts=8, num_experts_per_tok=2,
                            norm_topk_prob=False, mlp_only_layers=[2], qkv_bias=True)
    return Fixture(cfg)


def _mla(**kw):
    return common(num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                  intermediate_size=48) | kw


def deepseek_v2_lite():
    # Layer 0 dense, 1-2 MoE. yarn mscale == mscale_all_dim (as in V2-Lite) => cos/sin factor 1.
    cfg = tf.DeepseekV2Config(**_mla(), num_hidden_layers=3, q_lora_rank=None, kv_lora_rank=16,
                              qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, topk_method="greedy",
                              first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=1.0,
                              norm_topk_prob=False,
                              rope_parameters=dict(YARN, mscale=0.707, mscale_all_dim=0.707))
    return Fixture(cfg)


def deepseek_v2_group():
    # All layers MoE. HF V2 ignores norm_topk_prob (always weight*routed_scaling_factor); keep False.
    # top_k=3 > topk_group: with max-per-group scoring and top_k <= topk_group the group limit is a no-op.
    cfg = tf.DeepseekV2Config(**_mla(num_experts_per_tok=3), num_hidden_layers=2, q_lora_rank=24, kv_lora_rank=12,
                              qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                              topk_method="group_limited_greedy", n_group=4, topk_group=2, first_k_dense_replace=0,
                              n_shared_experts=2, routed_scaling_factor=1.5, norm_topk_prob=False)
    return Fixture(cfg, checks=(check_group_limit,))


def deepseek_v3():
    # Layer 0 dense, 1-2 MoE. mscale != mscale_all_dim so the yarn cos/sin attention factor is != 1.
    cfg = tf.DeepseekV3Config(**_mla(), num_hidden_layers=3, q_lora_rank=24, kv_lora_rank=16,
                              qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, n_group=4, topk_group=2,
                              norm_topk_prob=True, routed_scaling_factor=2.5, first_k_dense_replace=1,
                              n_shared_experts=1, rope_parameters=dict(YARN, mscale=1.0, mscale_all_dim=0.8))
    return Fixture(cfg, checks=(check_score_bias, check_group_limit))


def deepseek_v3_nonorm():
    cfg = tf.DeepseekV3Config(**_mla(), num_hidden_layers=2, q_lora_rank=None, kv_lora_rank=12,
                              qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, n_group=2, topk_group=1,
                              norm_topk_prob=False, routed_scaling_factor=2.5, first_k_dense_replace=1,
                              n_shared_experts=1, rope_parameters=dict(rope_type="default", rope_theta=10000.0))
    return Fixture(cfg, checks=(check_score_bias,))


def gpt_oss():
    cfg = tf.GptOssConfig(**common(), head_dim=16, num_hidden_layers=3, intermediate_size=16, num_local_experts=8,
                          num_experts_per_tok=2, sliding_window=5, swiglu_limit=0.5, attention_bias=True,
                          layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                          rope_parameters=dict(YARN, rope_theta=150000.0, factor=8.0,
                                                          original_max_position_embeddings=32, truncate=False))
    return Fixture(cfg, checks=(check_sliding, check_swiglu_clamp))


FIXTURES = {f.__name__: f for f in (qwen3_moe, qwen3_moe_nonorm, mixtral, qwen2_moe, deepseek_v2_lite,
                                      deepseek_v2_group, deepseek_v3, deepseek_v3_nonorm, gpt_oss)}

# Deep variants, one per family: deeper, with runs of unlike layers, so that a model whose like layers run as one
# scan (moejax.models.layer_runs) is checked where its runs begin and end and where a period of two alternates.
DEEP_DIR = OUT_DIR.parent / "fixtures_deep"
_SF = ["sliding_attention", "full_attention"]
DEEP = {
    "qwen3_moe": dict(num_hidden_layers=9, mlp_only_layers=[0, 4]),  # dense, 3 MoE, dense, 4 MoE
    "qwen2_moe": dict(num_hidden_layers=7, mlp_only_layers=[3]),  # 3 MoE, dense, 3 MoE
    "mixtral": dict(num_hidden_layers=6),  # one run of 6
    "deepseek_v2_lite": dict(num_hidden_layers=6, first_k_dense_replace=2),  # 2 dense, 4 MoE
    "deepseek_v3": dict(num_hidden_layers=6, first_k_dense_replace=2),  # 2 dense, 4 MoE
    "gpt_oss": dict(num_hidden_layers=7, layer_types=_SF * 3 + _SF[:1]),  # (sliding, full) x 3, sliding
}


def deep_fixture(name):
    """FIXTURES[name] with DEEP[name]'s config changes (per-layer tables it does not give are derived anew)."""
    fx = FIXTURES[name]()
    fields = fx.config.to_dict() | DEEP[name]
    if "layer_types" not in DEEP[name]:
        fields.pop("layer_types", None)
    return dataclasses.replace(fx, config=type(fx.config)(**fields))


# ----------------------------------------------------------------------------- weights + references
def randomize(model, seed):
    """Overwrite every state_dict entry (params + persistent buffers; not rotary inv_freq)."""
    gen = torch.Generator().manual_seed(seed)
    rules = {}
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    for name in model.state_dict():
        t = tensors[name]
        if name.endswith("e_score_correction_bias"):
            rule, mean, std = "score_bias", 0.0, E_BIAS_STD
        elif name.endswith("sinks"):
            rule, mean, std = "sinks", 0.0, SINK_STD
        elif "norm" in name and t.ndim == 1:
            rule, mean, std = "norm", 1.0, NORM_STD
        elif name.endswith("bias"):
            rule, mean, std = "bias", 0.0, BIAS_STD
        else:
            rule, mean, std = "matrix", 0.0, W_STD
        with torch.no_grad():
            t.copy_(mean + std * torch.randn(t.shape, generator=gen))
        assert not torch.all(t == 0) and not torch.all(t == 1), name
        rules.setdefault(rule, set()).add(re.sub(r"layers\.\d+\.", "layers.*.", name))
    return rules


def build(fx, seed):
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(fx.config, attn_implementation="eager",
                                                experts_implementation="eager", dtype=torch.float32)
    return model, randomize(model.eval(), seed)


@torch.no_grad()
def make_reference(model, seed):
    """Reference dict, or None if a greedy step is tie-sensitive, emits an eos id, or is degenerate."""
    vocab, rng = model.config.vocab_size, np.random.default_rng(seed)
    eos = model.config.eos_token_id
    eos = set([eos] if isinstance(eos, int) else eos or [])
    ref = {"input_ids": rng.integers(0, vocab, (BATCH, SEQ), dtype=np.int32)}
    ref["logits"] = model(input_ids=torch.from_numpy(ref["input_ids"]).long()).logits.float().numpy()
    for i, n in enumerate(PROMPT_LENS):
        seq = rng.integers(0, vocab, n).tolist()
        ref[f"prompt_{i}"] = np.array(seq, np.int32)
        for _ in range(NEW_TOKENS):
            top2 = model(input_ids=torch.tensor([seq])).logits[0, -1].topk(2)
            if top2.values[0] - top2.values[1] < MARGIN or top2.indices[0].item() in eos:
                return None
            seq.append(top2.indices[0].item())
        if len(set(seq[n:])) < 3:  # e.g. one token repeated 8 times: too weak a test
            return None
        ref[f"greedy_{i}"] = np.array(seq[n:], np.int32)
    return ref


def make_tokenizer(vocab_size, path):
    """Tiny byte-level BPE trained on made-up English; vocab exactly `vocab_size` incl. <|endoftext|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    words = ("the a small quiet river robot lantern moves across under over bright green purple garden "
             "machine sings slowly quickly tiny engine of and with every morning night forest stone bridge "
             "clever fox reads writes builds paints old new map towards village expert mixture router token "
             "seven blue clouds drift softly while children laugh near warm bakery windows").split()
    rng = np.random.default_rng(0)
    text = []
    for _ in range(60):
        s = " ".join(rng.choice(words, rng.integers(4, 10)))
        text.append(s[0].upper() + s[1:] + rng.choice([".", "!", "?", ","]))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([" ".join(text)] * 4, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False))
    assert tok.get_vocab_size() == vocab_size and tok.token_to_id("<|endoftext|>") == 0, tok.get_vocab_size()
    tok.save(str(path))
    print(f"  tokenizer.json: vocab {vocab_size}, '<|endoftext|>'=0, "
          f"'The clever fox.' -> {tok.encode('The clever fox.').ids}")


# ----------------------------------------------------------------------------- writer
def describe_safetensors(d):
    shapes = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            shapes |= {k: tuple(st.get_slice(k).get_shape()) for k in st.keys()}
    collapsed = {}
    for k, s in shapes.items():
        if not re.match(r"model\.layers\.[01]\.", k) and "layers." in k:
            continue
        collapsed.setdefault((re.sub(r"experts\.\d+\.", "experts.<e>.", k), s), []).append(k)
    for (k, s), ks in sorted(collapsed.items()):
        print(f"    {k:60s} {list(s)}" + (f"  x{len(ks)}" if len(ks) > 1 else ""))


def write_fixture(name, deep=False):
    fx = deep_fixture(name) if deep else FIXTURES[name]()
    d = (DEEP_DIR if deep else OUT_DIR) / name
    shutil.rmtree(d, ignore_errors=True)
    for seed in range(1000, 1100):
        model, rules = build(fx, seed)
        ref = make_reference(model, seed)
        if ref is not None:
            break
        print(f"  seed {seed}: greedy reference tie-sensitive / eos / degenerate, retrying")
    print(f"== {name} ({type(model).__name__}, seed {seed})")
    for rule, names in rules.items():
        print(f"  randomized [{rule}]: {', '.join(sorted(names))}")
    save_kw = {"max_shard_size": fx.max_shard_size} if fx.max_shard_size else {}
    model.save_pretrained(d, **save_kw)
    np.savez(d / "reference.npz", **ref)
    if fx.tokenizer:
        make_tokenizer(fx.config.vocab_size, d / "tokenizer.json")

    # Round trip: reload from disk and check the reference is reproduced.
    reloaded = tf.AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager",
                                                       experts_implementation="eager", dtype=torch.float32).eval()
    ids = torch.from_numpy(ref["input_ids"]).long()
    with torch.no_grad():
        err = np.abs(reloaded(input_ids=ids).logits.numpy() - ref["logits"]).max()
    assert err < 1e-5, f"reload mismatch {err}"
    for check in (check_routing, *fx.checks):
        check(reloaded, ids)

    dense = [i for i, layer in enumerate(reloaded.model.layers)
             if not any("experts" in n for n, _ in layer.mlp.named_parameters())]
    lg = ref["logits"]
    print(f"  layers={reloaded.config.num_hidden_layers} dense={dense}; logits std {lg.std():.2f}, "
          f"reload err {err:.1e}; greedy_0={ref['greedy_0'].tolist()}")
    print(f"  config.json keys: {sorted(reloaded.config.to_diff_dict())}")
    print("  on-disk tensors (layers 0/1 + globals):")
    describe_safetensors(d)
    size = sum(f.stat().st_size for f in d.iterdir())
    print(f"  files: {sorted(f.name for f in d.iterdir())}; {size / 1e3:.1f} kB")
    return size


# A chat template in the style of Qwen's ChatML, in words this fixture's tiny vocabulary can spell (it has no
# newline and no '<|im_start|>'): role headers, the end-of-text token after each turn, a refused role, a
# template variable (enable_thinking, as Qwen3's), and indented tags so trim_blocks / lstrip_blocks matter.
CHAT_TEMPLATE = """{%- for message in messages %}
    {%- if message['role'] not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('Unknown role: ' + message['role']) }}
    {%- endif %}
    {% if loop.first and message['role'] != 'system' %}
The robot reads.
    {% endif %}
{{ message['role'] | capitalize }} writes {{ message['content'] | trim }}{{ eos_token }}
{% endfor %}
{% if add_generation_prompt %}
Assistant writes{% if enable_thinking is defined and not enable_thinking %} quickly{% endif %}
{% endif %}"""

# (OpenAI messages as a batch line sends them, template kwargs). Text parts are joined with a newline (vLLM's
# default content format) before transformers renders them, as moejax.chat does.
CHAT_CASES = [
    ([{"role": "user", "content": "The clever fox reads a map."}], {}),
    ([{"role": "system", "content": "Every robot sings."}, {"role": "user", "content": "  the old bridge  "},
      {"role": "assistant", "content": "Seven blue clouds."}, {"role": "user", "content": "And the river?"}], {}),
    ([{"role": "user", "content": [{"type": "text", "text": "Green garden"}, {"type": "text", "text": "lantern"}]}],
     {}),
    ([{"role": "user", "content": "The tiny engine."}], {"enable_thinking": False}),
    ([{"role": "tool", "content": "stone"}], {}),
]


def write_chat(name="qwen3_moe"):
    """tokenizer_config.json with CHAT_TEMPLATE, and chat_reference.json: each case rendered and tokenized by
    transformers' apply_chat_template (or its error)."""
    import json
    d = OUT_DIR / name
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
              "pad_token": "<|endoftext|>", "model_max_length": MAX_POS, "chat_template": CHAT_TEMPLATE}
    (d / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    tok = tf.AutoTokenizer.from_pretrained(d)
    cases = []
    for messages, kwargs in CHAT_CASES:
        plain = [{**m, "content": "\n".join(p["text"] for p in m["content"]) if isinstance(m["content"], list)
                  else m["content"]} for m in messages]
        case = {"messages": messages, "chat_template_kwargs": kwargs}
        try:
            case["text"] = tok.apply_chat_template(plain, add_generation_prompt=True, tokenize=False, **kwargs)
            ids = tok.apply_chat_template(plain, add_generation_prompt=True, tokenize=True, **kwargs)
            case["token_ids"] = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        except Exception as e:  # jinja2.TemplateError from raise_exception
            case["error"] = f"{type(e).__name__}: {e}"
        cases.append(case)
    reference = {"transformers": tf.__version__, "cases": cases}
    (d / "chat_reference.json").write_text(json.dumps(reference, indent=1) + "\n")
    print(f"== {name}: chat template and {len(cases)} reference renderings (transformers {tf.__version__})")


EMBEDDED_DIR = Path(__file__).resolve().parent.parent / "moejax" / "assets" / "pycode-moe"
EMBEDDED_PROMPTS = ("for i in range(", "def __init__(self", "import os\nimport sys\n\n\ndef main():\n    ")
TOKENIZER_STRINGS = ("def f(x):\n    return x + 1\n", "naïve café ☃ — ünïcode\t'\\x00'", "    # comment\r\n",
                     "<|endoftext|>class A:", "", "x" * 300)
LAST_POSITIONS = 4


def write_embedded_reference():
    """The shipped model (moejax/assets/pycode-moe) through transformers in float32: each prompt's token ids as
    AutoTokenizer gives them and its logits at the last LAST_POSITIONS positions; AutoTokenizer's ids for
    TOKENIZER_STRINGS. Rerun whenever the shipped model changes."""
    tok = tf.AutoTokenizer.from_pretrained(EMBEDDED_DIR)
    model = tf.AutoModelForCausalLM.from_pretrained(EMBEDDED_DIR, dtype=torch.float32,
                                                    attn_implementation="eager").eval()
    out = dict(prompts=np.array(EMBEDDED_PROMPTS), tokenizer_strings=np.array(TOKENIZER_STRINGS))
    for i, prompt in enumerate(EMBEDDED_PROMPTS):
        ids = tok(prompt)["input_ids"]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0, -LAST_POSITIONS:].float().numpy()
        out[f"ids_{i}"], out[f"logits_{i}"] = np.array(ids, np.int32), logits
    for j, text in enumerate(TOKENIZER_STRINGS):
        out[f"tokenizer_ids_{j}"] = np.array(tok(text)["input_ids"], np.int32)
    path = OUT_DIR / "pycode_moe_reference.npz"
    np.savez_compressed(path, **out)
    print(f"{path}: {path.stat().st_size / 1e3:.0f} kB (transformers {tf.__version__})")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", choices=sorted(FIXTURES), help="fixture name (repeatable)")
    ap.add_argument("--deep", action="store_true", help="write the deep variants (DEEP) instead")
    ap.add_argument("--chat", action="store_true", help="only (re)write qwen3_moe's chat template and reference")
    ap.add_argument("--embedded", action="store_true",
                    help="only (re)write the shipped model's transformers reference (pycode_moe_reference.npz)")
    args = ap.parse_args()
    tf.logging.set_verbosity_error()
    tf.utils.logging.disable_progress_bar()
    if args.embedded:
        return write_embedded_reference()
    if args.chat:
        return write_chat()
    if args.deep:
        names = [n for n in args.only or DEEP if n in DEEP]
        total = sum(write_fixture(n, deep=True) for n in names)
        print(f"total: {total / 1e6:.2f} MB in {len(names)} deep fixture(s)")
        return
    names = args.only or list(FIXTURES)
    total = sum(write_fixture(n) for n in names)
    if "qwen3_moe" in names:
        write_chat()
    print(f"total: {total / 1e6:.2f} MB in {len(names)} fixture(s)")


if __name__ == "__main__":
    main()
