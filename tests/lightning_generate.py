"""Greedy and sampled generations of an engine under the continuous-batching scheduler, as the batch runner drives
it (the placement's scheduler defaults: lightning's decode batch in one call), for the lightning tests in process
and in the two-device worker."""
from __future__ import annotations

import jax
import numpy as np

from moejax.sampling import SamplingParams
from moejax.sched.continuous import GenRequest, Scheduler

NEW_TOKENS = 5


def scheduled(engine, prompts: list[list[int]], temperature: float = 0.0, new_tokens: int = NEW_TOKENS,
              **scheduler) -> list[list[int]]:
    """Each prompt's tokens (row r samples with key(r)); a failed request fails the test."""
    out: dict = {}
    failed: list[str] = []
    items = [GenRequest(p, new_tokens, np.asarray(jax.random.key_data(jax.random.key(r))), (), (),
                        SamplingParams(temperature), tag=r) for r, p in enumerate(prompts)]
    options = {"decode_steps": 2, **engine.placement.scheduler_defaults(), **scheduler}
    Scheduler(engine, 64, **options).run(items, lambda g, tokens, cached: out.__setitem__(g.tag, list(tokens)),
                                         lambda g, message: failed.append(message))
    assert not failed, failed
    return [out[r] for r in range(len(prompts))]
