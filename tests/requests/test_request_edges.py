"""Requests at the edges: lm-eval's loglikelihood request (echo, logprobs, max_tokens 0) under continuous
batching and the KV pool's size; refusals that name the field at fault and say all of what is wrong."""
import json

import numpy as np
import pytest

import moejax
from moejax.sched.batch import serve_lines
from moejax.sched.pool_size import PoolTooLarge, pool_size
from moejax.sched.serving_options import ServingOptions

TINY = "tiny-qwen3-moe"  # no tokenizer, vocab 1024, context 2048
QWEN3_CONTEXT = 256  # tests/fixtures/qwen3_moe: a tokenizer and a chat template


@pytest.fixture(scope="module")
def tiny():
    return moejax.load(TINY, dtype="float32")


def line(cid, url, body) -> str:
    return json.dumps({"custom_id": cid, "url": url, "body": body})


def served(engine, tmp_path, lines, name, **kw) -> list[dict]:
    """kw: ServingOptions."""
    out = tmp_path / name
    serve_lines(engine, lines, str(out), ServingOptions(**kw), seed_nonce=0)
    return [json.loads(x) for x in out.read_text().splitlines()]


def assert_same(got, want, where="body") -> None:
    """Equal JSON, log-probabilities within float32 rounding (static batching scores these prompts in one padded
    batch, continuous batching each on its own), everything else exactly; `created` is the time."""
    if isinstance(want, dict):
        assert sorted(set(got) - {"created"}) == sorted(set(want) - {"created"}), where
        for k in set(want) - {"created"}:
            assert_same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{where}[{i}]")
    elif isinstance(want, float):
        assert got == pytest.approx(want, abs=1e-5), where
    else:
        assert got == want, where


@pytest.mark.slow  # both batchings compiled (about 20 s); test_continuous compares them in the fast tier
def test_loglikelihood_requests_under_continuous_batching_equal_static(tiny, tmp_path):
    """Echo with logprobs and max_tokens 0 (prompts of 2 and 3 KV blocks) beside a request that generates (whose
    one block is all the pool is sized for): continuous batching serves them, with the default pool and with a
    given --kv-pool-mb, exactly as static batching does."""
    rng = np.random.default_rng(30)
    prompts = [rng.integers(1, 1024, size=n).tolist() for n in (17, 40, 5)]
    lines = [line("ll-17", "/v1/completions", {"prompt": prompts[0], "max_tokens": 0, "echo": True, "logprobs": 1}),
             line("ll-40", "/v1/completions", {"prompt": prompts[1], "max_tokens": 0, "echo": True, "logprobs": 1}),
             line("gen", "/v1/completions", {"prompt": prompts[2], "max_tokens": 3, "seed": 1})]
    static = served(tiny, tmp_path, lines, "static.jsonl", batching="static")
    assert [r["response"]["status_code"] for r in static] == [200, 200, 200]
    echoed = static[1]["response"]["body"]["choices"][0]
    assert len(echoed["logprobs"]["token_logprobs"]) == 40 and echoed["token_ids"] == []
    for kv_pool_mb in (None, 64.0):
        rows = served(tiny, tmp_path, lines, f"continuous-{kv_pool_mb}.jsonl", kv_pool_mb=kv_pool_mb)
        assert [r["response"]["status_code"] for r in rows] == [200, 200, 200], rows
        assert_same([r["response"]["body"] for r in rows], [r["response"]["body"] for r in static])


def test_a_given_pool_size_is_kept_or_refused_with_the_reason(tiny):
    """A given size is cut only to what the run's sequences can hold at once, and says so; one too small for some
    sequence says how many need more; one the device cannot hold beside the weights is refused, saying why."""
    block_bytes = tiny.kv_bytes_per_token() * 16
    mb = 100 * block_bytes / 2**20  # 100 blocks
    sized = pool_size(tiny, [(40, 8), (5, 3)], kv_pool_mb=mb)
    assert sized.blocks == 3 + 1 and "= 100 blocks; capped at the 4 these 2 sequences" in sized.source
    small = pool_size(tiny, [(40, 8), (5, 3)], kv_pool_mb=2 * block_bytes / 2**20)
    assert small.blocks == 2 and "1 of 2 sequences need more (up to 3 blocks" in small.source
    only_echo = pool_size(tiny, [], kv_pool_mb=mb)
    assert only_echo.blocks == 1 and "max_tokens 0 only" in only_echo.source

    capped = moejax.load(TINY, dtype="float32", device_memory_gb=1.05 * tiny.param_bytes() / 2**30)
    room = capped.memory_budget.budget_bytes - capped.memory_budget.device_bytes
    assert 0 < room < 100 * block_bytes
    assert pool_size(capped, [(40, 8)], kv_pool_mb=mb).blocks == 3  # the run uses 3 blocks: they fit
    with pytest.raises(PoolTooLarge, match=r"--kv-pool-mb .*: the device budget .* leaves .* too little"):
        pool_size(capped, [(1000, 1000)] * 4, kv_pool_mb=mb)


def chat_prompt_tokens(engine, messages) -> int:
    text = engine.chat_template.render(messages, add_generation_prompt=True)
    return len(engine.tokenizer.encode(text, add_special_tokens=False).ids)


def filling_messages(engine) -> list[dict]:
    """One user message whose rendered prompt is exactly the fixture's context."""
    words = ["the fox"]
    while chat_prompt_tokens(engine, [{"role": "user", "content": " ".join(words + ["a"])}]) <= QWEN3_CONTEXT:
        words.append("a")
    for tail in ("", "b", "ab", "cd"):
        messages = [{"role": "user", "content": " ".join(words) + tail}]
        if chat_prompt_tokens(engine, messages) == QWEN3_CONTEXT:
            return messages
    pytest.fail("no message renders to exactly the context")


def error_of(row) -> dict:
    assert row["response"]["status_code"] == 400, row
    return row["response"]["body"]["error"]


def test_a_prompt_that_fills_the_context_is_refused_for_its_messages(qwen3_engine, tmp_path):
    """Chat without max_tokens: the refusal names the messages (param) and says the prompt's length and the
    context's, not a max_tokens the request did not send; a completion's default max_tokens is called one."""
    fills = filling_messages(qwen3_engine)
    longer = [{"role": "user", "content": fills[0]["content"] + " more words"}]
    over = chat_prompt_tokens(qwen3_engine, longer)
    lines = [line("fills", "/v1/chat/completions", {"messages": fills}),
             line("longer", "/v1/chat/completions", {"messages": longer, "max_completion_tokens": 4}),
             line("default", "/v1/completions", {"prompt_token_ids": [5] * (QWEN3_CONTEXT - 4)})]
    fills_error, longer_error, default_error = map(error_of, served(qwen3_engine, tmp_path, lines, "out.jsonl"))
    assert fills_error["param"] == "messages"
    assert fills_error["message"] == (
        f"body.messages: the prompt's {QWEN3_CONTEXT} tokens (the messages rendered by the chat template) fill the "
        f"model's context of {QWEN3_CONTEXT}, leaving no room for a completion; shorten the messages")
    assert longer_error["param"] == "messages" and "max_tokens" not in longer_error["message"].replace(
        "max_completion_tokens", "")
    assert f"the prompt's {over} tokens" in longer_error["message"] and "max_completion_tokens 4" in \
        longer_error["message"]
    assert default_error["message"] == (
        f"body: prompt {QWEN3_CONTEXT - 4} + max_tokens 16 = {QWEN3_CONTEXT + 12} tokens exceed the model's "
        f"context of {QWEN3_CONTEXT} (max_tokens 16 is the default, as none was given: send at most 4)")


def test_refusals_are_complete_sentences(qwen3_engine, tmp_path):
    """A tools refusal names the tools instead of cutting their JSON off; a long bad string keeps its quotes."""
    tools = [{"type": "function", "function": {"name": name, "description": f"{name} of a place",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}
             for name in ("get_weather", "get_time")]
    hi = [{"role": "user", "content": "hi"}]
    lines = [line("tools", "/v1/chat/completions", {"messages": hi, "tools": tools}),
             line("choice", "/v1/chat/completions", {"messages": hi, "tool_choice": {
                 "type": "function", "function": {"name": "get_weather"}}}),
             line("string", "/v1/chat/completions", {"messages": hi, "max_tokens": "many " * 20})]
    tools_error, choice_error, string_error = map(error_of, served(qwen3_engine, tmp_path, lines, "out.jsonl"))
    assert tools_error["param"] == "tools" and tools_error["message"] == (
        "body.tools: a list of 2 items (get_weather, get_time) is not supported; moejax accepts only [] (the "
        "default, which changes nothing): drop the field or use that value")
    shown = choice_error["message"].split(": ", 1)[1].split(" is not supported")[0]
    assert json.loads(shown) == {"type": "function", "function": {"name": "get_weather"}}  # whole, as JSON
    assert string_error["message"] == (
        f"body.max_tokens: must be an int >= 1; got {('many ' * 6)!r}... (100 characters)")


def test_serve_refuses_a_pool_the_device_cannot_hold_by_its_flag(tiny, tmp_path):
    """launch.serve names --kv-pool-mb and why, instead of a traceback (the plan loads no weights)."""
    from launch.serve import main
    requests = tmp_path / "in.jsonl"
    requests.write_text(line("c", "/v1/completions", {"prompt": list(range(1, 900)), "max_tokens": 900}) + "\n")
    budget = 1.05 * tiny.param_bytes() / 2**30
    with pytest.raises(SystemExit, match=r"^--kv-pool-mb 4096.0: .*the device budget .* too little"):
        main(["--input", str(requests), "--model", TINY, "--dtype", "float32", "--device-memory-gb", str(budget),
              "--kv-pool-mb", "4096", "--explain"])
