"""Run the continuous-batching scheduler directly (tests): per-sequence results by index, and the scheduler."""
import jax
import numpy as np

from moejax.sampling import SamplingParams
from moejax.sched.continuous import GenRequest, Scheduler


def row_key(seed: int, row: int) -> np.ndarray:
    """Engine.generate's key for row `row` (fold_in(key(seed), row)) as raw key data."""
    return np.asarray(jax.random.key_data(jax.random.fold_in(jax.random.key(seed), row)))


def run_scheduler(engine, prompts, max_tokens, *, num_blocks, seed=0, temperature=0.0, stop_ids=(), rows=None,
                  **options):
    """Generate every prompt (max_tokens: one for all or one per prompt) -> (tokens per prompt, Scheduler).
    Prompt i samples with Engine.generate's key for row rows[i] (default i)."""
    maxn = max_tokens if isinstance(max_tokens, (list, tuple)) else [max_tokens] * len(prompts)
    rows = range(len(prompts)) if rows is None else rows
    reqs = [GenRequest(list(p), m, row_key(seed, r), tuple(stop_ids), sampling=SamplingParams(temperature), tag=i)
            for i, (p, m, r) in enumerate(zip(prompts, maxn, rows, strict=True))]
    out, failed = {}, {}
    sched = Scheduler(engine, num_blocks, **options)
    sched.run(reqs, lambda r, tokens, cached: out.__setitem__(r.tag, tokens),
              lambda r, message: failed.__setitem__(r.tag, message))
    assert not failed, failed
    assert sched.blocks.in_use() == 0  # every block came back
    return [out[i] for i in range(len(prompts))], sched
