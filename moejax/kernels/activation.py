"""Expert activations on float32 gate/up halves, written with plain `exp` so the Pallas GPU kernels can fuse them."""
from __future__ import annotations

import jax
import jax.numpy as jnp

ACTIVATIONS = ("silu", "swiglu_clamp")


def _sigmoid(x: jax.Array) -> jax.Array:
    return 1.0 / (1.0 + jnp.exp(-x))


def glu(gate: jax.Array, up: jax.Array, kind: str, limit: float, alpha: float) -> jax.Array:
    """SwiGLU (`silu`: silu(gate) * up) or GPT-OSS's clamped variant (`swiglu_clamp`)."""
    if kind == "silu":
        return gate * _sigmoid(gate) * up
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return gate * _sigmoid(gate * alpha) * (up + 1.0)


def glu_of(h: jax.Array, kind: str, limit: float, alpha: float) -> jax.Array:
    """h [..., 2I] = [gate | up] -> glu [..., I]."""
    gate, up = jnp.split(h, 2, axis=-1)
    return glu(gate, up, kind, limit, alpha)
