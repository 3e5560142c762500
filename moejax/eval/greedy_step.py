"""Packed-tree scoring that also says whether each target token is the greedy one (its position's argmax), as
lm-eval's loglikelihood answers (log-probability, is_greedy). moejax.steps.score gives only the log-probabilities;
this step is the same begin and layers with an end that adds the flags."""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp

from moejax import steps

from flax import nnx
from moejax.engine import Engine
from moejax.models.decoder import MoEModel
from moejax.sharding.pipeline import PipelineSteps

T = TypeVar("T")


def greedy_score_end(model: MoEModel, x: jax.Array, new: list, prior: list | None, pool: list,
                     batch: dict[str, jax.Array], *, span: tuple[int, int | None] = (0, None)
                     ) -> tuple[tuple[jax.Array, jax.Array], list]:
    """-> ((log-probabilities [B, G] float32, whether each target is its read position's argmax [B, G]), pool)."""
    logits = model.head(x, batch["read_idx"])  # [B, U, V] float32
    picked, pool = steps.scored(model, logits, new, prior, pool, batch)
    top = jnp.argmax(logits, axis=-1)  # [B, U]: the first maximum, as torch's argmax
    greedy = jnp.take_along_axis(top, batch["tgt_u"], axis=1) == batch["tgt_tok"]
    return (picked, greedy), pool


def _greedy_end_unpooled(model: MoEModel, x: jax.Array, batch: dict[str, jax.Array], *, span: tuple[int, int | None]
                         ) -> tuple[jax.Array, jax.Array]:
    """greedy_score_end without a prefix pool: the pipeline layout's end (moejax.sharding.pipeline)."""
    return greedy_score_end(model, x, [], None, [], batch, span=span)[0]


def _phase(fn: Callable[..., T], graphdef: nnx.GraphDef, state: nnx.State, *args: Any, **static: Any) -> T:
    return fn(steps.model_of(graphdef, state), *args, **static)


class GreedyScoreStep:
    """step(pool, batch arrays, span) -> ((logprobs, greedy) on the device, pool), for any Engine: one jit of the
    whole model, or (an offloaded placement, engine.layer_by_layer) jitted begin and end around the engine's
    own layer loop, or the pipeline layout's stage program (its weights stacked by stage, so not the whole-model jit:
    prefill-only, without a prefix pool)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._pipelined: Any = None  # the pipeline's step, made with its weights on first use
        bind = functools.partial
        if engine.layer_by_layer:
            self._begin = jax.jit(bind(_phase, steps.score_begin, engine.graphdef), static_argnames=("span",))
            self._end = jax.jit(bind(_phase, greedy_score_end, engine.graphdef), donate_argnums=(4,),
                                static_argnames=("span",))
        else:
            self._whole = jax.jit(bind(steps.resident(steps.score_begin, greedy_score_end), engine.graphdef,
                                       engine.kernels), donate_argnums=(1,), static_argnames=("span",))

    def __call__(self, pool: list | None, batch: dict, span: Sequence[int | None] = (0, None)
                 ) -> tuple[tuple[jax.Array, jax.Array], list | None]:
        params = self.engine.params
        arrays = {k: jnp.asarray(v) for k, v in batch.items()}
        span = tuple(span)
        if self.engine.placement.no_prefix_pool is not None:  # the pipeline layout
            return self._pipeline_step(pool, arrays, span)
        if not self.engine.layer_by_layer:
            return self._whole(params, pool, arrays, span=span)
        inputs, prior = self._begin(params, pool, arrays, span=span)
        x, new = self.engine.layered_steps.run_layers(**inputs)
        return self._end(params, x, new, prior, pool, arrays, span=span)

    def _pipeline_step(self, pool: list | None, arrays: dict[str, jax.Array], span: tuple[int | None, ...]
                       ) -> tuple[tuple[jax.Array, jax.Array], None]:
        pipeline = self.engine.steps
        assert isinstance(pipeline, PipelineSteps)  # the one placement without a prefix pool
        if pool is not None or "prior_ids" in arrays or "store_ids" in arrays:
            raise ValueError(f"kv_cache: {self.engine.placement.no_prefix_pool}; score with kv_cache off")
        if self._pipelined is None:
            self._pipelined = pipeline.score_with(_greedy_end_unpooled)
        return self._pipelined(self.engine.params, arrays, span=span), None
