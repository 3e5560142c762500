"""`ragged_dot_cudnn`: `jax.lax.ragged_dot` compiled by XLA's cuDNN ragged-dot fusion on a GPU.

Without it, XLA (JAX 0.10-0.11) lowers ragged_dot to a dense masked product: every row times every group's weights
(5.7 TFLOP/s on an H200, 128 GiB asked for at 32K tokens). `--xla_gpu_experimental_use_ragged_dot_fusion=true`
("use cuDNN fusion for ragged dot operations", present in jaxlib 0.10.2's XLA) turns it into one cuDNN grouped
GEMM. It is an XLA flag, read once when JAX starts its GPU backend: it must be in XLA_FLAGS before then, for the
whole process, so this backend refuses to run on a GPU without it (it would be the dense masked product under
another name). `python -m launch.bench kernels` sets it for its process. Off a GPU the flag changes nothing and
this backend is plain ragged_dot (the CPU tests check it against the reference). Not an `auto` choice until a GPU
run has measured it.
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from moejax.kernels.grouped_matmul.groups import zero_rows_of_no_group
from moejax.kernels.platform import on_gpu
from moejax.kernels.precision import for_operands

FLAG = "--xla_gpu_experimental_use_ragged_dot_fusion"
ON = f"{FLAG}=true"


def fusion_enabled(flags: str | None = None) -> bool:
    """Whether XLA_FLAGS (or `flags`) turns the fusion on: the last mention of the flag wins, as XLA parses."""
    value = None
    for token in (os.environ.get("XLA_FLAGS", "") if flags is None else flags).split():
        name, _, v = token.partition("=")
        if name == FLAG:
            value = v.lower() in ("", "true", "1")
    return bool(value)


def with_fusion(flags: str) -> str:
    """XLA_FLAGS `flags` with the fusion turned on."""
    return flags if fusion_enabled(flags) else f"{flags} {ON}".strip()


def unavailable() -> str | None:
    """Why `ragged_dot_cudnn` cannot run here, or None."""
    if on_gpu() and not fusion_enabled():
        return (f"the ragged_dot_cudnn backend needs XLA_FLAGS={ON} set before JAX starts (without it XLA runs "
                "ragged_dot as a dense masked product)")
    return None


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """x [M, K], w [G, K, N] -> float32 [M, N]; rows past sum(group_sizes) are 0."""
    why = unavailable()
    if why:
        raise ValueError(why)
    y = jax.lax.ragged_dot(x, w, group_sizes.astype(jnp.int32), preferred_element_type=jnp.float32,
                           precision=for_operands(x.dtype))
    return zero_rows_of_no_group(y, group_sizes)
