"""Checks of one JSON field of a request line; each failure is an Invalid whose message starts with the field's
path (`body.max_tokens: must be ...`), which the line's 400 names."""
from __future__ import annotations

import difflib
import json
import math
from typing import TypeGuard


class Invalid(Exception):
    """Aborts parsing of one line; becomes its BadLine."""


def reject_unknown(obj: dict, known: tuple[str, ...], where: str, accepted: tuple[str, ...] = ()) -> None:
    """known: the keys to list in the message; accepted: more keys that pass (not listed)."""
    unknown = sorted(k for k in obj if k not in known and k not in accepted)
    if not unknown:
        return
    hints = []
    for k in unknown:
        close = difflib.get_close_matches(k, known, n=1, cutoff=0.7)  # 0.6 pairs max_tokens with prompt_token_ids
        hints.append(f"{k!r} (did you mean {close[0]!r}?)" if close else repr(k))
    raise Invalid(f"{where + ': ' if where else ''}unknown key{'s' if len(unknown) > 1 else ''} {', '.join(hints)}; "
                  f"known: {', '.join(known)}")


def flag(body: dict, key: str, default: bool) -> bool:
    value = body.get(key, default)
    if not isinstance(value, bool):
        raise Invalid(f"body.{key}: must be true or false; got {show(value)}")
    return value


def nonempty_list(value: object, path: str, of: str) -> list:
    if not isinstance(value, list) or not value:
        raise Invalid(f"{path}: must be a non-empty list of {of}; got {show(value)}")
    return value


def string_field(value: object, path: str, what: str = "a non-empty string") -> str:
    if not isinstance(value, str) or not value:
        raise Invalid(f"{path}: must be {what}; got {show(value)}")
    try:
        value.encode("utf-8")  # JSON "\ud800" escapes decode to lone surrogates the tokenizer rejects
    except UnicodeEncodeError:
        raise Invalid(f"{path}: not valid Unicode text (lone surrogate)") from None
    return value


def number(value: object, path: str) -> float:
    # JSON parsing accepts NaN, Infinity and 400-digit ints; none is a usable sampling parameter.
    if is_int(value) or isinstance(value, float):
        number = float(value) if abs(value) < 1e300 else math.inf
        if math.isfinite(number):
            return number
    raise Invalid(f"{path}: must be a finite number; got {show(value)}")


def is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true is not 1


def show(value: object, limit: int = 40) -> str:
    """A short rendering of a bad value: scalars as JSON literals (strings quoted), containers by kind. A long one
    is cut where it stays readable: a string keeps its quotes and says how long it was."""
    if isinstance(value, list):
        return "an empty list" if not value else "a list"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, str):
        shown = repr(value)
        return shown if len(shown) <= limit else f"{value[:limit - 10]!r}... ({len(value)} characters)"
    shown = json.dumps(value)
    return shown if len(shown) <= limit else f"{shown[:limit - 10]}... ({len(shown)} characters)"
