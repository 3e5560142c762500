"""bench serve's workloads (launch/bench/serve_workloads.py): MoE-Prefill's context regimes are seeded and sized as
asked, the shared-prefix one really shares its prefixes (the runner's prefix cache finds them, replayed without the
model: no compile), and the bench end to end on the tiny preset (slow) records each workload, the memory fields and
scores equal to the float32 reference."""
import json

import numpy as np
import pytest

import moejax
from launch.bench import cli as bench
from launch.bench import serve as bench_serve
from launch.bench.results import read_runs
from launch.bench.serve_workloads import KINDS, REGIMES, Sizes, held, mix_counts, workload
from moejax.requests.parse import parse_lines
from moejax.sched.batch import plan_requests
from moejax.sched.runner import Runner
from moejax.sched.serving_options import ServingOptions

VOCAB = 1024  # the tiny preset's
SIZES = Sizes(requests=12, prefix=64, suffix=8, candidates=3, prefixes=3, context=300, long_requests=2,
              choice_tokens=5)


def bodies(lines):
    return [json.loads(line)["body"] for line in lines]


@pytest.mark.parametrize("kind", KINDS)
def test_the_same_seed_makes_the_same_requests(kind):
    assert workload(kind, SIZES, VOCAB, 7) == workload(kind, SIZES, VOCAB, 7)
    assert workload(kind, SIZES, VOCAB, 7) != workload(kind, SIZES, VOCAB, 8)


def test_each_regime_has_the_lengths_asked():
    shared = bodies(workload("shared-prefix", SIZES, VOCAB, 0))
    assert len(shared) == 12 and {len(b["prompt_token_ids"]) for b in shared} == {72}
    assert {tuple(b["prompt_token_ids"][:64]) for b in shared}.__len__() == 3  # three prefixes, in turn
    assert len({tuple(b["prompt_token_ids"][64:]) for b in shared}) == 12  # each suffix its own
    assert all(b["candidate_token_ids"].__len__() == 3 and {len(c) for c in b["candidate_token_ids"]} == {1}
               for b in shared)
    long = bodies(workload("long-context", SIZES, VOCAB, 0))
    assert len(long) == 2 and {len(b["prompt_token_ids"]) for b in long} == {300}
    multi = bodies(workload("multi-select", SIZES, VOCAB, 0))
    assert len(multi) == 12 and {len(b["prompt_token_ids"]) for b in multi} == {72}
    assert all([len(c) for c in b["candidate_token_ids"]] == [5, 5, 5] for b in multi)
    mix = [json.loads(line) for line in workload("mix", SIZES, VOCAB, 0)]
    regimes = [m["custom_id"].rsplit("-", 1)[0] for m in mix]
    assert {r: regimes.count(r) for r in set(regimes)} == mix_counts(SIZES) == {
        "shared-prefix": 6, "multi-select": 6, "long-context": 1}
    assert regimes != sorted(regimes, key=list(mix_counts(SIZES)).index)  # shuffled, not one regime after another


def test_the_recorded_sharing_ratio_counts_the_repeated_prefixes():
    got = held(workload("shared-prefix", SIZES, VOCAB, 0))
    # 12 prompts of 72 tokens; the prefix tree holds 3 prefixes of 64 and 12 suffixes of 8 (random draws may add a
    # token or two in common between suffixes)
    assert got["prompt_tokens"] == 12 * 72 and 3 * 64 + 12 * 8 - 4 <= got["prefix_tree_tokens"] <= 3 * 64 + 12 * 8
    assert got["prefix_sharing_ratio"] == pytest.approx(1 - got["prefix_tree_tokens"] / (12 * 72))
    assert held(workload("long-context", SIZES, VOCAB, 0))["prefix_sharing_ratio"] < 0.01


def planned_cache_hits(engine, lines, **options) -> int:
    """Context tokens the runner's prefix cache supplies over the run, replayed as --explain does (no model)."""
    todo = parse_lines(lines, tokenizer=None, vocab_size=engine.config.vocab_size,
                       max_context=engine.config.max_position_embeddings)
    schedule, opts, pool, sizing = plan_requests(engine, todo, ServingOptions(**options))
    runner = Runner(engine, schedule, todo, None, options=opts, kv_pool=pool, batch_size=sizing)
    return sum(sum(r.cached.values()) for k in range(len(schedule.batches)) for r in runner.prepare(k)[0])


def test_the_shared_prefix_workload_is_served_from_the_prefix_cache():
    """A prefix and its four requests' suffixes take 64 + 4 x 8 tokens: in batches of 80 a prefix's requests are split
    over batches, and each prefix (4 blocks) is read from the cache by a later batch; with the cache off, never, nor
    for prompts of the same lengths sharing nothing."""
    engine = moejax.load("tiny-qwen3-moe", dtype="float32")
    kw = dict(max_batch_tokens=80, kv_cache="on")
    assert planned_cache_hits(engine, workload("shared-prefix", SIZES, VOCAB, 0), **kw) >= 3 * 64
    assert planned_cache_hits(engine, workload("shared-prefix", SIZES, VOCAB, 0), max_batch_tokens=80,
                              kv_cache="off") == 0
    assert planned_cache_hits(engine, workload("distinct", SIZES, VOCAB, 0), **kw) == 0  # nothing to share


def test_a_long_context_beyond_the_model_is_refused_naming_the_flag():
    """Before any weight is made (serve() itself: the CLI's provenance would take seconds)."""
    args = bench_serve.namespace(workloads="mix", context=2048)
    with pytest.raises(SystemExit, match="workload mix: a prompt and its candidate take 2049 tokens, more than the "
                                         "model's 2048 positions; lower --context"):
        bench_serve.serve(args, {})


def log_softmax_scores(engine, body) -> list[list[float]]:
    """Each candidate's summed log-probability after the prompt, from the engine's float32 full-sequence logits."""
    row = []
    for cand in body["candidate_token_ids"]:
        logits = np.asarray(engine.logits([body["prompt_token_ids"] + cand]), np.float64)[0]
        top = logits.max(-1, keepdims=True)
        lsm = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
        start = len(body["prompt_token_ids"]) - 1
        row.append(sum(lsm[start + k, t] for k, t in enumerate(cand)))
    return [row]


@pytest.mark.slow  # the bench end to end: every regime's shapes compiled on the tiny preset
def test_bench_serve_runs_each_regime_and_scores_equal_the_reference(tmp_path):
    out = tmp_path / "serve.json"
    bench.main(["serve", "--workloads", ",".join(REGIMES), "--requests", "12", "--prefix", "64", "--suffix", "8",
                "--candidates", "3", "--prefixes", "3", "--context", "300", "--long-requests", "2",
                "--choice-tokens", "5", "--kv-modes", "on", "--max-batch-tokens", "80", "--repeats", "1",
                "--no-resident", "--seed", "3", "--out", str(out)])
    [record] = read_runs(str(out))
    assert record["config"]["seed"] == 3 and record["config"]["prefixes"] == 3
    assert [r["workload"] for r in record["results"]] == list(REGIMES)
    engine = moejax.load("tiny-qwen3-moe", dtype="float32")
    for row in record["results"]:
        kind = row["workload"]
        lines = workload(kind, SIZES, VOCAB, 3)
        assert record["workloads"][kind]["held"] == held(lines)
        assert row["prompt_tokens"] == held(lines)["prompt_tokens"]
        memory = row["memory"]
        assert memory["peak_bytes_in_use"] is None and memory["source"].startswith("none: the cpu backend")
        estimate = memory["estimate"]
        assert estimate["weights_bytes"] == engine.memory_budget.device_bytes
        assert estimate["total_bytes"] == (estimate["weights_bytes"] + estimate["prefix_pool_bytes"]
                                           + estimate["activation_bytes"]) and estimate["prefix_pool_bytes"] > 0
        by_id = {json.loads(line)["custom_id"]: json.loads(line)["body"] for line in lines}
        assert len(row["sample"]) == min(3, len(lines))
        for s in row["sample"]:
            assert s["error"] is None
            np.testing.assert_allclose(s["logprobs"], log_softmax_scores(engine, by_id[s["custom_id"]]),
                                       rtol=1e-4, atol=2e-4)
    # each prefix is read from the cache by the batches after its first (a long context, split over batches of 80
    # tokens, reads its own first blocks too: no contrast there)
    shared = next(r for r in record["results"] if r["workload"] == "shared-prefix")
    assert shared["cached_prompt_tokens"] >= 3 * 64
