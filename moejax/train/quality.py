"""Quality of a language model on held-out token streams: perplexity, top-1 next-token accuracy and each MoE
layer's share of routed tokens per expert, through the engine's own forward; and the same two numbers for an
interpolated bigram model fit on training tokens (the floor a trained model must beat)."""
from __future__ import annotations

import ast
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import moejax
from moejax.engine import Engine
from moejax.models.moe import route
from moejax.train.loop import Run
from moejax.train.model import forward_with_router


def _windows(tokens: np.ndarray, window: int) -> np.ndarray:
    """Consecutive [n, window + 1] windows sharing one token at the seams (every target scored once); the tail
    that does not fill a window is dropped."""
    n = (len(tokens) - 1) // window
    if n == 0:
        raise ValueError(f"quality: {len(tokens)} tokens do not fill one window of {window + 1}")
    return np.stack([tokens[i * window:i * window + window + 1] for i in range(n)])


def model_quality(engine: Engine, tokens: np.ndarray, *, window: int = 512, batch: int = 4) -> dict:
    """engine (moejax.Engine, resident on one device) over `tokens` in windows of `window` ->
    {"perplexity", "top1_accuracy", "expert_share": [[share per expert] per MoE layer], "tokens", "window"}."""
    if engine.layer_by_layer or engine.layout is not None:
        raise ValueError("quality: needs a resident one-device engine (no placement or layout options)")
    cfg, graphdef, kernels = engine.config, engine.graphdef, engine.kernels
    moe_layers = [i for i in range(cfg.num_layers) if cfg.is_moe(i)]

    @jax.jit
    def measure(params: nnx.State, rows: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """rows [B, window + 1], valid [B] (padding rows count for nothing) -> (nll sum, correct, counts)."""
        model = nnx.merge(graphdef, params).unstacked()
        inputs, targets = rows[:, :-1], rows[:, 1:]
        logits, router = forward_with_router(model, inputs, kernels)
        logp = jax.nn.log_softmax(logits, axis=-1)
        weight = jnp.broadcast_to(valid[:, None], targets.shape).astype(jnp.float32)
        nll = -jnp.sum(jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0] * weight)
        correct = jnp.sum((jnp.argmax(logits, axis=-1) == targets) * weight)
        counts = []
        for i, router_logits in zip(moe_layers, router, strict=True):
            block = model.layers[i].mlp
            bias = None if block.correction_bias is None else block.correction_bias[...]
            idx, _ = route(cfg, router_logits, bias)
            token_weight = jnp.broadcast_to(weight.reshape(-1, 1), idx.shape)
            counts.append(jnp.bincount(idx.reshape(-1), weights=token_weight.reshape(-1), length=cfg.num_experts))
        return nll, correct, jnp.stack(counts)

    rows = _windows(np.asarray(tokens, np.int32), window)
    nll, correct, counts = 0.0, 0.0, np.zeros((len(moe_layers), cfg.num_experts))
    for start in range(0, len(rows), batch):
        chunk = rows[start:start + batch]
        valid = np.arange(batch) < len(chunk)
        chunk = np.concatenate([chunk, np.repeat(chunk[:1], batch - len(chunk), axis=0)])  # one shape
        out = measure(engine.params, jnp.asarray(chunk), jnp.asarray(valid))
        nll, correct, counts = nll + float(out[0]), correct + float(out[1]), counts + np.asarray(out[2])
    n = rows.shape[0] * window
    return dict(perplexity=float(np.exp(nll / n)), top1_accuracy=correct / n,
                expert_share=(counts / counts.sum(axis=1, keepdims=True)).tolist(), moe_layers=moe_layers,
                tokens=int(n), window=window)


def bigram_quality(train: np.ndarray, held_out: np.ndarray, vocab: int, *, window: int = 512) -> dict:
    """A bigram model P(b|a) = λ·count(a,b)/count(a) + (1-λ)·P_unigram(b) (add-one unigram), fit on `train`,
    scored on the same targets as model_quality; λ is the best of a grid on the held-out tokens themselves, a
    generous floor. -> {"bigram_perplexity", "bigram_top1_accuracy", "bigram_lambda"}."""
    train = np.asarray(train, np.int64)
    pairs = np.bincount(train[:-1] * vocab + train[1:], minlength=vocab * vocab).reshape(vocab, vocab)
    unigram = (np.bincount(train, minlength=vocab) + 1.0) / (len(train) + vocab)
    rows = _windows(np.asarray(held_out, np.int64), window)
    prev, nxt = rows[:, :-1].reshape(-1), rows[:, 1:].reshape(-1)
    from_prev = pairs.sum(axis=1)
    seen = from_prev[prev] > 0
    p_bigram = np.where(seen, pairs[prev, nxt] / np.maximum(from_prev[prev], 1), 0.0)
    best = None
    for lam in np.linspace(0.0, 0.99, 34):
        lam_eff = np.where(seen, lam, 0.0)
        nll = -np.mean(np.log(lam_eff * p_bigram + (1 - lam_eff) * unigram[nxt]))
        if best is None or nll < best[0]:
            best = (nll, float(lam))
    assert best is not None  # 34 values of lambda tried
    # its most likely next token: the most frequent follower (the unigram argmax after an unseen token)
    follower = np.where(from_prev > 0, pairs.argmax(axis=1), unigram.argmax())
    return dict(bigram_perplexity=float(np.exp(best[0])), bigram_top1_accuracy=float(np.mean(follower[prev] == nxt)),
                bigram_lambda=best[1])


GREEDY_PROMPTS = ("for i in range(", "def __init__(self", "import os\nimport ", "if __name__ == ",
                  "class Stack:\n    def push(self, item):\n        ")


def parses(code: str) -> bool:
    """Whether `code` is valid Python, allowing an open block at the end (a body is added after a trailing ':')."""
    for candidate in (code, code.rstrip() + "\n" + " " * 16 + "pass\n"):
        try:
            ast.parse(candidate)
            return True
        except SyntaxError:
            pass
    return False


def greedy_samples(engine: Engine, prompts: Sequence[str] = GREEDY_PROMPTS, *, max_new: int = 24) -> list[dict]:
    """Each prompt's greedy completion up to the first blank line or end of text, and whether prompt + completion
    is valid Python (`parses`)."""
    tok = engine.tokenizer
    assert tok is not None  # a trained run's engine has the run's tokenizer
    outs = engine.generate([tok.encode(p).ids for p in prompts], max_new, stop_token_ids=engine.config.eos_token_ids)
    samples = []
    for prompt, ids in zip(prompts, outs, strict=True):
        text = tok.decode([t for t in ids if t not in engine.config.eos_token_ids]).split("\n\n")[0]
        samples.append(dict(prompt=prompt, completion=text, parses=parses(prompt + text)))
    return samples


def run_quality(checkpoint: str, run: Run) -> dict:
    """The model card's numbers: the exported checkpoint (as served: its own dtype) on the run's held-out split,
    the bigram fit on its training split."""
    engine = moejax.load(checkpoint)
    window = min(run.settings.seq_len, engine.config.max_position_embeddings - 1)
    out = model_quality(engine, run.held_out_tokens, window=window)
    out.update(bigram_quality(run.train_tokens, run.held_out_tokens, engine.config.vocab_size, window=window))
    out["greedy"] = greedy_samples(engine)
    return out
