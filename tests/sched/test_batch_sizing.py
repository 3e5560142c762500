"""Scoring batches sized from the device (moejax.sched.batch_size) and the runner's overlapped dispatch: on a GPU
profile the budget is Θ's tokens, bounded by what the memory budget leaves; a given --max-batch-tokens wins; CPUs keep
the default. The runner dispatches batch k+1 before it reads batch k, with the same results, and a batch that fails
when read still costs only its own requests (the next one is packed again against the fresh prefix cache)."""
import json

import numpy as np
import pytest

import moejax
from moejax.plan.datasheets import DATASHEETS
from moejax.plan.theta import theta_eq1
from moejax.requests.parse import parse_lines
from moejax.sched.batch import explain_lines, serve_lines
from moejax.sched.batch_schedule import schedule_batches
from moejax.sched.batch_size import DEFAULT_TOKENS, ScoreBatchSize, activation_bytes_per_token, score_batch_size
from moejax.sched.serving_options import ServingOptions

SLICE = dict(num_layers=4, dtype="bfloat16")  # the qwen3-30b-a3b slice the GPU benchmarks run (allocates nothing)


def score_line(cid: str, prompt: list[int], cands: list[list[int]]) -> str:
    return json.dumps({"custom_id": cid, "url": "/v1/score",
                       "body": {"prompt_token_ids": prompt, "candidate_token_ids": cands}})


def test_an_h200_profile_sizes_batches_to_theta():
    engine = moejax.load("qwen3-30b-a3b", **SLICE)
    sized = score_batch_size(engine, None, longest=512, platform="gpu", profile=DATASHEETS["h200"])
    theta = theta_eq1(engine.config, DATASHEETS["h200"]).theta_tokens
    assert sized.tokens == theta and 10_000 < theta < 1_000_000  # no memory cap given: Θ alone
    assert sized.cap is None and sized.tree_tokens == DEFAULT_TOKENS  # rows stay as long as before
    assert "Θ by Eq. 1 on profile h200 (datasheet)" in sized.source
    # CPUs keep the default; a given budget wins everywhere and says so
    assert score_batch_size(engine, None, longest=512, platform="cpu").tokens == DEFAULT_TOKENS
    asked = score_batch_size(engine, 4096, longest=512, platform="gpu", profile=DATASHEETS["h200"])
    assert (asked.tokens, asked.tree_tokens) == (4096, 4096) and "as given" in asked.source


def test_a_small_memory_budget_bounds_the_batch():
    engine = moejax.load("qwen3-30b-a3b", device_memory_gb=8, **SLICE)  # 5.8 GiB of weights: 2.2 GiB left
    plan = engine.memory_budget
    sized = score_batch_size(engine, None, longest=512, reserved_bytes=2**28, platform="gpu",
                             profile=DATASHEETS["h200"])
    per_token = activation_bytes_per_token(engine.config, 2, 512 + 256)
    assert sized.cap == (8 * 2**30 - plan.device_bytes - 2**28) // per_token == sized.tokens
    assert 1000 < sized.tokens < theta_eq1(engine.config, DATASHEETS["h200"]).theta_tokens
    assert "memory: budget 8.00 GiB" in sized.source and "asks" in sized.source


def test_explain_says_which_size_and_why(tiny):
    lines = [score_line("a", [5, 6, 7], [[1]])]
    assert "scoring batches: up to 8192 tokens (the default on cpu)" in explain_lines(tiny, lines)
    assert "scoring batches: up to 64 tokens (--max-batch-tokens 64, as given; it wins over the device's size)" in \
        explain_lines(tiny, lines, ServingOptions(max_batch_tokens=64))


def test_the_plan_packs_rows_up_to_the_budget_and_theta_grows_them_no_further_than_memory():
    lines = [score_line(f"r{i}", list(range(1 + i, 512 + i)), [[1]]) for i in range(64)]  # 512-token sequences
    reqs = [e for e in parse_lines(lines, tokenizer=None, vocab_size=1024, max_context=2048)]
    sized = ScoreBatchSize(16384, None, DEFAULT_TOKENS, "test")
    plan = schedule_batches(list(enumerate(reqs)), max_batch_tokens=DEFAULT_TOKENS, kv_cache="off", score_batch=sized)
    assert [len(b.rows) for b in plan.batches] == [32, 32]  # 16384 tokens in rows of 512
    grown = schedule_batches(list(enumerate(reqs)), max_batch_tokens=DEFAULT_TOKENS, kv_cache="off",
                             min_batch_flops=1e30,
                             config=moejax.load("tiny-qwen3-moe").config,
                             score_batch=ScoreBatchSize(1024, 8192, DEFAULT_TOKENS, "test"))
    assert [len(b.rows) for b in grown.batches] == [16] * 4  # the floor doubles rows until 8192 tokens, not past


@pytest.fixture(scope="module")
def tiny():
    return moejax.load("tiny-qwen3-moe", dtype="float32")


def oracle(engine, prompt, token) -> float:
    logits = engine.logits([prompt])[0, -1].astype(np.float64)
    return float(logits[token] - logits.max() - np.log(np.exp(logits - logits.max()).sum()))


def spy(engine, monkeypatch, fail_read: int | None = None) -> list:
    """Records the runner's dispatches and reads in order; the read number `fail_read` raises."""
    events, real_score, real_read = [], engine.score_packed, engine.to_host

    def score_packed(batch, pool=None, span=(0, None)):
        events.append(("dispatch", int(batch["tokens"][0, 0])))
        return real_score(batch, pool, span)

    def to_host(x):
        events.append(("read", sum(e[0] == "read" for e in events)))
        if events[-1][1] == fail_read:
            raise RuntimeError("device lost")
        return real_read(x)
    monkeypatch.setattr(engine, "score_packed", score_packed)
    monkeypatch.setattr(engine, "to_host", to_host)
    return events


def test_the_next_batch_is_dispatched_before_the_last_is_read_with_the_same_results(tiny, tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 1024, 40).tolist() for _ in range(4)]
    lines = [score_line(f"r{i}", p, [[7], [9]]) for i, p in enumerate(prompts)]
    events = spy(tiny, monkeypatch)
    summary = serve_lines(tiny, lines, str(tmp_path / "out.jsonl"),
                          ServingOptions(max_batch_tokens=64, kv_cache="off"))
    assert summary["batches"] == 4 and summary["requests_ok"] == 4
    kinds = [kind for kind, _ in events]
    assert kinds == ["dispatch", "dispatch", "read", "dispatch", "read", "dispatch", "read", "read"]
    monkeypatch.undo()
    rows = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    for row, prompt in zip(rows, prompts, strict=True):  # in input order, each as the full model computes it
        got = [c["logprob"] for c in row["response"]["body"]["results"][0]["candidates"]]
        np.testing.assert_allclose(got, [oracle(tiny, prompt, 7), oracle(tiny, prompt, 9)], rtol=1e-5, atol=1e-5)


def test_a_batch_failing_when_read_costs_only_its_requests_and_the_next_is_packed_again(tiny, tmp_path,
                                                                                         monkeypatch):
    rng = np.random.default_rng(1)
    head = rng.integers(3, 1024, 32).tolist()  # two prefix blocks every request shares: the prefix cache is on
    prompts = [head + rng.integers(3, 1024, 8).tolist() for _ in range(4)]
    lines = [score_line(f"r{i}", p, [[7]]) for i, p in enumerate(prompts)]
    events = spy(tiny, monkeypatch, fail_read=1)
    summary = serve_lines(tiny, lines, str(tmp_path / "out.jsonl"),
                          ServingOptions(max_batch_tokens=40, kv_cache="on"))
    assert summary["requests_ok"] == 3 and summary["requests_batch_failed"] == 1 and summary["cached_prompt_tokens"]
    # the third batch was packed against the cache the failed batch left, then again against a fresh one
    assert [kind for kind, _ in events].count("dispatch") == 5
    monkeypatch.undo()
    rows = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    failed = [r["custom_id"] for r in rows if r["response"]["status_code"] == 500]
    assert len(failed) == 1
    assert rows[int(failed[0][1:])]["error"]["message"] == "batch failed: RuntimeError: device lost"
    for row, prompt in zip(rows, prompts, strict=True):
        if row["custom_id"] not in failed:
            got = row["response"]["body"]["results"][0]["candidates"][0]["logprob"]
            assert got == pytest.approx(oracle(tiny, prompt, 7), rel=1e-5, abs=1e-5)
