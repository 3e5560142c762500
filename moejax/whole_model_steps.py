"""The Engine's steps as whole-model jits: what every placement that does not run its MoE layers from Python uses
(the layer loop, moejax.offload.layered.LayeredSteps, has the same methods and signatures)."""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from moejax import paged_steps, steps
from moejax.kernels import invariant
from moejax.kernels.backends import Kernels


class WholeModelSteps:
    def __init__(self, graphdef: nnx.GraphDef, kernels: Kernels) -> None:
        def bind(fn: Callable[..., Any], *args: Any) -> Callable[..., Any]:
            step = functools.partial(fn, *args)
            return invariant.traced(step) if kernels.invariant else step
        self.logits = jax.jit(bind(steps.full_logits, graphdef, kernels))
        self.logprobs = jax.jit(bind(steps.token_logprobs, graphdef, kernels), static_argnames=("k",))
        self.score = jax.jit(bind(steps.score, graphdef, kernels), donate_argnums=(1,), static_argnames=("span",))
        self.prefill = jax.jit(bind(steps.prefill, graphdef, kernels), static_argnames=("cache_len",),
                               donate_argnums=(1,))
        self.decode = jax.jit(bind(steps.decode, graphdef, kernels), static_argnames=("steps",))
        self.chunk = jax.jit(bind(paged_steps.chunk, graphdef, kernels), static_argnames=("fresh",),
                             donate_argnums=(1, 2))
        self.paged_decode = jax.jit(bind(paged_steps.decode, graphdef, kernels), static_argnames=("steps",),
                                    donate_argnums=(1, 2))
