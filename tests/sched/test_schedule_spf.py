"""`--order spf`, shortest prefill first (PrefillOnly's scheduler, MoE-Prefill's §8.1 baseline): scoring batches
made from the requests of least estimated prefill time (true FLOPs), re-estimated before each batch against the prefix
cache as the batches before it leave it; every sequence once. Pure scheduling over the tiny preset's config: no model,
no compile (the results against the default order: tests/sched/test_order_results.py)."""
import json

import numpy as np
import pytest

from moejax.config import ModelConfig
from moejax.models.kv_pool import BLOCK
from moejax.presets import preset_config
from moejax.requests.parse import parse_lines
from moejax.sched.batch_schedule import row_length, schedule_batches
from moejax.sched.packing import tree_size
from moejax.sched.serving_options import ServingOptions

TINY = ModelConfig.from_hf(preset_config("tiny-qwen3-moe"))


def requests_of(prompts: dict[str, list[int]]):
    lines = [json.dumps({"custom_id": cid, "url": "/v1/score",
                         "body": {"prompt_token_ids": p, "candidate_token_ids": [[5], [6]]}})
             for cid, p in prompts.items()]
    return list(enumerate(parse_lines(lines, tokenizer=None, vocab_size=TINY.vocab_size, max_context=4096)))


def order_of(schedule, requests) -> list[str]:
    """The custom ids in the order the batches run them."""
    ids = {i: r.custom_id for i, r in requests}
    out: list[str] = []
    for b in schedule.batches:
        for row in b.rows:
            for s in row:
                cid = ids[s.reads[0][2][0]]
                if cid not in out:
                    out.append(cid)
    return out


@pytest.fixture(scope="module")
def three():
    """p1: a 4-block prefix X and 4 tokens of its own; q: 100 tokens shared with nothing; p2: X and 60 tokens of its
    own. With a 100-token budget each is a tree and a batch of its own."""
    rng = np.random.default_rng(1)
    x = rng.integers(1, TINY.vocab_size, 4 * BLOCK).tolist()
    draw = lambda n: rng.integers(1, TINY.vocab_size, n).tolist()  # noqa: E731
    return requests_of({"p2": x + draw(60), "q": draw(100), "p1": x + draw(4)})


def plan(requests, order, kv_cache="auto"):
    return schedule_batches(requests, max_batch_tokens=100, kv_cache=kv_cache, cache_blocks=64, config=TINY,
                            order=order)


def test_spf_runs_the_shortest_estimated_prefill_first_and_reestimates_with_the_cache(three):
    """Alone, p2 (124 tokens) costs more than q (100): the default runs the longest first, p2 q p1. Shortest first
    runs p1, which leaves X in the prefix cache; priced again, p2 is 60 new tokens over 64 of context, less than q's
    100, so it runs second. With the cache off nothing is left to find and the estimate stays p1 q p2."""
    assert order_of(plan(three, "longest"), three) == ["p2", "q", "p1"]
    assert order_of(plan(three, "spf"), three) == ["p1", "p2", "q"]
    assert order_of(plan(three, "spf", kv_cache="off"), three) == ["p1", "q", "p2"]


def test_spf_fills_each_batch_with_the_shortest_and_schedules_every_sequence_once():
    rng = np.random.default_rng(2)
    lengths = [int(n) for n in rng.integers(8, 120, 40)]
    requests = requests_of({f"r{k}": rng.integers(1, TINY.vocab_size, n).tolist() for k, n in enumerate(lengths)})
    spf = schedule_batches(requests, max_batch_tokens=256, kv_cache="off", config=TINY, order="spf")
    longest = schedule_batches(requests, max_batch_tokens=256, kv_cache="off", config=TINY)
    seqs = lambda s: sorted((q.tokens, q.reads) for b in s.batches for r in b.rows for q in r)  # noqa: E731
    assert seqs(spf) == seqs(longest)  # the same sequences, each once
    assert len(order_of(spf, requests)) == 40
    sizes = [lengths[int(c[1:])] for c in order_of(spf, requests)]
    assert sizes == sorted(sizes)  # no sharing: shortest prompt, least FLOPs
    for b in spf.batches:  # each batch within the budget: its rows, as long as its largest tree
        assert len(b.rows) * row_length(max(tree_size(row) for row in b.rows)) <= 256
    assert order_of(longest, requests) != order_of(spf, requests)


def test_a_bad_order_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"^order must be one of longest, spf, got 'fifo'$"):
        ServingOptions(order="fifo")
