import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from garbage import damage

from moejax.sched.requests import (
    BadLine, Candidate, CompletionRequest, ScoreRequest, parse_line, parse_lines,
)

TOKENIZER = Tokenizer.from_file(os.path.join(os.path.dirname(__file__), "fixtures", "qwen3_moe", "tokenizer.json"))
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
    assert r == CompletionRequest(7, "r1", tuple(TOKENIZER.encode("hello").ids), 16, 0.0, 1.0, 0, (), ())


def test_completion_all_fields_and_openai_keys():
    r = complete({"prompt_token_ids": [5], "max_tokens": 3, "temperature": 1, "top_p": 0.5, "seed": -4,
                  "stop": ["\n", "end"], "stop_token_ids": [0, 255], "model": "anything", "n": 1, "user": "u"})
    assert r == CompletionRequest(7, "r1", (5,), 3, 1.0, 0.5, -4, ("\n", "end"), (0, 255))
    assert isinstance(r.temperature, float)
    assert complete({"prompt_token_ids": [5], "stop": "x"}).stop == ("x",)


def test_null_means_absent_and_method_may_be_missing():
    r = complete({"prompt_token_ids": [5], "stop": None, "temperature": None, "prompt": None})
    assert r.stop == () and r.temperature == 0.0
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
     "url: must be a string, one of /v1/score, /v1/completions; got a list"),
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
    ({**SCORE_OK, "n": 2}, "body.n: must be 1; got 2"),
    ({**SCORE_OK, "n": True}, "body.n: must be 1; got true"),
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
    ({**COMPLETE_OK, "stop": 5}, "body.stop: must be a string or a list of strings; got 5"),
    ({**COMPLETE_OK, "stop": ""}, "body.stop: must be a non-empty string; got ''"),
    ({**COMPLETE_OK, "stop": ["a", ""]}, "body.stop[1]: must be a non-empty string; got ''"),
    ({**COMPLETE_OK, "stop": ["a", 1]}, "body.stop[1]: must be a non-empty string; got 1"),
    ({**COMPLETE_OK, "stop_token_ids": 3}, "body.stop_token_ids: must be a list of token ids; got 3"),
    ({**COMPLETE_OK, "stop_token_ids": [3, 256]}, "body.stop_token_ids[1]: token id 256 outside"),
    ({**COMPLETE_OK, "stop_token_ids": [None]}, "body.stop_token_ids[0]: must be a token id (int); got null"),
    ({**COMPLETE_OK, "n": 3}, "body.n: must be 1; got 3"),
])
def test_bad_completion_body(body, expected):
    assert error(complete(body)).startswith(expected)


def test_completion_context_limit():
    body = {"prompt_token_ids": [1] * 10, "max_tokens": 6}
    assert isinstance(complete(body, max_context=16), CompletionRequest)
    assert error(complete(body, max_context=15)) == (
        "body: prompt 10 + max_tokens 6 = 16 tokens exceed the model's context of 15")
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
]


@st.composite
def mutated_valid_line(draw):
    return damage(draw, json.loads(json.dumps(draw(st.sampled_from(VALID)))), json_values)


garbage_line = st.one_of(st.text(max_size=40), json_values.map(json.dumps), mutated_valid_line(),
                         st.sampled_from(VALID).map(json.dumps))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(garbage_line, max_size=8), st.sampled_from([TOKENIZER, None]))
def test_garbage_never_raises_and_keeps_line_numbers(lines, tokenizer):
    out = parse_lines(lines, tokenizer=tokenizer, vocab_size=VOCAB, max_context=CONTEXT)
    assert len(out) == len(lines)
    for n, entry in enumerate(out, start=1):
        assert entry.line == n
        assert isinstance(entry, (ScoreRequest, CompletionRequest, BadLine))
        if isinstance(entry, BadLine):
            assert entry.message
