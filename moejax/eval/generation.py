"""Completions for lm-eval's generate_until through the continuous-batching scheduler (moejax.sched.continuous):
every request is one sequence, all of them in one run over a paged KV pool, ended at the model's end-of-sequence
tokens, a stop string or max_gen_toks."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import cast

import jax
import numpy as np

from moejax.engine import Engine
from moejax.sampling import SamplingParams
from moejax.sched.continuous import GenRequest, Scheduler
from moejax.sched.pool_size import pool_size


@dataclasses.dataclass(frozen=True)
class Completion:
    prompt: tuple[int, ...]
    max_tokens: int
    stop: tuple[str, ...]  # strings that end it (the text is cut at the first by the caller)
    sampling: SamplingParams = SamplingParams()  # seed None: 0


def generate(engine: Engine, completions: Sequence[Completion], decode: Callable[[list[int]], str], *,
             kv_pool_mb: float | None = None, progress: Callable[[int], None] | None = None) -> list[list[int]]:
    """New tokens of each completion, in order (a stop token is kept as the last). decode(tokens) -> text, for the
    stop strings. progress(1) as each one ends."""
    if not completions:
        return []
    limit = engine.config.max_position_embeddings
    for i, c in enumerate(completions):
        if not c.prompt:
            raise ValueError(f"generate_until request {i}: the context encodes to no token")
        if c.max_tokens < 1 or len(c.prompt) + c.max_tokens > limit:
            raise ValueError(f"generate_until request {i}: {len(c.prompt)} context tokens + max_gen_toks "
                             f"{c.max_tokens} must fit the model's context of {limit} (max_gen_toks >= 1)")
    stop_ids = tuple(engine.config.eos_token_ids)
    items = [GenRequest(c.prompt, c.max_tokens, np.asarray(jax.random.key_data(jax.random.key(c.sampling.seed or 0))),
                        stop_ids, tuple(s for s in c.stop if s), c.sampling, tag=i)
             for i, c in enumerate(completions)]
    blocks = pool_size(engine, [(len(c.prompt), c.max_tokens) for c in completions], kv_pool_mb).blocks
    out: list = [None] * len(items)
    failed: list[str] = []

    def on_finish(g: GenRequest, tokens: list[int], cached: int) -> None:
        out[cast(int, g.tag)] = list(tokens)  # the request's index (tag=i above)
        if progress is not None:
            progress(1)

    def on_fail(g: GenRequest, message: str) -> None:
        failed.append(f"generate_until request {g.tag}: {message}")

    Scheduler(engine, blocks, decode_text=decode, **engine.placement.scheduler_defaults()).run(items, on_finish,
                                                                                              on_fail)
    if failed:
        raise RuntimeError("; ".join(failed[:5]) + (f" (and {len(failed) - 5} more)" if len(failed) > 5 else ""))
    return out
