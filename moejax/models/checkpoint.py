"""Hugging Face checkpoint directory -> model parameters, one tensor at a time.

A directory holds `config.json` and `model.safetensors`, or shards plus `model.safetensors.index.json`.
Every parameter is checked against the checkpoint's metadata first (missing, mis-shaped and unexpected
tensors are reported together in one error); then tensors are read one by one, converted, and handed to
`put` so host memory holds at most one parameter at a time beyond what `put` keeps.
"""
from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Callable, Container, Iterable
from typing import Any

import numpy as np
from safetensors import safe_open
from tokenizers import Tokenizer

from moejax.config import ModelConfig
from moejax.models.families import NON_PARAMETERS, Experts, Tensor, normalize_key, source


class CheckpointError(ValueError):
    """A checkpoint that does not match its config; the message lists every problem found."""


def read_generation_eos(path: str) -> tuple[int, ...]:
    """End-of-sequence ids of `generation_config.json` (what transformers' generate stops at), or () when the file
    or the field is absent."""
    gen_path = os.path.join(path, "generation_config.json")
    if not os.path.isfile(gen_path):
        return ()
    try:
        with open(gen_path) as f:
            eos = json.load(f).get("eos_token_id")
    except (json.JSONDecodeError, AttributeError) as e:
        raise CheckpointError(f"{gen_path}: not a JSON object ({e})") from None
    ids = [] if eos is None else eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise CheckpointError(f"{gen_path}: eos_token_id must be a token id or a list of them; got {eos!r}")
    return tuple(ids)


def read_config(path: str) -> dict[str, Any]:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise CheckpointError(f"{path}: no config.json (is this a Hugging Face checkpoint directory?)")
    try:
        with open(cfg_path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_path}: not valid JSON ({e})") from None


class SafetensorsDir:
    """Lazy view of all tensors in a directory: names, shapes and on-demand reads."""

    def __init__(self, path: str):
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise CheckpointError(f"{path}: no *.safetensors files")
        self._file_of: dict[str, str] = {}
        self._shape: dict[str, tuple[int, ...]] = {}
        self._dtype: dict[str, str] = {}
        for name in files:
            full = os.path.join(path, name)
            if not os.path.isfile(full):
                raise CheckpointError(f"{path}: shard {name} listed in model.safetensors.index.json is missing")
            with safe_open(full, framework="np") as f:
                for key in f.keys():
                    sl = f.get_slice(key)
                    self._file_of[key], self._shape[key], self._dtype[key] = full, tuple(sl.get_shape()), sl.get_dtype()
        self._open: dict[str, Any] = {}

    def keys(self) -> Iterable[str]:
        return self._file_of.keys()

    def shape(self, key: str) -> tuple[int, ...]:
        return self._shape[key]

    def get(self, key: str) -> np.ndarray:
        path = self._file_of[key]
        if path not in self._open:
            self._open[path] = safe_open(path, framework="np")
        return self._open[path].get_tensor(key)


def _expert_pieces(src: Experts, target: tuple[int, ...], keys: Container[str]
                   ) -> list[tuple[str, tuple[int, ...]]]:
    """The HF tensors (key, expected shape) that make one [E, ...] expert parameter."""
    E = target[0]
    fused = {"gate_up": "gate_up_proj", "down": "down_proj", "gate_up_bias": "gate_up_proj_bias",
             "down_bias": "down_proj_bias"}[src.part]
    if src.prefix + fused in keys or src.interleaved:
        if src.part in ("gate_up", "down") and not src.interleaved:
            return [(src.prefix + fused, (E, target[2], target[1]))]
        return [(src.prefix + fused, target)]
    names = {"gate_up": ["gate_proj.weight", "up_proj.weight"], "down": ["down_proj.weight"],
             "gate_up_bias": ["gate_proj.bias", "up_proj.bias"], "down_bias": ["down_proj.bias"]}[src.part]
    shape: tuple[int, ...]
    if src.part == "gate_up":
        shape = (target[2] // 2, target[1])
    elif src.part == "down":
        shape = (target[2], target[1])
    else:
        shape = (target[1] // len(names),)
    return [(f"{src.prefix}{e}.{n}", shape) for e in range(E) for n in names]


def _assemble(src: Experts, pieces: list[tuple[str, tuple[int, ...]]], target: tuple[int, ...],
              read: Callable[[str], np.ndarray]) -> np.ndarray:
    if len(pieces) == 1:  # fused
        x = read(pieces[0][0])
        if src.interleaved and src.part in ("gate_up", "gate_up_bias"):
            return np.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
        return x if src.interleaved or src.part.endswith("bias") else np.swapaxes(x, 1, 2)
    per = len(pieces) // target[0]
    out = None
    for e in range(target[0]):
        parts = [read(k) for k, _ in pieces[e * per:(e + 1) * per]]
        row = np.concatenate(parts, axis=0)
        row = row.T if row.ndim == 2 else row
        if out is None:
            out = np.empty(target, row.dtype)
        out[e] = row
    assert out is not None  # target[0] >= 1 experts
    return out


def checkpoint_reader(path: str, cfg: ModelConfig, targets: dict[tuple, Any], *, ignore_layers_from: int | None = None
                ) -> Callable[[Callable[[tuple, np.ndarray], Any]], dict[tuple, Any]]:
    """Check the checkpoint against `targets` from metadata alone (raising one CheckpointError that
    lists every problem) and return the reader: put -> {path: put(path, array)}.

    `ignore_layers_from`: layers at or beyond this index in the file are expected and skipped, with a
    warning that counts them (a slice of a deeper checkpoint; DeepSeek-V3's multi-token-prediction layers)."""
    st = SafetensorsDir(path)
    by_norm = {normalize_key(cfg, k): k for k in st.keys()}
    missing, misshaped, reads = [], [], {}
    for tpath, abstract in targets.items():
        src = source(cfg, tpath)
        target = tuple(abstract.shape)
        if isinstance(src, Tensor):
            want = tuple(reversed(target)) if src.transpose else target
            pieces = [(src.key, want)]
        else:
            pieces = _expert_pieces(src, target, by_norm)
        for key, want in pieces:
            if key not in by_norm:
                missing.append(key)
            elif tuple(st.shape(by_norm[key])) != want:
                misshaped.append(f"{by_norm[key]}: shape {list(st.shape(by_norm[key]))}, expected {list(want)}")
        reads[tpath] = (src, pieces)
    used = {k for _, pieces in reads.values() for k, _ in pieces}
    skip_layer = re.compile(r"model\.layers\.(\d+)\.")
    unexpected, skipped = [], 0
    for norm, orig in by_norm.items():
        if norm in used or NON_PARAMETERS.search(norm):
            continue
        m = skip_layer.match(norm)
        if m and ignore_layers_from is not None and int(m.group(1)) >= ignore_layers_from:
            skipped += 1
            continue
        unexpected.append(orig)
    if skipped:
        warnings.warn(f"{path}: skipped {skipped} tensors of layers >= {ignore_layers_from} "
                      "(beyond the layers this model runs)", stacklevel=3)
    if missing or misshaped or unexpected:
        lines = [f"checkpoint {path} does not match its config ({cfg.model_type}, {cfg.num_layers} layers):"]
        for title, items in (("missing", missing), ("mis-shaped", misshaped), ("unexpected", unexpected)):
            if items:
                lines.append(f"  {len(items)} {title} tensor(s):")
                lines += [f"    {x}" for x in sorted(items)]
        raise CheckpointError("\n".join(lines))

    def read(key: str) -> np.ndarray:
        return st.get(by_norm[key])

    def read_all(put: Callable[[tuple, np.ndarray], Any]) -> dict[tuple, Any]:
        out = {}
        for tpath, (src, pieces) in reads.items():
            if isinstance(src, Tensor):
                x = read(src.key)
                x = x.T if src.transpose else x
            else:
                x = _assemble(src, pieces, tuple(targets[tpath].shape), read)
            out[tpath] = put(tpath, np.ascontiguousarray(x.astype(targets[tpath].dtype, copy=False)))
            del x
        return out

    return read_all


def load_tokenizer(path: str) -> Tokenizer | None:
    file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(file):
        return None
    return Tokenizer.from_file(file)
