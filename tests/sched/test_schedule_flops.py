"""The FLOPs floor (MoE-Prefill's Θ) counts a batch's FLOPs by Eq. 2 as the steps compute them: context whose KV
an earlier batch left in the cross-batch prefix cache is attended to, not computed again. Pure
scheduling over the tiny preset's config: no model, no compile."""
import json

import numpy as np
import pytest

from moejax.config import ModelConfig
from moejax.costs import true_prefill_flops
from moejax.models.kv_pool import BLOCK
from moejax.presets import preset_config
from moejax.requests.parse import parse_lines
from moejax.sched.batch_schedule import schedule_batches, tree_flops
from moejax.sched.packing import pack_row
from moejax.sched.prefix_cache import PrefixCache

TINY = ModelConfig.from_hf(preset_config("tiny-qwen3-moe"))
PREFIX, OWN = 6 * BLOCK, BLOCK  # each prompt: a shared 96-token prefix and 16 tokens of its own
REQUESTS = 16


@pytest.fixture(scope="module")
def requests():
    rng = np.random.default_rng(0)
    shared = rng.integers(1, TINY.vocab_size, PREFIX).tolist()
    lines = [json.dumps({"custom_id": f"r{i}", "url": "/v1/score",
                         "body": {"prompt_token_ids": shared + rng.integers(1, TINY.vocab_size, OWN).tolist(),
                                  "candidate_token_ids": [[5]]}}) for i in range(REQUESTS)]
    return list(enumerate(parse_lines(lines, tokenizer=None, vocab_size=TINY.vocab_size, max_context=4096)))


def plan(requests, kv_cache):
    # a 112-token budget: one prompt per prefix tree (two would be 128 tokens), rows of 128
    floor = 1.2 * true_prefill_flops(TINY, PREFIX + OWN)  # two uncached prompts pass it, one does not
    return schedule_batches(requests, max_batch_tokens=PREFIX + OWN, kv_cache=kv_cache, cache_blocks=64,
                            min_batch_flops=floor, config=TINY), floor


def test_cached_prefix_counts_as_context_for_the_flops_floor(requests):
    """The first batch computes the shared prefix and stores it; the second finds it in the prefix cache, so each of
    its prompts costs its own 16 tokens attending to 96 tokens of context, and it takes as many rows as that reaches
    the floor with (doubling from one). Without the cache every prompt costs all its tokens, in both batches."""
    schedule, floor = plan(requests, "on")
    uncached, _ = plan(requests, "off")
    assert [len(b.rows) for b in uncached.batches[:2]] == [2, 2]
    suffix = true_prefill_flops(TINY, OWN, PREFIX)
    rows = 1
    while rows * suffix < floor:
        rows *= 2
    assert len(schedule.batches[0].rows) == 2
    assert len(schedule.batches[1].rows) == rows > 2  # under the 13 rows that 14 prompts need at most
    held = sorted(s.tokens for b in schedule.batches for r in b.rows for s in r)
    assert held == sorted(s.tokens for b in uncached.batches for r in b.rows for s in r) and len(held) == REQUESTS

    # What the runner's packing then computes: each of the second batch's rows takes the prefix from the cache and
    # computes its own 16 tokens, which is what the floor counted for it.
    cache, flops_of = PrefixCache(schedule.pool_blocks), tree_flops(TINY)
    for k, batch in enumerate(schedule.batches[:2]):
        cache.begin_batch()
        counted = [flops_of(row, cache) for row in batch.rows]
        packed = [pack_row(row, cache, want_store=lambda h: True) for row in batch.rows]
        for row, flops in zip(packed, counted, strict=True):
            context = sum(row.cached.values())
            assert (len(row.tokens), context) == ((OWN, PREFIX) if k else (PREFIX + OWN, 0))
            assert flops == pytest.approx(true_prefill_flops(TINY, len(row.tokens), context))
