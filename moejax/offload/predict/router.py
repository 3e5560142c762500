"""Router-based expert prediction (Speculating Experts §3): default vectors d_{l,e} (the mean output of expert e
of layer l over calibration tokens routed to it) turn the post-attention residual r_l into the quasi-hidden
state r_l + Σ_e g_e·d_{l,e}, an estimate of layer l+1's residual; layer l+1's MLP norm and router applied to it
predict l+1's experts. The distance d counts MoE layers (a dense layer in between is skipped: it has no default
vectors); for d > 1 the estimate is chained through the predicted routing of each MoE layer in between.

g_e are the weights of layer l's true router (it runs anyway, and is closer to the truth than a prediction)."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.buckets import bucket
from moejax.config import ModelConfig
from moejax.kernels.backends import Kernels
from moejax.offload import layered_steps
from moejax.offload.predict.arrays_io import load_arrays, save_arrays
from moejax.offload.predict.artifacts import expect_kind
from moejax.offload.predict.protocol import Arrays, Prediction
from moejax.offload.stats import OffloadStats

_f32 = jnp.float32


class EngineModel(Protocol):
    """What calibration, trace recording (traces) and replay read of an engine: moejax.engine.Engine is one (it sits
    above this package, which takes it as this protocol)."""

    @property
    def config(self) -> ModelConfig: ...

    @property
    def graphdef(self) -> nnx.GraphDef: ...

    @property
    def params(self) -> nnx.State: ...

    @property
    def kernels(self) -> Kernels: ...

    def layer_experts(self, layer: int) -> dict: ...


@dataclasses.dataclass
class DefaultVectors:
    vectors: np.ndarray  # [L, E, D] float32; zero rows for dense layers and experts never chosen
    counts: np.ndarray  # [L, E] calibration tokens routed to each expert

    def save(self, path: str) -> str:
        """Write with orbax to the directory `path` (which must not exist yet)."""
        return save_arrays(path, {"vectors": self.vectors, "counts": self.counts})

    @classmethod
    def load(cls, path: str) -> DefaultVectors:
        tree = load_arrays(path, "default vectors")
        expect_kind(tree, path, "default vectors")
        return cls(np.asarray(tree["vectors"], np.float32), np.asarray(tree["counts"]))


def _hop(graphdef: nnx.GraphDef, state: nnx.State, h: jax.Array, vectors: jax.Array, idx: jax.Array,
         weights: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """h [N, D] float32 residual estimate of the previous layer, plus that layer's default-vector mix ->
    the next (MoE) layer's residual estimate and its router's choice."""
    h = h + jnp.einsum("nk,nkd->nd", weights, vectors[idx])
    layer = nnx.merge(graphdef, state)
    p_idx, p_weights = layer.mlp.route_tokens(layer.mlp_norm(h.astype(layer.mlp_norm.weight[...].dtype)))
    return h, p_idx, p_weights


class RouterPredictor:
    def __init__(self, vectors: DefaultVectors, distance: int = 1):
        if distance < 1:
            raise ValueError(f"router predictor: distance must be >= 1, got {distance}")
        self.vectors, self.distance = vectors, int(distance)
        self._device_vectors = jnp.asarray(vectors.vectors)

    def begin_pass(self, steps: layered_steps.LayeredSteps) -> None:
        self._steps = steps
        if self.vectors.vectors.shape[0] != len(steps.layers):
            raise ValueError(f"router predictor: default vectors cover {self.vectors.vectors.shape[0]} layers, "
                             f"the model has {len(steps.layers)}")

    def predict(self, pass_no: int, layer: int, x: Arrays, y: Arrays, idx: Arrays, weights: Arrays) -> Prediction:
        moe = self._steps.moe_layers
        ahead = moe[moe.index(layer) + 1: moe.index(layer) + 1 + self.distance]  # distance counts MoE layers
        if len(ahead) < self.distance:
            return {}
        h, prev = x.reshape(-1, x.shape[-1]).astype(_f32), layer
        for j in ahead:  # add the previous MoE layer's default-vector mix, route layer j
            h, idx, weights = self._steps.layers[j](_hop, h, self._device_vectors[prev], idx, weights)
            prev = j
        return {prev: (idx, weights)}

    def describe(self) -> str:
        return f"router (quasi-hidden state, distance {self.distance})"


def _expert_sums(graphdef: nnx.GraphDef, state: nnx.State, y: jax.Array, idx: jax.Array, valid: jax.Array,
                 experts: dict[str, jax.Array], *, backend: str) -> tuple[jax.Array, jax.Array]:
    """Per expert: the summed unweighted output over valid tokens routed to it [E, D], and their count [E]."""
    mlp = nnx.merge(graphdef, state).mlp
    y2 = y.reshape(-1, y.shape[-1])
    E = experts["we_down"].shape[0]
    sums, counts = jnp.zeros((E, y2.shape[-1]), _f32), jnp.zeros((E,), _f32)
    for k in range(idx.shape[1]):
        out = mlp.routed(y2, idx[:, k:k + 1], jnp.ones((y2.shape[0], 1), _f32), experts, backend).astype(_f32)
        sums = sums + jax.ops.segment_sum(out * valid[:, None], idx[:, k], E)
        counts = counts + jax.ops.segment_sum(valid, idx[:, k], E)
    return sums, counts


class _Calibrating(layered_steps.LayerRuntime):
    """A placement that runs each MoE layer exactly (experts from `experts_of`) and sums per-expert outputs."""

    name = "calibrating"

    def __init__(self, experts_of: Callable[[int], dict[str, jax.Array]], shape: tuple[int, int, int], backend: str
                 ) -> None:
        self.experts_of, self.backend = experts_of, backend
        self.sums, self.counts = np.zeros(shape, np.float64), np.zeros(shape[:2], np.int64)
        self.valid: jax.Array | None = None  # the pass's valid-token mask [N] (run_prompts sets it)
        self.stats = OffloadStats()  # nothing moves: empty

    def describe(self) -> str:
        return "calibrating: every expert run exactly, per-expert outputs summed"

    def begin_pass(self, steps: layered_steps.LayeredSteps) -> None:
        pass

    def vectors(self) -> DefaultVectors:
        return DefaultVectors((self.sums / np.maximum(self.counts, 1)[..., None]).astype(np.float32), self.counts)

    def moe(self, handle: layered_steps.Layer, x: jax.Array, y: jax.Array, idx: jax.Array | None,
            weights: jax.Array | None) -> jax.Array:
        assert idx is not None and weights is not None  # its layers run their routers
        layer = handle.index
        experts = self.experts_of(layer)
        sums, counts = handle(_expert_sums, y, idx, self.valid, experts, backend=self.backend)
        self.sums[layer] += np.asarray(sums)
        self.counts[layer] += np.asarray(counts).astype(np.int64)
        return layered_steps.run_moe(handle, x, y, idx, weights, experts, self.backend)


def run_prompts(engine: EngineModel, placement: _Calibrating, prompts: Iterable[Sequence[int]], *,
                max_tokens_per_prompt: int, max_tokens: int | None = None
                ) -> tuple[layered_steps.LayeredSteps, list[int], list[int]]:
    """Run each prompt (cut to max_tokens_per_prompt; stop once max_tokens are run) alone through `engine`'s
    layer-by-layer steps with `placement` (which sees the valid-token mask as `placement.valid`) -> (steps, the
    token ids run, each prompt's length)."""
    steps = layered_steps.LayeredSteps(engine.graphdef, engine.params, engine.kernels, placement)
    tokens: list[int] = []
    lengths: list[int] = []
    for prompt in prompts:
        room = max_tokens_per_prompt if max_tokens is None else min(max_tokens_per_prompt, max_tokens - sum(lengths))
        if room <= 0:
            break
        ids = list(prompt)[:room]
        if not ids:
            continue
        T = bucket(len(ids), 16)
        batch = np.zeros((1, T), np.int32)
        batch[0, :len(ids)] = ids
        placement.valid = jnp.asarray(np.arange(T) < len(ids), _f32)
        steps.logits(engine.params, jnp.asarray(batch))
        tokens += ids
        lengths.append(len(ids))
    return steps, tokens, lengths


def calibrate(engine: EngineModel, prompts: Iterable[Sequence[int]], *, max_tokens: int = 512) -> DefaultVectors:
    """Default vectors from running `prompts` (lists of token ids, each cut to `max_tokens`) through `engine`
    (any placement: its experts are read layer by layer from wherever they live)."""
    cfg = engine.config
    placement = _Calibrating(engine.layer_experts, (cfg.num_layers, cfg.num_experts, cfg.hidden_size),
                             engine.kernels.experts)
    run_prompts(engine, placement, prompts, max_tokens_per_prompt=max_tokens)
    if not placement.counts.any():
        raise ValueError("calibrate: no tokens in the calibration prompts")
    return placement.vectors()
