"""Hypothesis helpers shared by the request-parser and batch-runner property tests: damaged request lines."""
import json

from hypothesis import strategies as st

REQUEST_KEYS = ["custom_id", "method", "url", "body", "prompt", "prompt_token_ids", "candidates",
                "candidate_token_ids", "suffixes", "max_tokens", "temperature", "top_p", "seed", "stop",
                "stop_token_ids", "n", "model", "logprobs", "echo", "best_of", "messages", "max_completion_tokens",
                "top_logprobs", "chat_template_kwargs", "query", "items", "label_token_ids", "apply_softmax",
                "item_first", "add_special_tokens", "frequency_penalty", "stream", "logit_bias"]

# Valid lines of the newer formats for a model with a tokenizer and a chat template (the qwen3_moe fixture)
FORMAT_EXAMPLES = [
    {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "m", "messages": [{"role": "system", "content": "Every robot sings."},
                                         {"role": "user", "content": [{"type": "text", "text": "The fox"}]}],
              "max_completion_tokens": 3, "logprobs": True, "top_logprobs": 2, "n": 2, "temperature": 0.5,
              "seed": 3, "frequency_penalty": 0, "stream": False}},
    {"custom_id": "cmpl", "url": "/v1/completions",
     "body": {"prompt": [5, 6, 7], "max_tokens": 2, "logprobs": 1, "echo": True, "n": 2, "best_of": 2,
              "presence_penalty": 0.0, "user": "u"}},
    {"custom_id": "echo", "url": "/v1/completions", "body": {"prompt": "The clever fox", "max_tokens": 0,
                                                             "echo": True, "logprobs": 0}},
    {"custom_id": "sglang", "url": "/v1/score",
     "body": {"query": "The clever", "items": [" fox", " robot"], "label_token_ids": [3, 4], "apply_softmax": True}},
    {"custom_id": "sglang-ids", "url": "/v1/score",
     "body": {"query": [5, 6], "items": [[7], [8, 9]], "label_token_ids": [3], "item_first": True}},
    {"custom_id": "vllm", "url": "/generative_scoring",
     "body": {"query": "The clever", "items": [" fox", [7]], "label_token_ids": [3, 4], "apply_softmax": False}},
]


def damage(draw, obj: dict, values, *, rewrite: bool = True) -> str:
    """A request object as a line, with up to 3 envelope/body keys dropped or set to drawn `values` (when
    `rewrite`), then maybe cut or spliced as text."""
    if rewrite:
        for _ in range(draw(st.integers(1, 3))):
            target = obj["body"] if draw(st.booleans()) and isinstance(obj.get("body"), dict) else obj
            key = draw(st.sampled_from(REQUEST_KEYS))
            if draw(st.booleans()):
                target.pop(key, None)
            else:
                target[key] = draw(values)
    text = json.dumps(obj, allow_nan=True)
    if draw(st.booleans()):  # textual damage: cut or splice the line
        i = draw(st.integers(0, len(text)))
        text = text[:i] + draw(st.text(max_size=3)) + text[i + draw(st.integers(0, 3)):]
    return text
