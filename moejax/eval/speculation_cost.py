"""What speculative execution costs in accuracy: held-out perplexity and top-1 next-token accuracy through any
engine (exact or speculative placements alike), and the best answer of each multiple-choice score request."""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from moejax.engine import Engine
from moejax.requests.parse import ScoreRequest


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def window_quality(engine: Engine, rows: np.ndarray, batch: int = 4) -> dict:
    """rows [n, T + 1] token windows -> {"perplexity", "top1_accuracy"} of predicting rows[:, 1:]."""
    nll, correct, count = 0.0, 0, 0
    for s in range(0, len(rows), batch):
        chunk = np.asarray(rows[s:s + batch])
        logp = _log_softmax(np.asarray(engine.logits(chunk[:, :-1]), np.float64))
        targets = chunk[:, 1:]
        nll -= float(np.take_along_axis(logp, targets[..., None], axis=-1).sum())
        correct += int((logp.argmax(-1) == targets).sum())
        count += targets.size
    return dict(perplexity=float(np.exp(nll / count)), top1_accuracy=correct / count)


def best_answers(engine: Engine, requests: Iterable[ScoreRequest]) -> list[int]:
    """Score requests (moejax.requests.parse.ScoreRequest) -> per (request, context) the index of the candidate
    with the highest summed log-probability."""
    best = []
    for request in requests:
        for context in request.contexts:
            scores = []
            for candidate in request.candidates:
                ids = list(context) + list(candidate.token_ids)
                logp = _log_softmax(np.asarray(engine.logits([ids[:-1]])[0], np.float64))
                n = len(candidate.token_ids)
                scores.append(float(sum(logp[len(context) - 1 + j, t] for j, t in enumerate(candidate.token_ids)))
                              if n else 0.0)
            best.append(int(np.argmax(scores)))
    return best
