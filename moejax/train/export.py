"""A trained run -> a Hugging Face `qwen3_moe` checkpoint directory: config.json, model.safetensors (the hub's
per-expert layout, [out, in] linear weights), tokenizer.json, tokenizer_config.json, generation_config.json, and
a model card (README.md) with the corpus, the run and the quality measured on the held-out split."""
from __future__ import annotations

import json
import os
import platform
import shutil

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from moejax.config import ModelConfig
from moejax.models.families import Experts, source
from moejax.train.loop import Run
from moejax.train.model import LOAD_BALANCE_COEF, Z_LOSS_COEF, TrainModel
from moejax.train.quality import run_quality

_NUMPY_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


def hf_tensors(cfg: ModelConfig, model: TrainModel, params: dict, dtype: str) -> dict[str, np.ndarray]:
    """Flat trained parameters -> {HF tensor name: array} (the inverse of moejax.models.families.source)."""
    to = _NUMPY_DTYPES[dtype]
    out = {}
    for name, value in params.items():
        value = np.asarray(value, np.float32)
        where = source(cfg, model.paths[name])
        if isinstance(where, Experts):
            if where.part == "gate_up":
                inner = value.shape[-1] // 2
                for e in range(value.shape[0]):
                    out[f"{where.prefix}{e}.gate_proj.weight"] = value[e, :, :inner].T
                    out[f"{where.prefix}{e}.up_proj.weight"] = value[e, :, inner:].T
            elif where.part == "down":
                for e in range(value.shape[0]):
                    out[f"{where.prefix}{e}.down_proj.weight"] = value[e].T
            else:
                raise NotImplementedError(f"export: expert tensor part {where.part!r} (qwen3_moe has none)")
        else:
            out[where.key] = value.T if where.transpose else value
    return {k: np.ascontiguousarray(v.astype(to)) for k, v in out.items()}


def export(run: Run, result: dict, target: str, *, dtype: str = "bfloat16", quality: dict | None = None) -> None:
    """Write the checkpoint of `result` (train()'s return) into `target` (replaced if it exists), then measure
    it on the run's held-out split (moejax.train.quality) for the model card unless `quality` is given."""
    if run.cfg.model_type != "qwen3_moe":
        raise NotImplementedError(f"export writes qwen3_moe checkpoints; the run is {run.cfg.model_type}")
    model = TrainModel(run.cfg)
    if os.path.exists(target):
        shutil.rmtree(target)
    os.makedirs(target)
    save_file(hf_tensors(run.cfg, model, result["params"], dtype), os.path.join(target, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(target, "config.json"), "w") as f:
        json.dump(dict(run.hf_config, dtype=dtype), f, indent=1)
    with open(os.path.join(target, "generation_config.json"), "w") as f:
        json.dump(dict(eos_token_id=run.eos_id, pad_token_id=run.eos_id, do_sample=False), f, indent=1)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(run.out, "tokenizer", name), os.path.join(target, name))
    if quality is None:
        quality = run_quality(target, run)
    with open(os.path.join(target, "README.md"), "w") as f:
        f.write(model_card(run, result, quality, dtype))


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    return f"{os.cpu_count()} CPU cores ({cpu}), {platform.system()}"


def model_card(run: Run, result: dict, q: dict, dtype: str) -> str:
    s, c, cfg = run.settings, run.corpus, run.cfg
    params = sum(int(np.prod(v.shape)) for v in result["params"].values())
    ratio = q["perplexity"] / q["bigram_perplexity"]
    shares = np.asarray(q["expert_share"]) * cfg.num_experts  # 1 = the uniform share
    rows = "\n".join(f"| {i} | {row.min():.2f} | {row.max():.2f} | " + " ".join(f"{v:.2f}" for v in row) + " |"
                     for i, row in enumerate(shares))
    greedy = "\n".join(f"- `{g['prompt']!r}` → `{g['completion']!r}` ({'parses' if g['parses'] else 'does not parse'})"
                       for g in q.get("greedy", ()))
    met = lambda ok: "met" if ok else "NOT met"  # noqa: E731
    return f"""# {s.config}: a small Qwen3-MoE trained on Python source

Trained by moejax (`python -m launch.train --config {s.config}`) with its own model code and optax.
Architecture `qwen3_moe`: hidden {cfg.hidden_size}, {cfg.num_layers} layers, {cfg.num_experts} experts top-{
cfg.num_experts_per_tok} (width {cfg.moe_intermediate_size}), {cfg.num_heads} heads / {cfg.num_kv_heads} KV heads of {
cfg.head_dim}, vocabulary {cfg.vocab_size} (byte-level BPE), context {cfg.max_position_embeddings}; {
params:,} parameters,
stored in {dtype}.

## Corpus

The `.py` sources of the Python {c['python']} standard library ({c['files']} files, list sha256 `{c['sha256'][:16]}…`),
split by file: held out when {c['held_out_rule']}. Used: {c['used_held_out_files']} held-out files ({
c['held_out_tokens']:,} tokens) and {c['used_train_files']} training files ({c['train_tokens']:,} tokens).

## Training

{result['step']} steps of {s.batch} windows of {s.seq_len} tokens: {result['tokens_seen']:,} tokens seen
({result['tokens_seen'] / c['train_tokens']:.2f} epochs), {result['wall_s'] / 60:.1f} minutes on {_machine()}.
AdamW (b1 0.9, b2 0.95, weight decay {s.weight_decay}, none on norms), peak learning rate {s.peak_lr} after {
s.warmup_steps} warm-up steps, cosine decay to {s.peak_lr * s.final_lr_ratio:g}, gradient clipping at global norm {
s.clip_norm}; float32. Loss: cross-entropy + {LOAD_BALANCE_COEF} × load balancing + {Z_LOSS_COEF} × router z-loss.

## Quality on the held-out files

Measured with moejax.train.quality (what `python -m launch.bench quality` runs) over {
q['tokens']:,} held-out tokens in windows of {q['window']}:

| | this model | bigram floor |
|---|---|---|
| cross-entropy (nats per token) | {np.log(q['perplexity']):.3f} | {np.log(q['bigram_perplexity']):.3f} |
| perplexity | {q['perplexity']:.2f} | {q['bigram_perplexity']:.2f} |
| top-1 next-token accuracy | {q['top1_accuracy']:.3f} | {q['bigram_top1_accuracy']:.3f} |

- Perplexity ≤ half the bigram's: {met(ratio <= 0.5)} (ratio {ratio:.3f}).
- Every expert of every layer between 0.25× and 4× the uniform share of routed tokens: {met(
        0.25 <= shares.min() and shares.max() <= 4)} (min {shares.min():.2f}×, max {shares.max():.2f}×).

Greedy completions (up to the first blank line; "parses": prompt + completion is valid Python, an open
block at the end allowed): {sum(g['parses'] for g in q.get('greedy', ()))} of {len(q.get('greedy', ()))} parse.

{greedy}

Expert load per MoE layer (share of routed tokens ÷ uniform share):

| layer | min | max | experts 0..{cfg.num_experts - 1} |
|---|---|---|---|
{rows}
"""
