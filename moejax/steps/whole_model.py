"""The Engine's steps as whole-model jits: what every placement that does not run its MoE layers from Python uses
(the layer loop, moejax.offload.layered_steps.LayeredSteps, implements the same Steps protocol). Each step is a jax
jit (its `lower` gives the compiled program)."""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx
from jax.stages import Wrapped

from moejax.kernels import invariant
from moejax.kernels.backends import Kernels
from moejax.steps import paged_phases, phases
from moejax.steps.protocol import Pool, Steps


class WholeModelSteps(Steps):
    # the protocol's methods, each a jit of the whole model
    logits: Wrapped
    logprobs: Wrapped
    score: Wrapped
    greedy_score: Wrapped
    prefill: Wrapped
    decode: Wrapped
    chunk: Wrapped
    paged_decode: Wrapped

    def __init__(self, graphdef: nnx.GraphDef, kernels: Kernels) -> None:
        self.graphdef = graphdef

        def bind(fn: Callable[..., Any], *args: Any) -> Callable[..., Any]:
            step = functools.partial(fn, *args)
            return invariant.traced(step) if kernels.invariant else step
        self.logits = jax.jit(bind(phases.full_logits, graphdef, kernels))
        self.logprobs = jax.jit(bind(phases.token_logprobs, graphdef, kernels), static_argnames=("k",))
        self.score = jax.jit(bind(phases.score, graphdef, kernels), donate_argnums=(1,), static_argnames=("span",))
        self.greedy_score = jax.jit(bind(phases.greedy_score, graphdef, kernels), donate_argnums=(1,),
                                    static_argnames=("span",))
        self.prefill = jax.jit(bind(phases.prefill, graphdef, kernels), static_argnames=("cache_len",),
                               donate_argnums=(1,))
        self.decode = jax.jit(bind(phases.decode, graphdef, kernels), static_argnames=("steps",))
        self.chunk = jax.jit(bind(paged_phases.chunk, graphdef, kernels), static_argnames=("fresh",),
                             donate_argnums=(1, 2))
        self.paged_decode = jax.jit(bind(paged_phases.decode, graphdef, kernels), static_argnames=("steps",),
                                    donate_argnums=(1, 2))

    def decode_pool(self, params: nnx.State, num_blocks: int, /) -> Pool:
        return phases.zeroed_pool(self.graphdef, params, num_blocks)

    def logits_hlo(self, params: nnx.State, tokens: jax.ShapeDtypeStruct, /) -> str | None:
        return self.logits.lower(params, tokens).compile().as_text()
