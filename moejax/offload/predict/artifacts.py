"""Predictor files checked at load, before any request: that a directory holds the kind of artifact its option
takes (default vectors, expert maps, an estimator) and that the artifact was made for this model's shape (layers,
routed experts, hidden size). Each error is one line naming the option (field and flag) and the mismatch."""
from __future__ import annotations

import os

import numpy as np

from moejax.config import ModelConfig

# the arrays each kind's directory holds, and the option (PlacementSettings field, launch.serve flag) that takes it
KINDS = {"default vectors": (frozenset({"vectors", "counts"}), "default_vectors (--default-vectors)"),
         "expert maps": (frozenset({"embeddings", "maps", "settings"}), "maps (--maps)")}
ESTIMATOR = "estimator (--estimator)"


def kind_of(path: str, keys: frozenset[str] | None = None) -> str:
    """What a predictor directory holds, in words (for an error when it is not what was asked for)."""
    if os.path.isfile(os.path.join(path, "estimator.json")):
        return f"an estimator (the directory {ESTIMATOR} takes)"
    for name, (arrays, option) in KINDS.items():
        if keys == arrays:
            return f"{name} (the directory {option} takes)"
    return f"arrays {sorted(keys)}" if keys else "no predictor file"


def expect_kind(tree: dict, path: str, kind: str) -> None:
    """ValueError unless the arrays read from `path` are `kind`'s (KINDS)."""
    arrays, option = KINDS[kind]
    keys = frozenset(tree)
    if keys != arrays:
        raise ValueError(f"{option} {path}: holds {kind_of(path, keys)}, not {kind}")


def _mismatch(option: str, made: dict[str, int], cfg: ModelConfig) -> str | None:
    """made: the artifact's sizes by what they count; None when each equals the model's."""
    model = {"layers": cfg.num_layers, "routed experts": cfg.num_experts, "hidden size": cfg.hidden_size,
             "MoE layers": sum(cfg.is_moe(i) for i in range(cfg.num_layers))}
    wrong = [f"{what} {n} (the model has {model[what]})" for what, n in made.items() if n != model[what]]
    if not wrong:
        return None
    return (f"{option}: made for another model: {', '.join(wrong)}; the model is {cfg.model_type} "
            f"with {cfg.num_layers} layers, {cfg.num_experts} routed experts, hidden size {cfg.hidden_size}")


def check_vectors(vectors: np.ndarray, cfg: ModelConfig, option: str) -> None:
    """Default vectors [L, E, D] against the model."""
    L, E, D = vectors.shape
    problem = _mismatch(option, {"layers": L, "routed experts": E, "hidden size": D}, cfg)
    if problem:
        raise ValueError(problem)


def check_maps(embeddings: np.ndarray, maps: np.ndarray, cfg: ModelConfig, option: str) -> None:
    """An expert-map store (embeddings [n, D], maps [n, MoE layers, E]) against the model."""
    problem = _mismatch(option, {"MoE layers": maps.shape[1], "routed experts": maps.shape[2],
                                 "hidden size": embeddings.shape[1]}, cfg)
    if problem:
        raise ValueError(problem)


def check_estimator(hidden: int, experts: int, vectors: np.ndarray, cfg: ModelConfig, option: str) -> None:
    """An estimator's shape (its input width and output logits) and its default vectors against the model."""
    problem = _mismatch(option, {"hidden size": hidden, "routed experts": experts}, cfg)
    if problem:
        raise ValueError(problem)
    check_vectors(vectors, cfg, f"{option}'s default vectors")
