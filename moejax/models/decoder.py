"""Decoder layer and the whole model forward (prefill and cached decode), one math for all families."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from moejax.config import ModelConfig
from moejax.kernels.backends import Kernels
from moejax.kernels.precision import f32_dot
from moejax.models.attention import Cache, GQAttention, MLAttention, Positions, TreeMask
from moejax.models.layers import RMSNorm, rope_cos_sin
from moejax.models.moe import DenseMLP, LocalExperts, MoEBlock
from moejax.sampling import StepArray



class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: DTypeLike,
                 experts_runner: Callable[[MoEBlock, jax.Array, str], jax.Array] = LocalExperts()) -> None:
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.attn = (MLAttention if cfg.attention == "mla" else GQAttention)(cfg, layer, dtype)
        self.mlp: MoEBlock | DenseMLP
        if cfg.is_moe(layer):
            self.mlp = MoEBlock(cfg, dtype, experts_runner)
        else:
            self.mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, dtype)

    def attend(self, x: jax.Array, at: Positions, cache: Cache, prior: dict[str, jax.Array] | None = None, *,
               read_cache: bool, kernels: Kernels) -> tuple[jax.Array, jax.Array, Cache]:
        """The attention half: -> (residual after attention, its normalized input to the MLP, cache). cache, prior:
        this layer's (MoEModel.run_layers)."""
        h, cache = self.attn(self.attn_norm(x), at, cache, read_cache, prior, kernels.attention)
        x = x + h
        return x, self.mlp_norm(x), cache

    def __call__(self, x: jax.Array, at: Positions, cache: Cache, prior: dict[str, jax.Array] | None = None, *,
                 read_cache: bool, kernels: Kernels) -> tuple[jax.Array, Cache]:
        x, y, cache = self.attend(x, at, cache, prior, read_cache=read_cache, kernels=kernels)
        y = self.mlp(y, kernels.experts) if isinstance(self.mlp, MoEBlock) else self.mlp(y)
        return x + y, cache


class MoEModel(nnx.Module):
    """Build under `nnx.eval_shape` (weights are filled by the checkpoint loader or the preset init)."""

    def __init__(self, cfg: ModelConfig, dtype: DTypeLike = jnp.float32,
                 experts_runner: Callable[[MoEBlock, jax.Array, str], jax.Array] = LocalExperts(),
                 split_batch: Callable[[jax.Array], jax.Array] | None = None) -> None:
        """experts_runner: how every MoE block runs its routed experts (the placement's; see MoEBlock).
        split_batch(x [B, T, D]): a data-parallel layout's constraint splitting hidden states by rows over the
        devices, so attention runs on each device's own sequences (None: no constraint)."""
        self.cfg = cfg
        self.split_batch = split_batch
        self.embed = nnx.Param(jnp.zeros((cfg.vocab_size, cfg.hidden_size), dtype))
        self.layers = nnx.List([DecoderLayer(cfg, i, dtype, experts_runner) for i in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = None if cfg.tie_word_embeddings else nnx.Param(
            jnp.zeros((cfg.hidden_size, cfg.vocab_size), dtype))

    def init_cache(self, batch: int, length: int) -> list[dict[str, jax.Array]]:
        dtype = self.embed.dtype
        return [layer.attn.init_cache(batch, length, dtype) for layer in self.layers]

    def kv_bytes_per_token(self) -> int:
        """KV cache bytes of one token over every layer (from shapes only: the model may be abstract)."""
        shapes = jax.eval_shape(lambda: self.init_cache(1, 1))
        return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(shapes))

    def __call__(self, tokens: StepArray, positions: StepArray, cache: Sequence[Cache] | None = None, *,
                 read_cache: bool = True, kernels: Kernels = Kernels(), gather_idx: StepArray | None = None,
                 tree: TreeMask | None = None, prior: Sequence[dict[str, jax.Array]] | None = None
                 ) -> tuple[jax.Array, list[Cache] | None]:
        """tokens, positions [B, T] -> float32 logits [B, T, V], or only at `gather_idx` ([B] -> [B, V],
        [B, U] -> [B, U, V]), and the per-layer cache.

        With a cache (list per layer) the new keys are written at slot = position; `read_cache=False`
        says the cache held nothing before this call, so attention reads only the new keys.
        With a `tree` (TreeMask) the rows are packed token trees that may attend to `prior` keys (per-layer
        cache-layout arrays [B, P, ...]); the second output is then this call's keys per layer."""
        x, at = self.embed_inputs(tokens, positions, tree)
        x, new_cache = self.run_layers(x, at, cache, read_cache, kernels, prior)
        return self.head(x, gather_idx), (None if cache is None and tree is None else new_cache)

    def run_layers(self, x: jax.Array, at: Positions, cache: Sequence[Cache] | None = None, read_cache: bool = True,
                   kernels: Kernels = Kernels(), prior: Sequence[dict[str, jax.Array]] | None = None
                   ) -> tuple[jax.Array, list[Cache]]:
        """Every decoder layer in turn -> (hidden states, per-layer caches or new keys). cache, prior: per layer."""
        new_cache = []
        for i, layer in enumerate(self.layers):
            x, c = layer(x, at, None if cache is None else cache[i], None if prior is None else prior[i],
                         read_cache=read_cache, kernels=kernels)
            new_cache.append(c)
        return x, new_cache

    def embed_inputs(self, tokens: StepArray, positions: StepArray, tree: TreeMask | None = None
                     ) -> tuple[jax.Array, Positions]:
        """-> (hidden states [B, T, D], Positions): what the first layer takes (tree: packed rows' TreeMask)."""
        cos, sin = rope_cos_sin(self.cfg.rope, self.cfg.rotary_dim, positions)
        x = self.embed[...][tokens]
        # the steps call this inside their jits: positions is traced there, a jax.Array
        at = Positions(cast(jax.Array, positions), cos, sin, tree)
        return (x if self.split_batch is None else self.split_batch(x)), at

    def head(self, x: jax.Array, gather_idx: StepArray | None = None) -> jax.Array:
        """Last hidden states -> float32 logits (at every position, or at `gather_idx` as in __call__)."""
        if gather_idx is not None:
            one = gather_idx.ndim == 1
            x = jnp.take_along_axis(x, (gather_idx[:, None] if one else gather_idx)[..., None], axis=1)
            x = x[:, 0] if one else x
        x = self.final_norm(x)
        head = self.embed[...].T if self.lm_head is None else self.lm_head[...]
        return f32_dot(x, head)
