"""Every served body parses as the `openai` package's own response models: Completion (with
logprobs, echo, n > 1, and lm-eval's echo-only scoring), ChatCompletion (with logprobs, n > 1), and the batch output
line around them, an error line included."""
import json

import pydantic
import pytest

openai_types = pytest.importorskip("openai.types")  # the test extra (pyproject.toml); not a runtime dependency
from openai.types import BatchError, Completion, CompletionChoice, ErrorObject  # noqa: E402
from openai.types.chat import ChatCompletion  # noqa: E402
from openai.types.completion_choice import Logprobs  # noqa: E402

from moejax.requests.bodies import Bodies, Choice  # noqa: E402
from moejax.requests.parse import CompletionRequest  # noqa: E402
from moejax.sampling import SamplingParams  # noqa: E402
from moejax.sched.batch import serve_lines  # noqa: E402


class BatchResponse(pydantic.BaseModel):
    status_code: int
    request_id: str
    body: dict


class BatchRequestOutput(pydantic.BaseModel):
    """A line of a batch's output file as OpenAI's API reference gives it ("The request output object"); the
    openai package has a model for the Batch job (openai.types.Batch) and its errors, not for these lines."""
    model_config = pydantic.ConfigDict(extra="allow")  # moejax's `line` on failed lines
    id: str
    custom_id: str
    response: BatchResponse | None
    error: BatchError | None


class ErrorBody(pydantic.BaseModel):
    error: ErrorObject


# OpenAI's API answers an echoed prompt's first token with null in token_logprobs and top_logprobs (there is nothing
# before it to predict it from), as vLLM does and lm-eval reads; the package's Logprobs types those lists' items as
# non-null. These three models are the package's own with only that changed.
class EchoLogprobs(Logprobs):
    token_logprobs: list[float | None] | None = None
    top_logprobs: list[dict[str, float] | None] | None = None


class EchoChoice(CompletionChoice):
    logprobs: EchoLogprobs | None = None


class EchoCompletion(Completion):
    choices: list[EchoChoice]


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The clever fox?"}]
REQUESTS = [
    ("/v1/completions", {"prompt": "The clever fox", "max_tokens": 4, "echo": True, "logprobs": 3}),
    ("/v1/completions", {"prompt": [5, 6, 7, 8], "max_tokens": 5, "n": 3, "temperature": 0.9, "seed": 3,
                         "logprobs": 2, "stop": ["e"]}),
    ("/v1/completions", {"prompt": "The clever fox", "max_tokens": 0, "echo": True, "logprobs": 1}),  # lm-eval's
    ("/v1/completions", {"prompt": "A small river", "max_tokens": 3}),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 4, "logprobs": True, "top_logprobs": 2,
                              "n": 2, "temperature": 0.7, "seed": 1}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 3}),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}),  # refused: an error line
]


@pytest.fixture(scope="module")
def lines(qwen3_engine, tmp_path_factory):
    out = tmp_path_factory.mktemp("openai") / "out.jsonl"
    inputs = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": url, "body": body})
              for i, (url, body) in enumerate(REQUESTS)]
    serve_lines(qwen3_engine, inputs, str(out))
    return [json.loads(x) for x in out.read_text().splitlines()]


def test_every_output_line_is_a_batch_request_output(lines):
    assert len(lines) == len(REQUESTS)
    for i, line in enumerate(lines):
        parsed = BatchRequestOutput.model_validate(line)
        assert parsed.custom_id == f"r{i}"
    refused = BatchRequestOutput.model_validate(lines[-1])
    assert refused.response.status_code == 400 and refused.error.code and refused.error.message
    error = ErrorBody.model_validate(refused.response.body).error
    assert error.type == "invalid_request_error" and error.param == "max_tokens" and error.message


@pytest.mark.parametrize("i", [0, 1, 2, 3])
def test_completion_bodies_are_openai_completions(lines, i):
    body = lines[i]["response"]["body"]
    url, request = REQUESTS[i]
    echoed = request.get("echo") and request.get("logprobs") is not None
    completion = (EchoCompletion if echoed else Completion).model_validate(body)
    assert completion.object == "text_completion" and len(completion.choices) == request.get("n", 1)
    assert completion.usage.prompt_tokens > 0
    for choice in completion.choices:
        if request.get("logprobs") is None:
            assert choice.logprobs is None
            continue
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
        if echoed:  # only the first token has no log-probability
            assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
            assert None not in lp.token_logprobs[1:] and None not in lp.top_logprobs[1:]
    if not echoed and request.get("logprobs") is not None:
        assert Completion.model_validate(body)  # the package's model, unchanged


@pytest.mark.parametrize("i", [4, 5])
def test_chat_bodies_are_openai_chat_completions(lines, i):
    body = lines[i]["response"]["body"]
    request = REQUESTS[i][1]
    chat = ChatCompletion.model_validate(body)
    assert chat.object == "chat.completion" and len(chat.choices) == request.get("n", 1)
    for choice in chat.choices:
        assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
        if request.get("logprobs"):
            assert len(choice.logprobs.content) == len(body["choices"][choice.index]["token_ids"])
            assert all(len(t.top_logprobs) == request["top_logprobs"] for t in choice.logprobs.content)
            assert all(t.bytes is not None for t in choice.logprobs.content)
        else:
            assert choice.logprobs is None


def test_a_model_without_tokenizer_answers_text_as_a_string():
    """A preset without a tokenizer (token ids in, token ids out): `text` is "" (vLLM's without detokenizing), not
    null, and the tokens are named token_id:N."""
    req = CompletionRequest(1, "c", (5, 6, 7), 2, SamplingParams(seed=0), (), (), logprobs=1, echo=True)
    choice = Choice([8, 9], "length", [-0.1, -0.2], [[(8, -0.1)], [(9, -0.2)]])
    body = Bodies(None, "preset", "fp").completion(req, "1", [(choice, None)], 0,
                                                   ([-1.0, -2.0], [[(6, -1.0)], [(7, -2.0)]]))
    completion = EchoCompletion.model_validate(body)
    assert completion.choices[0].text == ""
    assert completion.choices[0].logprobs.tokens == [f"token_id:{t}" for t in (5, 6, 7, 8, 9)]
