"""OpenAI and vLLM request fields that moejax does not implement. Batch files written by clients carry them at
their defaults (`"frequency_penalty": 0`, `"stream": false`, ...): those are accepted and change nothing. Any
other value would ask for a result moejax does not compute, so it is refused with a message naming the field."""
from __future__ import annotations

import json

from moejax.requests.fields import Invalid

_ANY_OBJECT = "any object"
_ANY_BOOL = "true or false"

# field -> the values that mean "not used" (numbers compare by value, booleans by identity: JSON 0 is not false)
NO_OPS: dict[str, tuple | str] = {
    "frequency_penalty": (0,), "presence_penalty": (0,), "repetition_penalty": (1,),
    "min_tokens": (0,),
    "stream": (False,), "stream_options": _ANY_OBJECT, "logit_bias": ({},), "suffix": ("",),
    "ignore_eos": (False,), "skip_special_tokens": (True,), "spaces_between_special_tokens": (True,),
    "include_stop_str_in_output": (False,), "service_tier": ("auto", "default"), "store": (False,),
    "metadata": _ANY_OBJECT, "response_format": ({"type": "text"},), "tools": ([],), "tool_choice": ("none", "auto"),
    "parallel_tool_calls": _ANY_BOOL,
}
NO_OP_KEYS = tuple(NO_OPS)


def check_no_ops(body: dict, known: tuple[str, ...]) -> None:
    """Raise Invalid naming the first no-op field of `body` (one the endpoint does not itself use) whose
    value is not one of its defaults."""
    for key, allowed in NO_OPS.items():
        if key not in body or key in known:
            continue
        value = body[key]
        if allowed == _ANY_OBJECT and isinstance(value, dict) or allowed == _ANY_BOOL and isinstance(value, bool):
            continue
        if isinstance(allowed, tuple) and any(_same(value, a) for a in allowed):
            continue
        shown = " or ".join(_json(a) for a in allowed) if isinstance(allowed, tuple) else allowed
        raise Invalid(f"body.{key}: {brief(value)} is not supported; moejax accepts only {shown} (the "
                      "default, which changes nothing): drop the field or use that value")


def brief(value: object, limit: int = 80) -> str:
    """A value as JSON when that is short, else a complete summary of it (never JSON cut off mid-way): a list by
    its length and the names of its items (tools name their functions), an object by its keys."""
    text = _json(value)
    if len(text) <= limit:
        return text
    if isinstance(value, list):
        names = [n for n in map(_name, value) if n]
        named = f" ({', '.join(names)})" if names and len(names) == len(value) else ""
        return f"a list of {len(value)} item{'s' if len(value) != 1 else ''}{named}"
    if isinstance(value, dict):
        name = _name(value)
        return f"an object with keys {', '.join(map(_json, value))}" + (f" (naming {name})" if name else "")
    if isinstance(value, str):
        return f"{_json(value[:limit // 2])[:-1]}...\" ({len(value)} characters)"
    return f"{text[:limit // 2]}... ({len(text)} characters)"


def _name(item: object) -> str | None:
    """What a tool, function or tool choice is called: its "name", or its function's."""
    if not isinstance(item, dict):
        return None
    inner = item.get("function")
    name = inner.get("name") if isinstance(inner, dict) else item.get("name")
    return name if isinstance(name, str) and name else None


def _same(value: object, default: object) -> bool:
    if isinstance(default, bool) or isinstance(value, bool):
        return value is default
    if isinstance(default, (int, float)):
        return isinstance(value, (int, float)) and value == default
    return value == default


def _json(value: object) -> str:
    return json.dumps(value)
