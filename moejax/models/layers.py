"""Norms and rotary position embeddings shared by every family."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import DTypeLike

from moejax.config import RopeConfig, yarn_mscale
from moejax.kernels import invariant
from moejax.sampling import StepArray


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype: DTypeLike) -> None:
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        if invariant.active():  # per fixed row tile: XLA's row reduction could follow the number of rows
            return invariant.by_rows(self._norm, x)
        return self._norm(x)

    def _norm(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (self.weight[...].astype(jnp.float32) * normed).astype(x.dtype)


def rope_frequencies(rope: RopeConfig, dim: int) -> tuple[np.ndarray, float]:
    """Inverse frequencies [dim/2] and the cos/sin scale ("attention factor") for a rope variant."""
    inv = 1.0 / (rope.theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    if rope.kind == "default":
        return inv, 1.0
    if rope.kind == "linear":
        return inv / rope.factor, 1.0
    if rope.kind == "llama3":
        orig = rope.original_max_position
        assert orig is not None  # config._rope sets it for llama3
        low_wl, high_wl = orig / rope.low_freq_factor, orig / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wl, inv / rope.factor, inv)
        smooth = (orig / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        mid = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_mid = (wavelen >= high_wl) & (wavelen <= low_wl)
        return np.where(is_mid, mid, scaled).astype(np.float32), 1.0
    # yarn
    factor, orig = rope.factor, rope.original_max_position
    assert orig is not None  # config._rope sets it for yarn
    att = rope.attention_factor
    if att is None:
        att = (yarn_mscale(factor, rope.mscale) / yarn_mscale(factor, rope.mscale_all_dim)
               if rope.mscale and rope.mscale_all_dim else yarn_mscale(factor))

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    pos = rope.theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    inv = (1.0 / (factor * pos)) * (1 - extrapolation) + (1.0 / pos) * extrapolation
    return inv.astype(np.float32), float(att)


def rope_cos_sin(rope: RopeConfig, dim: int, positions: StepArray) -> tuple[jax.Array, jax.Array]:
    """cos, sin of shape positions.shape + [dim/2], in float32."""
    inv, scale = rope_frequencies(rope, dim)
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv)
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, interleaved: bool) -> jax.Array:
    """x [B, T, H, D]; cos/sin [B, T, D/2]. Halves (Llama style) or interleaved pairs (DeepSeek)."""
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    xf = x.astype(jnp.float32)
    if interleaved:
        a, b = xf[..., 0::2], xf[..., 1::2]
    else:
        a, b = jnp.split(xf, 2, axis=-1)
    # For interleaved pairs the output is laid out as [rotated evens, rotated odds]; q and k share the
    # permutation, so q·k (all attention ever reads) is unchanged.
    return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1).astype(x.dtype)
