"""Chat templates: a checkpoint's Jinja2 template (tokenizer_config.json's `chat_template`, or
`chat_template.jinja`) rendered as transformers' `apply_chat_template` renders it: a sandboxed environment with
trim_blocks, lstrip_blocks and loop controls, `raise_exception`, `strftime_now`, a `tojson` that does not escape
HTML, the tokenizer's special tokens as variables, and `add_generation_prompt`."""
from __future__ import annotations

import datetime
import json
import os
from collections.abc import Callable
from typing import Any, NoReturn

import jinja2
import jinja2.parser
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, object] | None = None):
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self._template = _compile(source)

    @classmethod
    def from_dir(cls, path: str) -> ChatTemplate | None:
        """The checkpoint's template (chat_template.jinja wins, as in transformers), or None when it has none."""
        config = _read_json(os.path.join(path, "tokenizer_config.json"))
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        jinja_file = os.path.join(path, "chat_template.jinja")
        if os.path.exists(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                source = f.read()
        if not isinstance(source, str) or not source:
            return None
        return cls(source, _special_tokens(config))

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True, kwargs: dict | None = None
               ) -> str:
        """messages: OpenAI chat messages -> the prompt text; kwargs: more template variables (vLLM's
        chat_template_kwargs). Raises ValueError naming the bad field."""
        kwargs = kwargs or {}
        taken = sorted({"messages", "add_generation_prompt"} & set(kwargs))
        if taken:
            raise ValueError(f"body.chat_template_kwargs: may not set {', '.join(taken)} (fields of the request)")
        # As transformers: tools and documents are None unless given; request kwargs override special tokens.
        variables = {"tools": None, "documents": None, **self.special_tokens, **kwargs}
        messages = _messages(messages)
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as e:
            raise ValueError(f"body.messages: the model's chat template refused them: {e}") from None
        except Exception as e:  # a template doing arithmetic on a field it did not expect, say
            raise ValueError(f"body.messages: the model's chat template failed on them: {type(e).__name__}: {e}") \
                from None


def _messages(messages: object) -> list[dict]:  # body.messages as JSON gave it
    """Check the OpenAI message shape; text content parts are joined into one string (vLLM's default)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("body.messages: must be a non-empty list of messages")
    out = []
    for i, m in enumerate(messages):
        where = f"body.messages[{i}]"
        if not isinstance(m, dict):
            raise ValueError(f"{where}: must be an object with role and content")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"{where}.role: must be a non-empty string")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, dict) else None
                    raise ValueError(f"{where}.content[{j}]: only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                                     f"are supported; got {kind!r}")
                texts.append(part["text"])
            content = "\n".join(texts)
        elif content is not None and not isinstance(content, str):
            raise ValueError(f"{where}.content: must be a string or a list of text parts")
        elif content is None and role != "assistant":
            raise ValueError(f"{where}.content: missing")
        if "name" in m and not isinstance(m["name"], str):
            raise ValueError(f"{where}.name: must be a string")
        for text in filter(None, [content, m.get("name")]):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(f"{where}: not valid Unicode text (lone surrogate)") from None
        out.append({**m, "content": content})
    return out


def _compile(source: str) -> jinja2.Template:
    class GenerationTag(Extension):
        """transformers' `{% generation %}...{% endgeneration %}` (marks assistant tokens): rendered as its body."""
        tags = {"generation"}

        def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Callable[[], str]) -> str:
            return caller()

    def raise_exception(message: str) -> NoReturn:
        raise jinja2.TemplateError(message)

    def tojson(x: object, ensure_ascii: bool = False, indent: int | str | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat template: Jinja syntax error at line {e.lineno}: {e.message}") from None


def _special_tokens(config: dict) -> dict:
    """bos_token, eos_token, ... as strings (tokenizer_config.json may give them as AddedToken objects)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if key.endswith("_token") and isinstance(value, dict):
            value = value.get("content")
        if key.endswith("_token") and isinstance(value, str):
            out[key] = value
    extra = config.get("additional_special_tokens")
    if isinstance(extra, list):
        out["additional_special_tokens"] = [t.get("content") if isinstance(t, dict) else t for t in extra]
    return out


def named_tokens(directory: str) -> dict[str, str]:
    """eos_token, bos_token, ... as strings: tokenizer_config.json's, else special_tokens_map.json's (a token null
    in tokenizer_config.json is unnamed, as in transformers)."""
    out: dict[str, str | None] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the latter wins
        config = _read_json(os.path.join(directory, name))
        out.update({k: None for k, v in config.items() if k.endswith("_token") and v is None})
        out.update({k: v for k, v in _special_tokens(config).items() if isinstance(v, str)})
    return {k: v for k, v in out.items() if v is not None}


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except FileNotFoundError:
        return {}
    except ValueError as e:
        raise ValueError(f"{path}: not JSON: {e}") from None
    return value if isinstance(value, dict) else {}
