"""Routing traces: what every MoE layer saw and chose for a set of prompts, the data every predictor is trained
and measured on. Per token and MoE layer: the post-attention residual r_l (what the quasi-hidden state and the
previous-hidden baseline are built from) and the router's float32 logits (the choice and the distillation
target); per prompt, its token range. Recorded through the layer-by-layer steps, so the engine may keep its
experts anywhere; the same pass calibrates default vectors (Speculating Experts §3.1) on the same tokens."""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.offload.layered_steps import Layer
from moejax.offload.predict.router import DefaultVectors, EngineModel, _Calibrating, run_prompts

_f32 = jnp.float32


@dataclasses.dataclass
class Traces:
    residual: np.ndarray  # [N, M, D] float32: post-attention residual at each MoE layer
    router_logits: np.ndarray  # [N, M, E] float32
    tokens: np.ndarray  # [N] int32
    starts: np.ndarray  # [R + 1] int64: prompt r owns tokens starts[r]:starts[r + 1]
    moe_layers: list[int]  # model layer index of each of the M MoE layers

    @property
    def num_prompts(self) -> int:
        return len(self.starts) - 1

    def prompts(self, which: Sequence[int]) -> Traces:
        """The traces of the prompts `which` (indices), in that order."""
        rows = np.concatenate([np.arange(self.starts[r], self.starts[r + 1]) for r in which] or [np.zeros(0, int)])
        lengths = np.diff(self.starts)[list(which)]
        return Traces(self.residual[rows], self.router_logits[rows], self.tokens[rows],
                      np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64), list(self.moe_layers))

    def split(self, every: int = 10) -> tuple[Traces, Traces]:
        """(train, held out) by prompt: prompt r is held out when r % every == every - 1 (every is capped at the
        number of prompts, so at least one is held out)."""
        if self.num_prompts < 2:
            raise ValueError(f"traces: {self.num_prompts} prompt(s) cannot be split into training and validation")
        every = min(every, self.num_prompts)
        held = [r for r in range(self.num_prompts) if r % every == every - 1]
        keep = [r for r in range(self.num_prompts) if r % every != every - 1]
        return self.prompts(keep), self.prompts(held)

    def save(self, path: str) -> None:
        np.savez(path, residual=self.residual, router_logits=self.router_logits, tokens=self.tokens,
                 starts=self.starts, moe_layers=np.asarray(self.moe_layers, np.int32))

    @classmethod
    def load(cls, path: str) -> Traces:
        with np.load(path) as f:
            return cls(f["residual"], f["router_logits"], f["tokens"], f["starts"], f["moe_layers"].tolist())


def _router_logits(graphdef: nnx.GraphDef, state: nnx.State, y: jax.Array) -> jax.Array:
    return nnx.merge(graphdef, state).mlp.router_logits(y.reshape(-1, y.shape[-1]).astype(_f32))


class _Recording(_Calibrating):
    """Runs each MoE layer exactly, sums per-expert outputs (default vectors) and keeps the valid tokens'
    residual and router logits."""

    name = "recording"

    def __init__(self, *args: Any) -> None:  # _Calibrating's
        super().__init__(*args)
        self.rows: dict[int, list] = {}

    def moe(self, handle: Layer, x: jax.Array, y: jax.Array, idx: jax.Array | None, weights: jax.Array | None
            ) -> jax.Array:
        keep = np.asarray(self.valid) > 0
        logits = np.asarray(handle(_router_logits, y), np.float32)[keep]
        residual = np.asarray(x.reshape(-1, x.shape[-1]), np.float32)[keep]
        self.rows.setdefault(handle.index, []).append((residual, logits))
        return super().moe(handle, x, y, idx, weights)


def record(engine: EngineModel, prompts: Iterable[Sequence[int]], *, max_tokens_per_prompt: int = 512,
           max_tokens: int = 65536) -> tuple[Traces, DefaultVectors]:
    """Run `prompts` (lists of token ids, each cut to max_tokens_per_prompt; recording stops once max_tokens
    are held, which bounds memory at max_tokens * M * (D + E) * 4 bytes) -> (Traces, DefaultVectors of the
    same tokens)."""
    cfg = engine.config
    placement = _Recording(engine.layer_experts, (cfg.num_layers, cfg.num_experts, cfg.hidden_size),
                           engine.kernels.experts)
    steps, tokens, lengths = run_prompts(engine, placement, prompts, max_tokens_per_prompt=max_tokens_per_prompt,
                                         max_tokens=max_tokens)
    if not lengths:
        raise ValueError("record: no tokens in the prompts")
    moe = steps.moe_layers
    residual = np.stack([np.concatenate([r for r, _ in placement.rows[i]]) for i in moe], axis=1)
    logits = np.stack([np.concatenate([z for _, z in placement.rows[i]]) for i in moe], axis=1)
    traces = Traces(residual, logits, np.asarray(tokens, np.int32),
                    np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64), list(moe))
    return traces, placement.vectors()
