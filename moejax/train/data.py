"""Token streams for training: the corpus split tokenized once into flat int32 arrays (documents joined by the
end-of-text token) and batches drawn at positions that depend only on (seed, step), so a resumed run reads
exactly the batches an uninterrupted one would."""
from __future__ import annotations

import os

import numpy as np
from tokenizers import Tokenizer

from moejax.train import corpus


def tokenize_files(tok: Tokenizer, root: str, files: list[str], eos_id: int) -> np.ndarray:
    """Every file's tokens followed by the end-of-text token, concatenated."""
    texts = [corpus.read_source(os.path.join(root, f)) for f in files]
    out = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        out.append(np.asarray(enc.ids, np.int32))
        out.append(np.asarray([eos_id], np.int32))
    return np.concatenate(out) if out else np.zeros((0,), np.int32)


def batch_at(tokens: np.ndarray, step: int, batch: int, seq_len: int, seed: int) -> np.ndarray:
    """[batch, seq_len + 1] windows of `tokens` at offsets drawn from (seed, step): inputs are [:, :-1] and
    next-token targets [:, 1:]."""
    if len(tokens) < seq_len + 2:
        raise ValueError(f"the token stream has {len(tokens)} tokens, fewer than one window of {seq_len + 1}")
    starts = np.random.default_rng([seed, step]).integers(0, len(tokens) - seq_len - 1, size=batch)
    return np.stack([tokens[s:s + seq_len + 1] for s in starts])


def eval_windows(tokens: np.ndarray, seq_len: int, max_windows: int | None = None) -> np.ndarray:
    """Consecutive non-overlapping [n, seq_len + 1] windows from the start (each target predicted once)."""
    n = (len(tokens) - 1) // seq_len
    n = n if max_windows is None else min(n, max_windows)
    return np.stack([tokens[i * seq_len:i * seq_len + seq_len + 1] for i in range(n)])
