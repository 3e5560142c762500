"""Request formats people already have, through the batch runner, against the engine's own forward: OpenAI
/v1/completions (n, logprobs, echo, token-list prompts) and /v1/chat/completions (the checkpoint's chat template,
rendered as transformers renders it: tests/fixtures/qwen3_moe/chat_reference.json), SGLang's /v1/score, the
OpenAI Batch output shape, per-request seeds, and the settings a resume must match."""
import json
import shutil
import time

import numpy as np
import pytest
from conftest import fixture_dir

import moejax
from moejax.requests.results import SettingsMismatch
from moejax.sampling import SamplingParams
from moejax.sched.batch import serve_lines
from moejax.sched.serving_options import ServingOptions

QWEN3 = fixture_dir("qwen3_moe")  # vocab 256, a tokenizer and a chat template


@pytest.fixture(scope="module")
def engine(qwen3_engine):
    return qwen3_engine


def serve(engine, tmp_path, requests, name="out.jsonl", settings=None, error_file=None, **kw):
    """kw: ServingOptions."""
    out = tmp_path / name
    lines = [json.dumps({"custom_id": f"r{i}", "url": url, "body": body}) for i, (url, body) in enumerate(requests)]
    summary = serve_lines(engine, lines, str(out), ServingOptions(**kw), settings=settings,
                          error_file=error_file)
    return [json.loads(x) for x in out.read_text().splitlines()], summary


def ok(row) -> dict:
    assert row["response"]["status_code"] == 200 and row["error"] is None, row
    return row["response"]["body"]


def log_softmax(engine, ids) -> np.ndarray:
    """[len(ids), vocab] next-token log-probabilities from the engine's full-sequence forward."""
    logits = engine.logits(np.array([ids]))[0].astype(np.float64)
    return logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - \
        logits.max(-1, keepdims=True)


def token_text(engine, t: int) -> str:
    return engine.tokenizer.decode([t])


def check_logprobs(engine, logprobs: dict, ids: list[int], start: int, top_n: int):
    """OpenAI's completion logprobs for ids[start:] against the forward over all of ids."""
    ref = log_softmax(engine, ids)
    assert logprobs["tokens"] == [token_text(engine, t) for t in ids[start:]]
    for k, pos in enumerate(range(start, len(ids))):
        if pos == 0:
            assert logprobs["token_logprobs"][k] is None and logprobs["top_logprobs"][k] is None
            continue
        row = ref[pos - 1]
        assert logprobs["token_logprobs"][k] == pytest.approx(row[ids[pos]], abs=1e-4)
        top = logprobs["top_logprobs"][k]
        best = np.argsort(-row)[:top_n]
        assert set(top) == {token_text(engine, t) for t in best} | {token_text(engine, ids[pos])}
        for t in best:
            assert top[token_text(engine, t)] == pytest.approx(row[t], abs=1e-4)
    text = "".join(logprobs["tokens"])
    assert logprobs["text_offset"] == [len("".join(logprobs["tokens"][:k])) for k in range(len(ids) - start)]
    assert len(text) == sum(map(len, logprobs["tokens"]))


@pytest.mark.slow  # about 17 s; tests/requests/test_openai_models.py serves echo and logprobs fast
def test_completions_choices_logprobs_and_echo_match_the_engine(engine, tmp_path):
    prompt = [5, 6, 7, 8]
    rows, summary = serve(engine, tmp_path, [
        ("/v1/completions", {"prompt": prompt, "max_tokens": 6, "n": 3, "temperature": 0.9, "seed": 11,
                             "logprobs": 3}),
        ("/v1/completions", {"prompt": [prompt], "max_tokens": 4, "echo": True, "logprobs": 2}),
        ("/v1/completions", {"prompt": "The clever fox", "max_tokens": 0, "echo": True, "logprobs": 1,
                             "frequency_penalty": 0, "stream": False, "user": "u"}),
    ])
    sampled, greedy, scored = map(ok, rows)
    # Choice c samples with fold_in(key(seed), c), as Engine.generate's row c does; all share one prefill.
    want = engine.generate([prompt] * 3, 6, temperature=0.9, seed=11)
    assert [c["token_ids"] for c in sampled["choices"]] == want
    assert [c["index"] for c in sampled["choices"]] == [0, 1, 2]
    assert len({tuple(w) for w in want}) > 1  # the choices differ
    for c in sampled["choices"]:
        check_logprobs(engine, c["logprobs"], prompt + c["token_ids"], len(prompt), 3)
    assert sampled["usage"]["completion_tokens"] == sum(map(len, want)) and sampled["usage"]["prompt_tokens"] == 4

    out = greedy["choices"][0]
    assert out["token_ids"] == engine.generate([prompt], 4)[0]
    assert out["text"] == engine.tokenizer.decode(prompt) + engine.tokenizer.decode(out["token_ids"])
    check_logprobs(engine, out["logprobs"], prompt + out["token_ids"], 0, 2)
    for k, t in enumerate(out["token_ids"]):  # greedy: each token is the most likely one
        top = out["logprobs"]["top_logprobs"][len(prompt) + k]
        assert max(top, key=top.get) == token_text(engine, t)

    ids = engine.tokenizer.encode("The clever fox").ids
    out = scored["choices"][0]
    assert out["text"] == "The clever fox" and out["token_ids"] == [] and out["finish_reason"] == "length"
    check_logprobs(engine, out["logprobs"], ids, 0, 1)
    assert scored["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids),
                               "prompt_tokens_details": {"cached_tokens": 0}, "cached_prompt_tokens": 0}
    assert summary["generated_tokens"] == sum(map(len, want)) + 4


def test_chat_completions_render_the_template_and_generate_like_the_engine(engine, tmp_path):
    case = json.load(open(f"{QWEN3}/chat_reference.json"))["cases"][1]  # system, user, assistant, user
    rows, _ = serve(engine, tmp_path, [
        ("/v1/chat/completions", {"model": "my-model", "messages": case["messages"], "max_completion_tokens": 5,
                                  "logprobs": True, "top_logprobs": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}),
        ("/v1/chat/completions", {"messages": case["messages"], "tools": [{"type": "function"}]}),
    ])
    body = ok(rows[0])
    want = engine.generate([case["token_ids"]], 5, stop_token_ids=engine.config.eos_token_ids)[0]
    choice = body["choices"][0]
    assert body["object"] == "chat.completion" and body["model"] == "my-model"
    assert choice["token_ids"] == want and choice["message"]["role"] == "assistant"
    ended = want[-1] in engine.config.eos_token_ids
    assert choice["message"]["content"] == engine.tokenizer.decode(want[:-1] if ended else want)
    assert choice["finish_reason"] == ("stop" if ended else "length")
    assert body["usage"]["prompt_tokens"] == len(case["token_ids"])
    ref = log_softmax(engine, case["token_ids"] + want)
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == [token_text(engine, t) for t in want]
    for k, (c, t) in enumerate(zip(content, want, strict=True)):
        row = ref[len(case["token_ids"]) + k - 1]
        assert c["logprob"] == pytest.approx(row[t], abs=1e-4) and c["bytes"] == list(c["token"].encode())
        assert [a["token"] for a in c["top_logprobs"]] == [token_text(engine, b) for b in np.argsort(-row)[:2]]
    for row, param, words in ((rows[1], "messages", "Unknown role: tool"), (rows[2], "tools", "is not supported")):
        assert row["response"]["status_code"] == 400
        error = row["response"]["body"]["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == param and words in error["message"]


def test_sglang_scores_match_the_engine_logits(engine, tmp_path):
    items, labels = [" fox", " robot", " map"], [3, 4, 5]
    rows, summary = serve(engine, tmp_path, [
        ("/v1/score", {"query": "The clever", "items": items, "label_token_ids": labels}),
        ("/v1/score", {"query": "The clever", "items": items, "label_token_ids": labels, "apply_softmax": True}),
        ("/v1/score", {"query": [5, 6, 7], "items": [[8], [9, 10]], "label_token_ids": labels, "item_first": True}),
    ])
    probs, softmax, first = map(ok, rows)
    for i, item in enumerate(items):
        lp = log_softmax(engine, engine.tokenizer.encode("The clever" + item).ids)[-1]
        p = np.exp(lp[labels])
        np.testing.assert_allclose(probs["scores"][i], p, rtol=1e-4)
        np.testing.assert_allclose(softmax["scores"][i], p / p.sum(), rtol=1e-4)
    for i, item in enumerate([[8], [9, 10]]):
        np.testing.assert_allclose(first["scores"][i], np.exp(log_softmax(engine, item + [5, 6, 7])[-1][labels]),
                                   rtol=1e-4)
    assert probs["object"] == "scoring" and probs["usage"]["completion_tokens"] == 0
    # The items share the query's prefix in one packed prefill: fewer tokens computed than sent.
    assert summary["computed_tokens"] < summary["prompt_tokens"]


def test_vllm_generative_scores_match_the_engine_logits(engine, tmp_path):
    rows, _ = serve(engine, tmp_path, [
        ("/generative_scoring", {"query": "The clever", "items": [" fox", [9, 10]], "label_token_ids": [3, 4]}),
        ("/generative_scoring", {"query": [5, 6], "items": [[8]], "label_token_ids": [3, 4], "apply_softmax": False}),
    ])
    softmax, probs = map(ok, rows)
    query = engine.tokenizer.encode("The clever").ids
    for i, item in enumerate([engine.tokenizer.encode(" fox", add_special_tokens=False).ids, [9, 10]]):
        p = np.exp(log_softmax(engine, query + item)[-1][[3, 4]])
        assert softmax["data"][i] == {"index": i, "object": "score", "score": pytest.approx(p[0] / p.sum(), rel=1e-4)}
    assert probs["data"][0]["score"] == pytest.approx(np.exp(log_softmax(engine, [5, 6, 8])[-1][3]), rel=1e-4)
    assert softmax["object"] == "list" and softmax["usage"]["prompt_tokens"] == len(query) * 2 + 3


def test_output_lines_have_the_openai_batch_shape(engine, tmp_path):
    before = int(time.time())
    rows, _ = serve(engine, tmp_path, [("/v1/completions", {"prompt": [5, 6], "max_tokens": 2}),
                                       ("/v1/score", {"prompt": "The", "candidates": [" fox"]}),
                                       ("/v1/completions", {"prompt": [5], "max_tokens": -1})])
    for row, kind in zip(rows[:2], ("text_completion", "score"), strict=True):
        body = ok(row)
        assert row["response"]["request_id"] == row["id"] and body["id"].endswith(row["id"])
        assert body["object"] == kind and body["model"] == QWEN3 and before <= body["created"] <= time.time() + 1
        assert body["system_fingerprint"].startswith("fp_")
    assert ok(rows[0])["system_fingerprint"] == ok(rows[1])["system_fingerprint"]
    bad = rows[2]
    assert bad["response"] == {"status_code": 400, "request_id": bad["id"], "body": {"error": {
        "message": "body.max_tokens: must be an int >= 1; got -1", "type": "invalid_request_error",
        "param": "max_tokens", "code": "invalid_request"}}}
    assert bad["error"] == {"code": "invalid_request", "message": "body.max_tokens: must be an int >= 1; got -1"}


def test_error_file_has_the_failed_lines_in_order(engine, tmp_path):
    errors = tmp_path / "errors.jsonl"
    rows, _ = serve(engine, tmp_path, [("/v1/completions", {"prompt": [5], "max_tokens": -1}),
                                       ("/v1/completions", {"prompt": [5], "max_tokens": 1}),
                                       ("/v1/score", {"prompt": [5]})], error_file=str(errors))
    assert [json.loads(x) for x in errors.read_text().splitlines()] == [rows[0], rows[2]]


def test_sampling_without_a_seed_draws_one_per_request_and_run(engine, tmp_path):
    request = ("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 8, "temperature": 1.0})
    seeded = ("/v1/completions", {**request[1], "seed": 7})
    first, _ = serve(engine, tmp_path, [request, request, seeded, seeded], name="a.jsonl")
    second, _ = serve(engine, tmp_path, [request, seeded], name="b.jsonl")
    bodies = [ok(r) for r in first + second]
    drawn = [bodies[0], bodies[1], bodies[4]]
    assert len({b["seed"] for b in drawn}) == 3  # per request and per run
    assert len({tuple(b["choices"][0]["token_ids"]) for b in drawn}) == 3
    for b in bodies:  # the recorded seed reproduces the result
        assert b["choices"][0]["token_ids"] == engine.generate([[5, 6, 7]], 8, temperature=1.0, seed=b["seed"],
                                                               stop_token_ids=engine.config.eos_token_ids)[0]
    assert bodies[2]["seed"] == bodies[3]["seed"] == bodies[5]["seed"] == 7
    assert bodies[2]["choices"] == bodies[3]["choices"] == bodies[5]["choices"]


def test_resume_refuses_results_made_with_other_settings(engine, tmp_path):
    requests = [("/v1/completions", {"prompt": [5, 6], "max_tokens": 2})]
    rows, _ = serve(engine, tmp_path, requests, settings={"model": "a", "dtype": "float32"})
    before = (tmp_path / "out.jsonl").read_bytes()
    with pytest.raises(SettingsMismatch, match="1 result made with other settings"):
        serve(engine, tmp_path, requests, settings={"model": "a", "dtype": "bfloat16"})
    assert (tmp_path / "out.jsonl").read_bytes() == before
    _, summary = serve(engine, tmp_path, requests, settings={"model": "a", "dtype": "float32"})
    assert summary["requests_resumed"] == 1 and (tmp_path / "out.jsonl").read_bytes() == before


def test_settings_name_the_model_files_dtype_and_kernels(tmp_path):
    from launch.serve import parse_args
    from moejax.serving.load_engine import model_identity, run_settings
    copy = tmp_path / "m"
    shutil.copytree(QWEN3, copy)
    args = parse_args(["--input", "x", "--model", str(copy)])
    a = run_settings(args, moejax.load(str(copy), dtype="float32"))
    b = run_settings(args, moejax.load(str(copy), dtype="bfloat16"))
    assert a != b and a["dtype"] == "float32" and b["dtype"] == "bfloat16" and "experts auto: xla" in a["kernels"]
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    assert model_identity(str(copy)) != a["model"]  # same path, other model


def test_the_planner_counts_a_row_per_choice():
    from moejax.requests.parse import CompletionRequest
    from moejax.sched.batch_schedule import pack_completion_batches
    reqs = [CompletionRequest(i, f"c{i}", (1,) * 10, 6, SamplingParams(seed=0), (), (), n=4) for i in range(4)]
    # each row caches 16 + 16 tokens: 8 rows, two requests of 4 choices, fill a 256-token batch
    assert [len(b.requests) for b in pack_completion_batches(reqs, max_batch_tokens=256)] == [2, 2]


@pytest.mark.slow  # two serve runs (about 19 s)
def test_choices_continue_a_prefix_cached_by_an_earlier_batch(engine, tmp_path):
    shared = list(range(5, 40))  # two full 16-token blocks
    requests = [("/v1/completions", {"prompt": shared + [40 + i], "max_tokens": 3, "n": 2, "temperature": 0.8,
                                     "seed": i}) for i in range(3)]
    rows, summary = serve(engine, tmp_path, requests, kv_cache="on", max_batch_tokens=64)  # one request a batch
    assert summary["batches_planned"] == 3 and summary["cached_prompt_tokens"] == 2 * 32
    for i, row in enumerate(rows):
        want = engine.generate([shared + [40 + i]] * 2, 3, temperature=0.8, seed=i)
        assert [c["token_ids"] for c in ok(row)["choices"]] == want
