"""Batch-runner results against the engine's own forward: every score equals the log-softmax of
Engine.logits at the right positions (teacher-forced over multi-token candidates), with the prefix KV cache
on, off (KV-free) and auto, packed into several batches; every completion equals Engine.generate."""
import json

import numpy as np
import pytest
from conftest import fast_tier, fixture_dir

import moejax
from moejax.sched.batch import serve_lines
from moejax.sched.serving_options import ServingOptions

FAMILIES = ["qwen3_moe", "deepseek_v3", "gpt_oss", "mixtral"]  # GQA, MLA, sinks + sliding window, window


@pytest.fixture(scope="module", params=fast_tier(FAMILIES, lambda f: f == "qwen3_moe"))
def engine(request):
    return moejax.load(fixture_dir(request.param), dtype="float32")


def score_line(cid, prompt, cands, suffixes=None):
    body = {"prompt_token_ids": prompt, "candidate_token_ids": cands}
    if suffixes is not None:
        body["suffixes"] = suffixes
    return json.dumps({"custom_id": cid, "url": "/v1/score", "body": body})


def workload(vocab: int, seed: int = 0):
    """Score requests with a 40-token prefix shared across requests, siblings, multi-token candidates that
    share first tokens, and requests that share nothing."""
    rng = np.random.default_rng(seed)
    ids = lambda n: rng.integers(1, vocab, n).tolist()  # noqa: E731
    shared = ids(40)
    lines = []
    for i in range(6):
        lines.append(score_line(f"shared-{i}", shared + ids(int(rng.integers(1, 20))),
                                [[7], [9, 3], [9, 4, 5], ids(2)]))
    lines.append(score_line("suffixes", shared[:20] + ids(5), [[3], [4]], [ids(3), ids(17), [11], ids(30)]))
    lines.append(score_line("same-as-shared-0", json.loads(lines[0])["body"]["prompt_token_ids"], [[1], [2]]))
    for i in range(3):
        lines.append(score_line(f"alone-{i}", ids(int(rng.integers(2, 50))), [[5], ids(3)]))
    return lines


@pytest.fixture(scope="module")
def references(engine):
    """Reference scores by request line, per family: the KV-cache modes score the same workload."""
    return {}


def reference_scores(engine, line, cache=None):
    if cache is not None and line in cache:
        return cache[line]
    body = json.loads(line)["body"]
    contexts = [body["prompt_token_ids"] + s for s in body.get("suffixes", [[]])]
    out = []
    for ctx in contexts:
        row = []
        for cand in body["candidate_token_ids"]:
            logits = engine.logits([ctx + cand]).astype(np.float64)[0]
            lsm = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
                - logits.max(-1, keepdims=True)
            row.append(sum(lsm[len(ctx) - 1 + k, t] for k, t in enumerate(cand)))
        out.append(row)
    if cache is not None:
        cache[line] = out
    return out


def served(engine, lines, tmp_path, name, **kw):
    """kw: ServingOptions."""
    out = tmp_path / f"{name}.jsonl"
    summary = serve_lines(engine, lines, str(out), ServingOptions(**kw))
    return [json.loads(x) for x in out.read_text().splitlines()], summary


@pytest.mark.parametrize("kv_cache", ["off", "on"])
def test_scores_equal_logsoftmax_of_engine_logits(engine, references, tmp_path, kv_cache):
    lines = workload(engine.config.vocab_size)
    results, summary = served(engine, lines, tmp_path, kv_cache, max_batch_tokens=64, kv_cache=kv_cache)
    assert summary["batches_planned"] > 2 and summary["requests_ok"] == len(lines)
    cached = 0
    for line, res in zip(lines, results, strict=True):
        assert res["custom_id"] == json.loads(line)["custom_id"] and res["error"] is None
        body = res["response"]["body"]
        got = [[c["logprob"] for c in r["candidates"]] for r in body["results"]]
        np.testing.assert_allclose(got, reference_scores(engine, line, references), rtol=1e-4, atol=2e-4)
        for r in body["results"]:
            probs = [c["prob"] for c in r["candidates"]]
            assert abs(sum(probs) - 1) < 1e-9 and r["best_index"] == int(np.argmax(probs))
        cached += body["usage"]["cached_prompt_tokens"]
    if kv_cache == "off":
        assert cached == 0 and summary["kv_cache"].startswith("off")
    else:  # the shared prefix recurs across batches: later batches must reuse its KV
        assert cached >= 32 and summary["cached_prompt_tokens"] == cached


def test_in_batch_sharing_computes_each_prefix_once(tmp_path):
    engine = moejax.load("tiny-qwen3-moe", dtype="float32")
    prompt = list(range(1, 101))
    lines = [score_line("siblings", prompt, [[5], [6], [7, 8]], [[200 + i, 300 + i] for i in range(8)])]
    results, summary = served(engine, lines, tmp_path, "one", kv_cache="off")
    # 100 shared tokens + 8 x (2 suffix tokens + 1 candidate token for [7, 8])
    assert summary["computed_tokens"] == 100 + 8 * 3
    assert results[0]["response"]["body"]["usage"] == {"prompt_tokens": 8 * 102, "cached_prompt_tokens": 0}
    got = [[c["logprob"] for c in r["candidates"]] for r in results[0]["response"]["body"]["results"]]
    np.testing.assert_allclose(got, reference_scores(engine, lines[0]), rtol=1e-4, atol=2e-4)


def completion_line(cid, prompt, max_tokens, **kw):
    return json.dumps({"custom_id": cid, "url": "/v1/completions",
                       "body": {"prompt_token_ids": prompt, "max_tokens": max_tokens, **kw}})


@pytest.mark.parametrize("kv_cache", ["on"])
def test_completions_equal_engine_generate(engine, tmp_path, kv_cache):
    rng = np.random.default_rng(1)
    vocab = engine.config.vocab_size
    shared = rng.integers(1, vocab, 35).tolist()
    prompts = [shared + rng.integers(1, vocab, n).tolist() for n in (3, 9, 1)] + [rng.integers(1, vocab, 5).tolist()]
    lines = [completion_line("greedy-0", prompts[0], 6), completion_line("greedy-1", prompts[1], 3),
             completion_line("sampled", prompts[2], 5, temperature=0.9, top_p=0.8, seed=11),
             completion_line("stop-ids", prompts[3], 8, stop_token_ids=[3, 4])]
    results, summary = served(engine, lines, tmp_path, kv_cache, max_batch_tokens=64, kv_cache=kv_cache)
    eos = list(engine.config.eos_token_ids)
    expect = [engine.generate([prompts[0]], 6, stop_token_ids=eos)[0],
              engine.generate([prompts[1]], 3, stop_token_ids=eos)[0],
              engine.generate([prompts[2]], 5, temperature=0.9, top_p=0.8, seed=11, stop_token_ids=eos)[0],
              engine.generate([prompts[3]], 8, stop_token_ids=[3, 4] + eos)[0]]
    for res, want in zip(results, expect, strict=True):
        choice = res["response"]["body"]["choices"][0]
        assert choice["token_ids"] == want, res["custom_id"]
        stopped = len(want) < 8 or want[-1] in eos + [3, 4]
        assert choice["finish_reason"] in (("stop", "length") if stopped else ("length",))
    if kv_cache == "on":
        assert summary["cached_prompt_tokens"] >= 32


def test_auto_policy_and_kv_free_plan():
    """auto turns the cache on only when a prefix block recurs across batches; off allocates no pool."""
    from moejax.requests.parse import parse_lines
    from moejax.sched.batch_schedule import schedule_batches
    engine = moejax.load("tiny-qwen3-moe", dtype="float32")

    def plan(lines, mode):
        reqs = parse_lines(lines, tokenizer=None, vocab_size=1024, max_context=2048)
        return schedule_batches(list(enumerate(reqs)), max_batch_tokens=64, kv_cache=mode, cache_blocks=100)
    lines = workload(engine.config.vocab_size)
    assert plan(lines, "auto").kv_cache and plan(lines, "auto").pool_blocks > 0
    assert not plan(lines, "off").kv_cache and plan(lines, "off").pool_blocks == 0
    distinct = [score_line(f"d{i}", [i + 1] * (20 + i), [[1]]) for i in range(6)]
    p = plan(distinct, "auto")
    assert len(p.batches) > 1 and not p.kv_cache and p.pool_blocks == 0 and "off" in p.reason
    assert plan(lines, "on").pool_blocks <= 100 and plan(lines, "on").kv_cache


def test_read_token_inside_a_cached_block_is_recomputed(engine):
    """A context of exactly two blocks, fully cached by an earlier batch: its last token is recomputed (its
    cached copy hidden) so its logits exist, and the score is unchanged."""
    from moejax.sched.packing import ScoreSeq, assemble, pack_row
    from moejax.sched.prefix_cache import PrefixCache
    ctx = tuple(np.random.default_rng(2).integers(1, engine.config.vocab_size, 32).tolist())
    seq = ScoreSeq(ctx, 32, "ctx", ((31, 3, "t"),))
    cache, pool = PrefixCache(4), engine.init_pool(4)
    logits = engine.logits([list(ctx)])[0, 31].astype(np.float64)
    want = logits[3] - logits.max() - np.log(np.exp(logits - logits.max()).sum())
    for expect_prior in (0, 2):
        cache.begin_batch()
        row = pack_row([seq], cache, want_store=lambda h: True)
        assert len(row.prior_slots) == expect_prior
        arrays, _, span = assemble([row], 4)
        lp, pool = engine.score_packed(arrays, pool, span)
        np.testing.assert_allclose(lp[0, 0], want, rtol=1e-4, atol=2e-4)
    assert row.positions == [31] and row.cached == {"ctx": 31}
