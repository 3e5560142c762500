"""Options defined once: an option's default, type, allowed values, help and command-line flag live in the metadata
of its frozen dataclass field (`option(...)`). The checks (`check`, `check_flags`), the argparse flags
(`add_arguments`), the settings a journal fingerprints or --explain lists (`settings`) and the table in docs/options.md
(`markdown_table`) are derived from it."""
from __future__ import annotations

import argparse
import dataclasses
import math
import numbers
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance  # typeshed's, for type checkers only
import sys

_KEY = "moejax.option"
T = TypeVar("T")
D = TypeVar("D", bound="DataclassInstance")


def option(default: T, help: str, *, type: type | None = None, choices: Iterable[object] | None = None,
           minimum: float | None = None, above: float | None = None, maximum: float | None = None,
           flag: bool = True, path: bool = False,
           fingerprint: bool | str = False, checked: bool = True, applies: tuple[str, str] | None = None,
           old_name: str | None = None) -> T:
    """A dataclass field that is an option. type: int, float, str or bool (default: the default's type; give it
    when the default is None); choices: the values allowed; minimum / above: the value must be >= / > it; maximum:
    <= it (a share: minimum 0, maximum 1);
    flag: launch.serve has a flag for it (`--` and the name, `_` as `-`); path: a file or directory (the journal
    records its identity); fingerprint: it decides results (the journal records it; "given": only when not None, so
    that adding it leaves the fingerprints of journals written before unchanged); checked: False when the
    class checks the value itself (it takes more than the choices); applies: (another option, the value of it this
    one applies to): given (not None or False), this option needs that one to have that value or "auto"; old_name:
    the name it had before a rename, still taken for one release with a warning (`renamed`, add_arguments)."""
    kind = type if type is not None else _type_of(default)
    about = dict(help=help, type=kind, choices=tuple(choices) if choices is not None else None, minimum=minimum,
                 above=above, maximum=maximum, flag=flag, path=path, fingerprint=fingerprint, checked=checked,
                 applies=applies, old_name=old_name)
    return dataclasses.field(default=default, metadata={_KEY: about})


def _type_of(default: object) -> type:
    for kind in (bool, int, float, str):  # bool first: a bool is an int too
        if isinstance(default, kind):
            return kind
    raise TypeError(f"option: give type= for the default {default!r}")


def meta(f: dataclasses.Field) -> dict | None:
    """The option's metadata, or None when the field is not an option."""
    return f.metadata.get(_KEY)


def _about(f: dataclasses.Field) -> dict:
    """The metadata of a field that `fields` returned (an option's, so never None)."""
    m = meta(f)
    assert m is not None, f"{f.name} is not an option"
    return m


def fields(cls: DataclassInstance | type[DataclassInstance]) -> list[dataclasses.Field]:
    """The fields of `cls` (a dataclass or an instance) that are options, in order."""
    return [f for f in dataclasses.fields(cls) if meta(f) is not None]


def flag_of(f: dataclasses.Field) -> str:
    return "--" + f.name.replace("_", "-")


def bound(m: dict) -> str | None:
    """The range as text ('>= 16', '> 0', 'in [0, 1]', '<= 1'), or None."""
    if m["maximum"] is not None:
        if m["minimum"] is not None:
            return f"in [{m['minimum']}, {m['maximum']}]"
        return f"in ({m['above']}, {m['maximum']}]" if m["above"] is not None else f"<= {m['maximum']}"
    if m["minimum"] is not None:
        return f">= {m['minimum']}"
    return f"> {m['above']}" if m["above"] is not None else None


def allowed(m: dict) -> str:
    """What the option takes, as text: 'an int >= 1', 'one of python, jit', 'a number > 0', ..."""
    if m["choices"] is not None:
        return f"one of {', '.join(map(str, m['choices']))}"
    what = {int: "an int", float: "a number", bool: "True or False", str: "a path" if m["path"] else "text"}[m["type"]]
    return f"{what} {bound(m)}" if bound(m) else what


def _in_range(m: dict, value: float | numbers.Real) -> bool:
    if not math.isfinite(value):
        return False
    if m["minimum"] is not None and value < m["minimum"]:
        return False
    if m["maximum"] is not None and value > m["maximum"]:
        return False
    return m["above"] is None or value > m["above"]


def _fits(m: dict, value: object) -> bool:
    """None means not given, and passes; else the value has the option's type, choice and range."""
    if value is None or not m["checked"]:
        return True
    if m["choices"] is not None:
        return value in m["choices"]
    kind = m["type"]
    if kind is bool:
        return isinstance(value, bool)
    if kind in (int, float):
        number = numbers.Integral if kind is int else numbers.Real  # numpy's scalars too
        return isinstance(value, number) and not isinstance(value, bool) and _in_range(m, value)
    return True  # a string without choices (a path, a layout spec): its user checks it


def check(instance: DataclassInstance, prefix: str = "") -> None:
    """ValueError naming the first option of `instance` whose value does not fit: '<prefix><name> must be an int
    >= 1, got 0'), or given where the option it applies with has another value ('<prefix>window applies to
    placement 'streamed', not 'cached'')."""
    for f in fields(instance):
        m, value = _about(f), getattr(instance, f.name)
        if not _fits(m, value):
            raise ValueError(f"{prefix}{f.name} must be {allowed(m)}, got {value!r}")
        if m["applies"] is not None and value not in (None, False):
            other, needed = m["applies"]
            if getattr(instance, other) not in ("auto", needed):
                raise ValueError(f"{prefix}{f.name} applies to {other} {needed!r}, not {getattr(instance, other)!r}")


def not_applying(instance: DataclassInstance, other: str, value: object) -> list[tuple[dataclasses.Field, object]]:
    """The options of `instance` that are given (not None or False) but apply to another value of option `other`
    than `value` (what `auto` chose): (the field, the value it applies to)."""
    out = []
    for f in fields(instance):
        m, given = _about(f), getattr(instance, f.name)
        if m["applies"] is not None and given not in (None, False) and m["applies"][0] == other \
                and m["applies"][1] != value:
            out.append((f, m["applies"][1]))
    return out


def renamed(cls: DataclassInstance | type[DataclassInstance]) -> dict[str, str]:
    """{old name: new name} of the options of `cls` that were renamed (still taken, with a warning)."""
    return {m["old_name"]: f.name for f in fields(cls) if (m := _about(f))["old_name"]}


def renamed_note(old: str, new: str, flags: bool = False) -> str:
    """The warning an old option name gives."""
    if flags:
        old, new = "--" + old.replace("_", "-"), "--" + new.replace("_", "-")
    return f"{old} is renamed {new}; the old name is accepted for this release only"


class _OldFlag(argparse.Action):
    """An option's flag before its rename: sets the new one, with a warning on stderr."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(f"note: {renamed_note(str(option_string).lstrip('-'), self.dest, flags=True)}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def check_flags(args: argparse.Namespace, *classes: type[DataclassInstance]) -> str | None:
    """The first flag of `classes` whose parsed value is out of range, as a message naming the flag; None when all
    are fine. argparse has already checked the types and the choices."""
    for cls in classes:
        for f in fields(cls):
            m, value = _about(f), getattr(args, f.name, None)
            if not m["flag"] or value is None or m["type"] not in (int, float) or _in_range(m, value):
                continue
            if not math.isfinite(value):
                return f"{flag_of(f)} must be a finite number; got {value}"
            return f"{flag_of(f)} must be {bound(m)}; got {value}"
    return None


def as_flags(message: str, *classes: type[DataclassInstance]) -> str:
    """A message that names options as Python does (moejax.load's keywords: `default_vectors`, `predictor 'router'`,
    `speculative=True`, `resident_share must ...`) with the flags of `classes` instead (`--default-vectors`,
    `--predictor router`, `--speculative`, `--resident-share must ...`), for a user who typed flags. A name with an
    underscore is always an option; a one-word name (placement, predictor, layout) only where it is used as one: at
    the start, after "needs", or followed by its value."""
    names = sorted({f.name for cls in classes for f in fields(cls) if _about(f)["flag"]}, key=len, reverse=True)
    if not names:
        return message
    alternatives = "|".join(map(re.escape, names))
    flag = lambda name: "--" + name.replace("_", "-")  # noqa: E731

    def valued(m: re.Match) -> str:
        value = m.group(2) if m.group(2) is not None else m.group(3)
        return flag(m.group(1)) + ("" if value == "True" else f" {value}")
    message = re.sub(rf"(?<![\w-])({alternatives})(?:=|\s)(?:'([^']*)'|(True|False|-?[\d.]+(?:e-?\d+)?)\b)", valued,
                     message)
    message = re.sub(rf"(^|(?<=needs ))({alternatives})\b", lambda m: flag(m.group(2)), message)
    return re.sub(rf"(?<![\w-])({'|'.join(re.escape(n) for n in names if '_' in n)})\b",
                  lambda m: flag(m.group(1)), message) if any("_" in n for n in names) else message


def add_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type[DataclassInstance],
                  names: tuple[str, ...] | None = None) -> None:
    """A flag for each option of `cls` that has one (only `names`, in that order, when given): its default, type,
    choices and help."""
    by_name = {f.name: f for f in fields(cls)}
    for name in names if names is not None else by_name:
        f = by_name[name]
        m = _about(f)
        if not m["flag"]:
            continue
        text = m["help"].replace("%", "%%")  # argparse formats help with %
        if m["type"] is bool:
            parser.add_argument(flag_of(f), action="store_true", help=text)
            continue
        parser.add_argument(flag_of(f), default=f.default, help=text,
                            **({"choices": m["choices"]} if m["choices"] is not None else {}),
                            **({"type": m["type"]} if m["type"] in (int, float) else {}))
        if m["old_name"]:  # the flag before a rename, unlisted
            parser.add_argument("--" + m["old_name"].replace("_", "-"), dest=f.name, action=_OldFlag,
                                help=argparse.SUPPRESS, **({"choices": m["choices"]} if m["choices"] else {}),
                                **({"type": m["type"]} if m["type"] in (int, float) else {}))


def from_args(cls: type[D], args: argparse.Namespace, **overrides: Any) -> D:
    """An instance of `cls` from the parsed flags of its options (the others at their defaults)."""
    given = {f.name: getattr(args, f.name) for f in fields(cls) if _about(f)["flag"] and hasattr(args, f.name)}
    return cls(**{**given, **overrides})


def settings(instance: DataclassInstance, *, fingerprint: bool = False) -> dict:
    """{name: value} of the options of `instance` (with fingerprint=True, only those that decide results)."""
    if not fingerprint:
        return {f.name: getattr(instance, f.name) for f in fields(instance)}
    return {f.name: getattr(instance, f.name) for f in fields(instance) if _about(f)["fingerprint"] is True or
            (_about(f)["fingerprint"] == "given" and getattr(instance, f.name) is not None)}


def paths(cls: DataclassInstance | type[DataclassInstance]) -> set[str]:
    """The options of `cls` that name a file or directory."""
    return {f.name for f in fields(cls) if _about(f)["path"]}


def describe(instance: DataclassInstance) -> str:
    """The options' values in one line: 'kv_cache auto, prefix_cache_mb 1024.0, ...'."""
    return ", ".join(f"{k} {v}" for k, v in settings(instance).items())


def markdown_table(*classes: type[DataclassInstance]) -> str:
    """A Markdown table of the flags of `classes`: flag, default (blank: none, or off), what it takes, help."""
    lines = ["| flag | default | takes | what it does |", "|---|---|---|---|"]
    for cls in classes:
        for f in fields(cls):
            m = _about(f)
            if m["flag"]:
                takes = "a switch" if m["type"] is bool else allowed(m)
                default = "" if f.default is None or f.default is False else f"`{f.default}`"
                text = m["help"].replace("|", "\\|")
                lines.append(f"| `{flag_of(f)}` | {default} | {takes} | {text} |")
    return "\n".join(lines)
