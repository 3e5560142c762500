"""Hypothesis helpers shared by the request-parser and batch-runner property tests: damaged request lines."""
import json

from hypothesis import strategies as st

REQUEST_KEYS = ["custom_id", "method", "url", "body", "prompt", "prompt_token_ids", "candidates",
                "candidate_token_ids", "suffixes", "max_tokens", "temperature", "top_p", "seed", "stop",
                "stop_token_ids", "n", "model"]


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
