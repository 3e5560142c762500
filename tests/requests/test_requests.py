import json
import os

import pytest
from garbage import FORMAT_EXAMPLES, damage
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from moejax.chat import ChatTemplate
from moejax.requests.parse import (
    MAX_N,
    BadLine,
    Candidate,
    CompletionRequest,
    ScoreRequest,
    parse_line,
    parse_lines,
)
from moejax.sampling import SamplingParams

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "qwen3_moe")
TOKENIZER = Tokenizer.from_file(os.path.join(FIXTURE, "tokenizer.json"))
CHAT = ChatTemplate.from_dir(FIXTURE)
VOCAB = 256
CONTEXT = 64
LIMITS = dict(vocab_size=VOCAB, max_context=CONTEXT)


def line(body, url="/v1/score", custom_id="r1", **envelope):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body, **envelope})


def parse(text, tokenizer=TOKENIZER, **limits):
    return parse_line(text, 7, tokenizer=tokenizer, **{**LIMITS, **limits})


def score(body, **kw):
    return parse(line(body), **kw)


def complete(body, **kw):
    return parse(line(body, url="/v1/completions"), **kw)


def error(result) -> str:
    assert isinstance(result, BadLine), result
    return result.message


def text_ids(text):
    return tuple(TOKENIZER.encode(text, add_special_tokens=False).ids)


# ---- valid forms ----------------------------------------------------------------------------

def test_score_with_text_tokenizes_like_the_tokenizer():
    r = score({"prompt": "hello world", "candidates": ["hello", " world"]})
    assert isinstance(r, ScoreRequest)
    assert r.line == 7 and r.custom_id == "r1"
    assert r.prompt == tuple(TOKENIZER.encode("hello world").ids)
    assert r.candidates == (Candidate("hello", text_ids("hello")), Candidate(" world", text_ids(" world")))
    assert r.suffixes == () and r.contexts == (r.prompt,) and r.prompt_tokens == len(r.prompt)


def test_score_with_token_ids():
    r = score({"prompt_token_ids": [1, 2, 3], "candidate_token_ids": [[4], [5, 6]]})
    assert r == ScoreRequest(7, "r1", (1, 2, 3), (), (Candidate(None, (4,)), Candidate(None, (5, 6))))


def test_score_suffixes_mixed_text_and_ids():
    r = score({"prompt_token_ids": [1, 2], "candidate_token_ids": [[9]], "suffixes": [" yes", [3, 4, 5]]})
    assert r.suffixes == (text_ids(" yes"), (3, 4, 5))
    assert r.contexts == ((1, 2) + text_ids(" yes"), (1, 2, 3, 4, 5))
    assert r.prompt_tokens == 2 * 2 + len(text_ids(" yes")) + 3


def test_completion_defaults():
    r = complete({"prompt": "hello"})
    assert r == CompletionRequest(7, "r1", tuple(TOKENIZER.encode("hello").ids), 16, SamplingParams(), (), (),
                                 prompt_text="hello")  # seed None: the runner draws one


def test_completion_all_fields_and_openai_keys():
    r = complete({"prompt_token_ids": [5], "max_tokens": 3, "temperature": 1, "top_p": 0.5, "seed": -4,
                  "stop": ["\n", "end"], "stop_token_ids": [0, 255], "model": "anything", "n": 1, "user": "u"})
    assert r == CompletionRequest(7, "r1", (5,), 3, SamplingParams(1.0, 0.5, seed=-4), ("\n", "end"), (0, 255),
                                  model="anything")
    assert isinstance(r.sampling.temperature, float)
    assert complete({"prompt_token_ids": [5], "stop": "x"}).stop == ("x",)


@pytest.mark.parametrize("top_k, min_p", [(0, 0), (-1, 0.0), (1, 1), (40, 0.05), (10**30, 0.5)])
def test_top_k_and_min_p_are_sampling_fields(top_k, min_p):
    body = {"top_k": top_k, "min_p": min_p, "temperature": 0.5}
    assert complete({"prompt_token_ids": [5], **body}).sampling == SamplingParams(0.5, top_k=top_k, min_p=min_p)
    r = chat({"messages": [{"role": "user", "content": "fox"}], **body})
    assert (r.sampling.top_k, r.sampling.min_p) == (top_k, min_p)


def test_null_means_absent_and_method_may_be_missing():
    r = complete({"prompt_token_ids": [5], "stop": None, "temperature": None, "prompt": None})
    assert r.stop == () and r.sampling.temperature == 0.0
    ok = parse(json.dumps({"custom_id": "a", "url": "/v1/score",
                           "body": {"prompt_token_ids": [1], "candidate_token_ids": [[2]]}}))
    assert isinstance(ok, ScoreRequest)


def test_token_ids_without_a_tokenizer():
    r = score({"prompt_token_ids": [1], "candidate_token_ids": [[2]], "suffixes": [[3]]}, tokenizer=None)
    assert isinstance(r, ScoreRequest)
    assert isinstance(complete({"prompt_token_ids": [1], "stop_token_ids": [2]}, tokenizer=None), CompletionRequest)


def test_requests_are_frozen():
    r = score({"prompt_token_ids": [1], "candidate_token_ids": [[2]]})
    with pytest.raises(AttributeError):
        r.prompt = (3,)


# ---- bad lines -------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("{", "not JSON: Expecting property name"),
    ("nope", "not JSON: Expecting value (char 0)"),
    ("[" * 100_000, "not JSON"),
    ('{"a": ' + "9" * 5000 + "}", "not JSON"),
    ("[1, 2]", "not a JSON object; got a list"),
    ('"x"', "not a JSON object; got 'x'"),
    ("   ", "empty line"),
    ("", "empty line"),
])
def test_unreadable_lines(text, expected):
    r = parse(text)
    assert error(r).startswith(expected) and r.custom_id is None and r.line == 7


@pytest.mark.parametrize("envelope, expected", [
    ({"url": "/v1/score", "body": {}}, "custom_id: missing"),
    ({"custom_id": "", "url": "/v1/score", "body": {}}, "custom_id: must be a non-empty string; got ''"),
    ({"custom_id": 3, "url": "/v1/score", "body": {}}, "custom_id: must be a non-empty string; got 3"),
    ({"custom_id": "a", "method": "GET", "url": "/v1/score", "body": {}}, "method: must be 'POST'; got 'GET'"),
    ({"custom_id": "a", "url": "/v1/chat", "body": {}},
     "url '/v1/chat': unknown; expected one of /v1/score, /v1/completions"),
    ({"custom_id": "a", "body": {}}, "url: missing"),
    ({"custom_id": "a", "url": ["/v1/score"], "body": {}},
     "url: must be a string, one of /v1/score, /v1/completions, /v1/chat/completions, /generative_scoring; got a list"),
    ({"custom_id": "a", "url": "/v1/score"}, "body: missing"),
    ({"custom_id": "a", "url": "/v1/score", "body": [1]}, "body: must be a JSON object; got a list"),
    ({"custom_id": "a", "url": "/v1/score", "bdy": {}}, "unknown key 'bdy' (did you mean 'body'?)"),
])
def test_bad_envelope(envelope, expected):
    assert error(parse(json.dumps(envelope))).startswith(expected)


def test_bad_line_keeps_a_readable_custom_id():
    assert parse(line({}, url="/nope", custom_id="keep")).custom_id == "keep"
    assert parse(line({}, custom_id=5)).custom_id is None


SCORE_OK = {"prompt_token_ids": [1, 2], "candidate_token_ids": [[3]]}


@pytest.mark.parametrize("body, expected", [
    ({"candidate_token_ids": [[3]]}, "body: needs exactly one of prompt, prompt_token_ids"),
    ({**SCORE_OK, "prompt": "hi"}, "body: needs exactly one of prompt, prompt_token_ids"),
    ({"prompt_token_ids": [1]}, "body: needs exactly one of candidates, candidate_token_ids"),
    ({**SCORE_OK, "candidates": ["a"]}, "body: needs exactly one of candidates, candidate_token_ids"),
    ({**SCORE_OK, "prompt_token_ids": []},
     "body.prompt_token_ids: must be a non-empty list of token ids; got an empty list"),
    ({**SCORE_OK, "prompt_token_ids": "1 2"}, "body.prompt_token_ids: must be a non-empty list"),
    ({**SCORE_OK, "prompt_token_ids": [1, True]}, "body.prompt_token_ids[1]: must be a token id (int); got true"),
    ({**SCORE_OK, "prompt_token_ids": [1, 2.0]}, "body.prompt_token_ids[1]: must be a token id (int); got 2.0"),
    ({**SCORE_OK, "prompt_token_ids": [1, 256]},
     "body.prompt_token_ids[1]: token id 256 outside the vocabulary [0, 256)"),
    ({**SCORE_OK, "prompt_token_ids": [-1]}, "body.prompt_token_ids[0]: token id -1 outside"),
    ({"prompt": "", "candidate_token_ids": [[3]]}, "body.prompt: must be a non-empty string; got ''"),
    ({"prompt": 5, "candidate_token_ids": [[3]]}, "body.prompt: must be a non-empty string; got 5"),
    ({"prompt": "\u00e9", "candidate_token_ids": [[3]]}, "body.prompt: '\u00e9' tokenizes to no tokens"),
    ({"prompt": "a\ud800", "candidate_token_ids": [[3]]}, "body.prompt: not valid Unicode text"),
    ({**SCORE_OK, "candidate_token_ids": []}, "body.candidate_token_ids: must be a non-empty list of token id lists"),
    ({**SCORE_OK, "candidate_token_ids": [[3], []]},
     "body.candidate_token_ids[1]: must be a non-empty list of token ids"),
    ({**SCORE_OK, "candidate_token_ids": [[3], 4]}, "body.candidate_token_ids[1]: must be a non-empty list"),
    ({**SCORE_OK, "candidate_token_ids": [[3], [4], [5, False]]}, "body.candidate_token_ids[2][1]: must be a token id"),
    ({**SCORE_OK, "candidate_token_ids": [[3], [4], [999]]}, "body.candidate_token_ids[2][0]: token id 999 outside"),
    ({"prompt_token_ids": [1], "candidates": []},
     "body.candidates: must be a non-empty list of strings; got an empty list"),
    ({"prompt_token_ids": [1], "candidates": "abc"}, "body.candidates: must be a non-empty list of strings; got 'abc'"),
    ({"prompt_token_ids": [1], "candidates": ["a", ""]}, "body.candidates[1]: must be a non-empty string; got ''"),
    ({"prompt_token_ids": [1], "candidates": ["a", ["b"]]},
     "body.candidates[1]: must be a non-empty string; got a list"),
    ({"prompt_token_ids": [1], "candidates": ["a", "b", "\u00e9"]},
     "body.candidates[2]: '\u00e9' tokenizes to no tokens"),
    ({**SCORE_OK, "suffixes": []}, "body.suffixes: must be a non-empty list of strings or token id lists"),
    ({**SCORE_OK, "suffixes": "x"}, "body.suffixes: must be a non-empty list"),
    ({**SCORE_OK, "suffixes": [[1], []]}, "body.suffixes[1]: must be a non-empty list of token ids"),
    ({**SCORE_OK, "suffixes": [[1], ""]}, "body.suffixes[1]: must be a non-empty string or token id list; got ''"),
    ({**SCORE_OK, "suffixes": [3]}, "body.suffixes[0]: must be a non-empty string or token id list; got 3"),
    ({**SCORE_OK, "suffixes": [[1, 300]]}, "body.suffixes[0][1]: token id 300 outside"),
    ({**SCORE_OK, "suffixes": ["\u00e9"]}, "body.suffixes[0]: '\u00e9' tokenizes to no tokens"),
    ({**SCORE_OK, "max_tokens": 3}, "body: unknown key 'max_tokens'; known: prompt, prompt_token_ids, candidates"),
    ({**SCORE_OK, "n": 2}, "body.n: must be 1 for scoring; got 2"),
    ({**SCORE_OK, "n": True}, "body.n: must be 1 for scoring; got true"),
])
def test_bad_score_body(body, expected):
    assert error(score(body)).startswith(expected)


def test_score_context_limit():
    # prompt 4 + longest suffix 3 + longest candidate 5 - 1 = 11: the last candidate token is never fed.
    body = {"prompt_token_ids": [1] * 4, "suffixes": [[2], [2] * 3], "candidate_token_ids": [[3], [3] * 5]}
    assert isinstance(score(body, max_context=11), ScoreRequest)
    assert error(score(body, max_context=10)) == (
        "body: prompt 4 + longest suffix 3 + longest candidate 5 - 1 = 11 tokens exceed the model's context of 10")
    no_suffix = {"prompt_token_ids": [1] * 4, "candidate_token_ids": [[3] * 5]}
    assert isinstance(score(no_suffix, max_context=8), ScoreRequest)
    assert "exceed the model's context of 7" in error(score(no_suffix, max_context=7))


COMPLETE_OK = {"prompt_token_ids": [1, 2]}


@pytest.mark.parametrize("body, expected", [
    ({"max_tokens": 3}, "body: needs exactly one of prompt, prompt_token_ids"),
    ({**COMPLETE_OK, "max_token": 3}, "body: unknown key 'max_token' (did you mean 'max_tokens'?); known: prompt,"),
    ({**COMPLETE_OK, "max_token": 3, "zzz": 1}, "body: unknown keys 'max_token' (did you mean 'max_tokens'?), 'zzz'"),
    ({**COMPLETE_OK, "candidates": ["a"]}, "body: unknown key 'candidates'"),
    ({**COMPLETE_OK, "max_tokens": -3}, "body.max_tokens: must be an int >= 1; got -3"),
    ({**COMPLETE_OK, "max_tokens": 0}, "body.max_tokens: must be an int >= 1; got 0"),
    ({**COMPLETE_OK, "max_tokens": 2.5}, "body.max_tokens: must be an int >= 1; got 2.5"),
    ({**COMPLETE_OK, "max_tokens": True}, "body.max_tokens: must be an int >= 1; got true"),
    ({**COMPLETE_OK, "max_tokens": "4"}, "body.max_tokens: must be an int >= 1; got '4'"),
    ({**COMPLETE_OK, "temperature": -0.5}, "body.temperature: must be >= 0; got -0.5"),
    ({**COMPLETE_OK, "temperature": "hot"}, "body.temperature: must be a finite number; got 'hot'"),
    ({**COMPLETE_OK, "temperature": False}, "body.temperature: must be a finite number; got false"),
    ({**COMPLETE_OK, "temperature": float("nan")}, "body.temperature: must be a finite number; got NaN"),
    ({**COMPLETE_OK, "temperature": 10**400}, "body.temperature: must be a finite number; got 1000"),
    ({**COMPLETE_OK, "top_p": 0}, "body.top_p: must be in (0, 1]; got 0.0"),
    ({**COMPLETE_OK, "top_p": 1.5}, "body.top_p: must be in (0, 1]; got 1.5"),
    ({**COMPLETE_OK, "top_p": float("inf")}, "body.top_p: must be a finite number; got Infinity"),
    ({**COMPLETE_OK, "seed": 1.5}, "body.seed: must be an int in [-2**63, 2**63); got 1.5"),
    ({**COMPLETE_OK, "seed": 2**63}, "body.seed: must be an int in [-2**63, 2**63); got 9223372036854775808"),
    ({**COMPLETE_OK, "top_k": -2}, "body.top_k: must be an int >= 1, or 0 or -1 (all tokens); got -2"),
    ({**COMPLETE_OK, "top_k": 2.5}, "body.top_k: must be an int >= 1, or 0 or -1 (all tokens); got 2.5"),
    ({**COMPLETE_OK, "top_k": True}, "body.top_k: must be an int >= 1, or 0 or -1 (all tokens); got true"),
    ({**COMPLETE_OK, "min_p": 1.5}, "body.min_p: must be in [0, 1]; got 1.5"),
    ({**COMPLETE_OK, "min_p": -0.1}, "body.min_p: must be in [0, 1]; got -0.1"),
    ({**COMPLETE_OK, "min_p": "0.1"}, "body.min_p: must be a finite number; got '0.1'"),
    ({**COMPLETE_OK, "stop": 5}, "body.stop: must be a string or a list of strings; got 5"),
    ({**COMPLETE_OK, "stop": ""}, "body.stop: must be a non-empty string; got ''"),
    ({**COMPLETE_OK, "stop": ["a", ""]}, "body.stop[1]: must be a non-empty string; got ''"),
    ({**COMPLETE_OK, "stop": ["a", 1]}, "body.stop[1]: must be a non-empty string; got 1"),
    ({**COMPLETE_OK, "stop_token_ids": 3}, "body.stop_token_ids: must be a list of token ids; got 3"),
    ({**COMPLETE_OK, "stop_token_ids": [3, 256]}, "body.stop_token_ids[1]: token id 256 outside"),
    ({**COMPLETE_OK, "stop_token_ids": [None]}, "body.stop_token_ids[0]: must be a token id (int); got null"),
    ({**COMPLETE_OK, "n": 0}, "body.n: must be an int in [1, 128]; got 0"),
    ({**COMPLETE_OK, "n": MAX_N + 1}, f"body.n: must be an int in [1, {MAX_N}]; got {MAX_N + 1}"),
])
def test_bad_completion_body(body, expected):
    assert error(complete(body)).startswith(expected)


def test_completion_context_limit():
    body = {"prompt_token_ids": [1] * 10, "max_tokens": 6}
    assert isinstance(complete(body, max_context=16), CompletionRequest)
    assert error(complete(body, max_context=15)) == (
        "body.max_tokens: prompt 10 + max_tokens 6 = 16 tokens exceed the model's context of 15; send at most 5")
    # The default max_tokens (16) counts too.
    assert "max_tokens 16 = 26 tokens exceed" in error(complete({"prompt_token_ids": [1] * 10}, max_context=25))


@pytest.mark.parametrize("parse_as, body, expected", [
    (score, {"prompt": "hi", "candidate_token_ids": [[1]]},
     "body.prompt: model has no tokenizer; send prompt_token_ids"),
    (score, {"prompt_token_ids": [1], "candidates": ["a"]},
     "body.candidates: model has no tokenizer; send candidate_token_ids"),
    (score, {**SCORE_OK, "suffixes": [[1], "x"]}, "body.suffixes[1]: model has no tokenizer; send token ids"),
    (complete, {"prompt": "hi"}, "body.prompt: model has no tokenizer; send prompt_token_ids"),
    (complete, {**COMPLETE_OK, "stop": "x"}, "body.stop: model has no tokenizer; use stop_token_ids"),
    (complete, {**COMPLETE_OK, "stop": ["x"]}, "body.stop: model has no tokenizer; use stop_token_ids"),
])
def test_text_without_a_tokenizer(parse_as, body, expected):
    assert error(parse_as(body, tokenizer=None)) == expected


def test_tokenizer_ids_beyond_the_model_vocabulary():
    # The fixture tokenizer has 256 ids; a model with a smaller embedding must not receive the extra ones.
    big = max(TOKENIZER.encode("hello world").ids)
    message = error(complete({"prompt": "hello world"}, vocab_size=big))
    assert message.startswith(f"body.prompt: tokenizer gave id {big}, outside the model's vocabulary [0, {big})")


# ---- parse_lines -----------------------------------------------------------------------------

def test_parse_lines_one_entry_per_line_and_duplicates():
    good = {"prompt_token_ids": [1], "candidate_token_ids": [[2]]}
    lines = [line(good, custom_id="a"), "", line(good, custom_id="b"), line(good, custom_id="a"),
             "garbage", line({"bad": 1}, custom_id="c"), line(good, custom_id="c")]
    out = parse_lines(lines, tokenizer=TOKENIZER, **LIMITS)
    assert [r.line for r in out] == list(range(1, 8))
    assert [type(r).__name__ for r in out] == ["ScoreRequest", "BadLine", "ScoreRequest", "BadLine",
                                               "BadLine", "BadLine", "BadLine"]
    assert out[0].custom_id == "a" and out[1].message == "empty line"
    assert out[3] == BadLine(4, "a", "custom_id 'a' duplicates line 1")
    # The first line with a custom_id keeps it even when that line is itself bad.
    assert out[6] == BadLine(7, "c", "custom_id 'c' duplicates line 6")


def test_parse_lines_accepts_file_lines_with_newlines():
    good = line({"prompt_token_ids": [1], "max_tokens": 1}, url="/v1/completions")
    out = parse_lines([good + "\n", "\n"], tokenizer=TOKENIZER, **LIMITS)
    assert isinstance(out[0], CompletionRequest) and out[1].message == "empty line"


# ---- property: garbage never raises, never shifts lines --------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
VALID = [
    {"custom_id": "s", "url": "/v1/score",
     "body": {"prompt": "hello", "candidates": ["a", "b"], "suffixes": [" x", [1, 2]]}},
    {"custom_id": "c", "method": "POST", "url": "/v1/completions",
     "body": {"prompt_token_ids": [1, 2], "max_tokens": 4, "temperature": 0.7, "top_p": 0.9, "seed": 1,
              "stop": ["\n"], "stop_token_ids": [3]}},
    *FORMAT_EXAMPLES,
]


@st.composite
def mutated_valid_line(draw):
    return damage(draw, json.loads(json.dumps(draw(st.sampled_from(VALID)))), json_values)


garbage_line = st.one_of(st.text(max_size=40), json_values.map(json.dumps), mutated_valid_line(),
                         st.sampled_from(VALID).map(json.dumps))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(garbage_line, max_size=8), st.sampled_from([(TOKENIZER, CHAT), (TOKENIZER, None), (None, None)]))
def test_garbage_never_raises_and_keeps_line_numbers(lines, model):
    tokenizer, chat_template = model
    out = parse_lines(lines, tokenizer=tokenizer, vocab_size=VOCAB, max_context=CONTEXT, chat=chat_template)
    assert len(out) == len(lines)
    for n, entry in enumerate(out, start=1):
        assert entry.line == n
        assert isinstance(entry, (ScoreRequest, CompletionRequest, BadLine))
        if isinstance(entry, BadLine):
            assert entry.message
            assert entry.param is None or entry.param in entry.message


def test_the_format_examples_are_valid():
    out = parse_lines([json.dumps(x) for x in FORMAT_EXAMPLES], tokenizer=TOKENIZER, chat=CHAT, **LIMITS)
    assert not [e for e in out if isinstance(e, BadLine)], out


# ---- the formats of OpenAI, vLLM and SGLang --------------------------------------------------------------------

def chat(body, **kw):
    return parse(line(body, url="/v1/chat/completions"), chat=CHAT, **kw)


def test_completion_prompt_as_token_list_or_list_of_one():
    assert complete({"prompt": [5, 6, 7]}).prompt == (5, 6, 7)
    assert complete({"prompt": [[5, 6]]}).prompt == (5, 6)
    r = complete({"prompt": ["hello"]})
    assert r.prompt == tuple(TOKENIZER.encode("hello").ids) and r.prompt_text == "hello"
    assert error(complete({"prompt": ["a", "b"]})) == "body.prompt: a list of 2 prompts; send one prompt per line"
    assert error(complete({"prompt": [5, 999]})).startswith("body.prompt[1]: token id 999 outside the vocabulary")


def test_completion_choices_logprobs_and_echo():
    r = complete({"prompt": "hello", "n": 3, "best_of": 3, "logprobs": 5, "echo": True, "max_tokens": 0})
    assert (r.n, r.logprobs, r.echo, r.max_tokens) == (3, 5, True, 0)
    assert error(complete({"prompt": "hello", "max_tokens": 0})) == "body.max_tokens: must be an int >= 1; got 0"
    assert error(complete({"prompt": "hello", "logprobs": 21})).startswith("body.logprobs: must be an int in [0, 20]")
    assert error(complete({"prompt": "hello", "echo": 1})) == "body.echo: must be true or false; got 1"
    assert error(complete({"prompt": "hello", "n": 2, "best_of": 3})).startswith("body.best_of: 3 is not supported")


@pytest.mark.parametrize("field, default", [
    ("frequency_penalty", 0), ("presence_penalty", 0.0), ("stream", False), ("logit_bias", {}), ("min_tokens", 0),
    ("repetition_penalty", 1), ("stream_options", {"include_usage": True}), ("metadata", {"a": "b"}),
    ("response_format", {"type": "text"}), ("service_tier", "auto"), ("suffix", ""),
])
def test_harmless_defaults_pass_and_other_values_are_refused(field, default):
    assert isinstance(complete({"prompt": "hello", field: default}), CompletionRequest)
    assert isinstance(chat({"messages": [{"role": "user", "content": "fox"}], field: default}), CompletionRequest)
    other = {dict: {"x": 1} if field not in ("stream_options", "metadata") else [1], bool: True, str: "zzz"}.get(
        type(default), 0.5)
    message = error(complete({"prompt": "hello", field: other}))
    assert message.startswith(f"body.{field}: ") and "is not supported" in message, message


def test_stream_zero_is_not_false():
    assert "body.stream: 0 is not supported" in error(complete({"prompt": "hello", "stream": 0}))


def test_chat_renders_like_transformers():
    reference = json.load(open(os.path.join(FIXTURE, "chat_reference.json")))
    for case in reference["cases"]:
        r = chat({"messages": case["messages"], "chat_template_kwargs": case["chat_template_kwargs"]}, max_context=256)
        if "error" in case:  # the template's raise_exception
            assert error(r) == "body.messages: the model's chat template refused them: Unknown role: tool"
            continue
        assert r.prompt == tuple(case["token_ids"]) and r.prompt_text == case["text"], case
        assert r.chat and r.max_tokens == 256 - len(r.prompt)  # default: the rest of the context


def test_chat_fields():
    msgs = [{"role": "user", "content": "fox"}]
    r = chat({"messages": msgs, "max_completion_tokens": 4, "logprobs": True, "top_logprobs": 3, "n": 2, "seed": 5,
              "temperature": 0.7, "stop": ["x"]})
    assert (r.max_tokens, r.logprobs, r.n, r.sampling.seed, r.sampling.temperature, r.stop) == (4, 3, 2, 5, 0.7, ("x",))
    assert chat({"messages": msgs, "logprobs": True}).logprobs == 0
    assert chat({"messages": msgs, "logprobs": False}).logprobs is None
    assert error(chat({"messages": msgs, "top_logprobs": 2})) == "body.top_logprobs: needs logprobs: true"
    assert error(chat({"messages": msgs, "max_tokens": 2, "max_completion_tokens": 2})).startswith(
        "body: give max_tokens or max_completion_tokens")


@pytest.mark.parametrize("messages, message", [
    ([], "body.messages: must be a non-empty list of messages"),
    ("hi", "body.messages: must be a non-empty list of messages"),
    ([{"content": "x"}], "body.messages[0].role: must be a non-empty string"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "body.messages[0].content[0]: only text parts"),
    ([{"role": "user", "content": 3}], "body.messages[0].content: must be a string or a list of text parts"),
    ([{"role": "user"}], "body.messages[0].content: missing"),
    ([{"role": "user", "content": "x", "name": 3}], "body.messages[0].name: must be a string"),
    ([{"role": "user", "content": "\ud800"}], "body.messages[0]: not valid Unicode text"),
])
def test_bad_chat_messages(messages, message):
    assert error(chat({"messages": messages})).startswith(message)


def test_chat_without_a_template_is_a_400_naming_it():
    r = parse(line({"messages": [{"role": "user", "content": "fox"}]}, url="/v1/chat/completions"))
    assert error(r).startswith("body.messages: this model has no chat template") and r.param == "messages"


def test_sglang_score_joins_query_and_items_as_sglang_does():
    r = score({"query": "The clever", "items": [" fox", " robot"], "label_token_ids": [3, 4], "apply_softmax": True})
    assert r.prompt == () and r.labels == "softmax"
    assert r.contexts == (tuple(TOKENIZER.encode("The clever fox").ids),
                          tuple(TOKENIZER.encode("The clever robot").ids))
    assert r.candidates == (Candidate(None, (3,)), Candidate(None, (4,)))
    first = score({"query": [1, 2], "items": [[3], [4, 5]], "label_token_ids": [9], "item_first": True})
    assert first.contexts == ((3, 1, 2), (4, 5, 1, 2)) and first.labels == "probs"
    assert score({"query": "The", "items": " fox", "label_token_ids": [3]}).contexts == (
        tuple(TOKENIZER.encode("The fox").ids),)


def test_vllm_generative_scoring_joins_token_ids_as_vllm_does():
    r = parse(line({"query": "The clever", "items": [" fox", [7, 8]], "label_token_ids": [3, 4]},
                   url="/generative_scoring"))
    query = tuple(TOKENIZER.encode("The clever").ids)
    assert r.contexts == (query + text_ids(" fox"), query + (7, 8)) and r.labels == "vllm-softmax"
    r = parse(line({"query": [1, 2], "items": [[3]], "label_token_ids": [3], "apply_softmax": False,
                    "item_first": True, "priority": 0}, url="/generative_scoring"))
    assert r.contexts == ((3, 1, 2),) and r.labels == "vllm-probs"
    assert error(parse(line({"query": "a", "items": "b", "label_token_ids": [3]}, url="/generative_scoring"))
                 ).startswith("body.items: must be a non-empty list")


@pytest.mark.parametrize("body, message", [
    ({"query": "a", "items": ["b"]}, "body.label_token_ids: missing"),
    ({"query": [1], "items": ["b"], "label_token_ids": [3]}, "body.items[0]: must be a token id list, as the query"),
    ({"query": "a", "items": [[1]], "label_token_ids": [3]}, "body.items[0]: must be a string, as the query is"),
    ({"query": "a", "items": ["b"], "label_token_ids": [300]}, "body.label_token_ids[0]: token id 300 outside"),
    ({"query": "a", "items": [], "label_token_ids": [3]}, "body.items: must be a non-empty list"),
    ({"query": "a", "items": ["b"], "label_token_ids": [3], "apply_softmax": "yes"},
     "body.apply_softmax: must be true or false"),
    ({"query": "a", "items": ["b"], "label_token_ids": [3], "prompt": "c"}, "body: unknown key 'prompt'"),
])
def test_bad_sglang_score(body, message):
    assert error(score(body)).startswith(message)


def test_bad_line_names_the_param():
    assert complete({"prompt": "hello", "max_tokens": -1}).param == "max_tokens"
    assert parse("{").param is None
    assert parse(json.dumps({"custom_id": "a", "url": "/v2", "body": {}})).param == "url"


@pytest.mark.parametrize("body, message", [
    ({"chat_template_kwargs": {"messages": []}}, "body.chat_template_kwargs: may not set messages"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "body.chat_template_kwargs: may not set add_gen"),
    ({"chat_template_kwargs": []}, "body.chat_template_kwargs: must be an object"),
])
def test_chat_template_kwargs_cannot_break_the_parser(body, message):
    assert error(chat({"messages": [{"role": "user", "content": "fox"}], **body})).startswith(message)


def test_a_template_that_fails_on_a_message_is_a_clear_error():
    failing = ChatTemplate("{{ messages[0]['content'] + 1 }}")
    r = parse(line({"messages": [{"role": "user", "content": "fox"}]}, url="/v1/chat/completions"), chat=failing)
    assert error(r).startswith("body.messages: the model's chat template failed on them: TypeError")


def test_templates_see_tools_and_documents_as_none_as_in_transformers():
    template = ChatTemplate("{% if tools is none and documents is none %}plain{% endif %} {{ messages[0]['content'] }}")
    assert template.render([{"role": "user", "content": "fox"}]) == "plain fox"
