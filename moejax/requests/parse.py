"""Batch request lines (OpenAI batch envelope, JSONL) -> validated, tokenized requests.

Every input line yields exactly one entry: a request, or a BadLine whose message names the field
path and the problem. Bad input never raises and never affects other lines.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass

from tokenizers import Tokenizer

from moejax.chat import ChatTemplate
from moejax.requests.fields import Invalid, flag, is_int, nonempty_list, number, reject_unknown, show, string_field
from moejax.requests.openai_params import NO_OP_KEYS, check_no_ops
from moejax.sampling import RULES, SamplingParams

SCORE_URL = "/v1/score"
COMPLETIONS_URL = "/v1/completions"
CHAT_URL = "/v1/chat/completions"
VLLM_SCORE_URL = "/generative_scoring"  # vLLM's generative scoring
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (chat's default is the rest of the context)
MAX_N = 128  # choices per request
MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's chat limit; vLLM's default max_logprobs)

_ENVELOPE_KEYS = ("custom_id", "method", "url", "body")
# SamplingParams' fields (moejax.sampling.RULES: temperature, top_p, top_k, min_p, seed), then the rest
_SAMPLING_KEYS = ("max_tokens", *RULES, "stop", "stop_token_ids", "n", "skip_special_tokens",
                  "spaces_between_special_tokens", "include_stop_str_in_output")
_BODY_KEYS = {
    SCORE_URL: ("prompt", "prompt_token_ids", "candidates", "candidate_token_ids", "suffixes", "n", "model", "user"),
    COMPLETIONS_URL: ("prompt", "prompt_token_ids", *_SAMPLING_KEYS, "logprobs", "echo", "best_of", "model", "user"),
    CHAT_URL: ("messages", *_SAMPLING_KEYS, "max_completion_tokens", "logprobs", "top_logprobs", "model", "user",
               "chat_template_kwargs", "add_generation_prompt", "continue_final_message"),
}
SGLANG_SCORE_KEYS = ("query", "items", "label_token_ids", "apply_softmax", "item_first", "model", "user")
_BODY_KEYS[VLLM_SCORE_URL] = SGLANG_SCORE_KEYS + ("add_special_tokens", "priority")


@dataclass(frozen=True)
class Candidate:
    text: str | None  # None when given as token ids
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class ScoreRequest:
    line: int  # 1-based line number in the input file
    custom_id: str
    prompt: tuple[int, ...]
    suffixes: tuple[tuple[int, ...], ...]  # () when the request had no suffixes
    candidates: tuple[Candidate, ...]
    model: str | None = None  # as the request named it (echoed in the response)
    # query/items/label_token_ids: "softmax" or "probs" (SGLang's /v1/score), "vllm-softmax" or "vllm-probs"
    # (vLLM's /generative_scoring); None: moejax's candidates
    labels: str | None = None

    @property
    def contexts(self) -> tuple[tuple[int, ...], ...]:
        """One context per sibling: prompt + suffix, or just the prompt when there are no suffixes."""
        return tuple(self.prompt + s for s in self.suffixes) if self.suffixes else (self.prompt,)

    @property
    def prompt_tokens(self) -> int:
        """Context tokens over all siblings, for usage accounting."""
        return sum(len(c) for c in self.contexts)


@dataclass(frozen=True)
class CompletionRequest:
    line: int
    custom_id: str
    prompt: tuple[int, ...]
    max_tokens: int  # 0 only with echo: the prompt's log-probabilities, nothing generated
    # how its tokens are drawn; seed None: the runner draws one (results.ResultStore.seed_nonce) and reports it
    sampling: SamplingParams
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    n: int = 1  # choices, sharing the prompt's prefill
    logprobs: int | None = None  # top alternatives per token; None: no log-probabilities
    echo: bool = False  # the prompt (and, with logprobs, its log-probabilities) before the completion
    chat: bool = False  # /v1/chat/completions: prompt rendered by the chat template
    prompt_text: str | None = None  # as sent (completions) or rendered (chat)
    model: str | None = None
    # vLLM's: generated text without the added tokens marked special; the stop string or stop token's text that ended
    # it kept in the text
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False


@dataclass(frozen=True)
class BadLine:
    line: int
    custom_id: str | None  # when it could be read from the line
    message: str

    @property
    def param(self) -> str | None:
        """The request field the message names (OpenAI's error `param`), e.g. "max_tokens" or "messages"."""
        m = re.match(r"body\.([A-Za-z_]+)|(custom_id|method|url)\b", self.message)
        return (m.group(1) or m.group(2)) if m else None


Request = ScoreRequest | CompletionRequest


def parse_lines(lines: Iterable[str], *, tokenizer: Tokenizer | None, vocab_size: int, max_context: int,
                chat: ChatTemplate | None = None) -> list[Request | BadLine]:
    """One entry per input line, in order. A repeated custom_id makes the later line bad; the first
    line carrying it keeps it (even if that line is itself bad), so output custom_ids stay unique
    where possible. Iterate a file object rather than split its text: a final newline must not
    become an extra empty line."""
    first_line_of: dict[str, int] = {}
    out: list[Request | BadLine] = []
    for n, text in enumerate(lines, start=1):
        entry = parse_line(text, n, tokenizer=tokenizer, vocab_size=vocab_size, max_context=max_context, chat=chat)
        cid = entry.custom_id
        if cid is not None and cid in first_line_of:
            entry = BadLine(n, cid, f"custom_id {cid!r} duplicates line {first_line_of[cid]}")
        elif cid is not None:
            first_line_of[cid] = n
        out.append(entry)
    return out


def parse_line(text: str, line: int, *, tokenizer: Tokenizer | None, vocab_size: int, max_context: int,
               chat: ChatTemplate | None = None) -> Request | BadLine:
    """One JSONL line -> a request, or a BadLine naming what is wrong. chat: the model's chat template
    (moejax.chat.ChatTemplate), or None when it has none."""
    if not text.strip():
        return BadLine(line, None, "empty line")
    undecodable = _first_undecodable(text)  # the first problem when a line has it, whatever else is wrong
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return BadLine(line, None, undecodable or f"not JSON: {e.msg} (char {e.pos})")
    except (ValueError, RecursionError) as e:  # e.g. a 5000-digit number, or nesting too deep
        return BadLine(line, None, undecodable or f"not JSON: {type(e).__name__}: {e}")
    if not isinstance(obj, dict):
        return BadLine(line, None, undecodable or f"not a JSON object; got {show(obj)}")
    cid = obj.get("custom_id")
    cid = cid if isinstance(cid, str) and cid else None
    if undecodable is not None:  # the custom_id is kept when the bad bytes are elsewhere
        return BadLine(line, cid if cid is None or _ESCAPED.search(cid) is None else None, undecodable)
    try:
        return _Parser(tokenizer, vocab_size, max_context, chat).request(obj, line)
    except Invalid as e:
        return BadLine(line, cid, str(e))


_ESCAPED = re.compile("[\udc80-\udcff]")  # what surrogateescape makes of bytes that are not UTF-8


def _first_undecodable(text: str) -> str | None:
    """A message naming the first byte of the line that is not UTF-8, or None."""
    found = _ESCAPED.search(text)
    if found is None:
        return None
    offset = len(text[: found.start()].encode("utf-8", "surrogateescape"))
    return (f"not valid UTF-8: byte 0x{ord(found.group()) - 0xDC00:02x} at byte {offset} of the line; send UTF-8 "
            "(JSON escapes such as \\u00e9 for other characters)")


class _Parser:
    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, max_context: int,
                 chat: ChatTemplate | None = None) -> None:
        self.tokenizer, self.vocab_size, self.max_context, self.chat = tokenizer, vocab_size, max_context, chat

    def request(self, obj: dict, line: int) -> Request:
        reject_unknown(obj, _ENVELOPE_KEYS, "")
        for key in ("custom_id", "url", "body"):
            if key not in obj:
                raise Invalid(f"{key}: missing")
        cid = obj["custom_id"]
        if not isinstance(cid, str) or not cid:
            raise Invalid(f"custom_id: must be a non-empty string; got {show(cid)}")
        if "method" in obj and obj["method"] != "POST":
            raise Invalid(f"method: must be 'POST'; got {show(obj['method'])}")
        url = obj["url"]
        if not isinstance(url, str):
            raise Invalid(f"url: must be a string, one of {', '.join(_BODY_KEYS)}; got {show(url)}")
        if url not in _BODY_KEYS:
            raise Invalid(f"url {url!r}: unknown; expected one of {', '.join(_BODY_KEYS)}")
        body = obj["body"]
        if not isinstance(body, dict):
            raise Invalid(f"body: must be a JSON object; got {show(body)}")
        # null means "not given", as in the OpenAI API (clients often send "stop": null).
        body = {k: v for k, v in body.items() if v is not None}
        known = _BODY_KEYS[url]
        if url == SCORE_URL and any(k in body for k in ("query", "items", "label_token_ids")):
            known = SGLANG_SCORE_KEYS
        check_no_ops(body, known)
        reject_unknown(body, known, "body", accepted=NO_OP_KEYS)
        if "model" in body:
            string_field(body["model"], "body.model")
        if known is SGLANG_SCORE_KEYS:
            return self.labels_score(body, line, cid)
        if url == VLLM_SCORE_URL:
            return self.labels_score(body, line, cid, vllm=True)
        if url == SCORE_URL:
            return self.score(body, line, cid, self.prompt(body))
        if url == CHAT_URL:
            return self.chat_completion(body, line, cid)
        return self.completion(body, line, cid)

    def score(self, body: dict, line: int, cid: str, prompt: tuple[int, ...]) -> ScoreRequest:
        if "n" in body and (not is_int(body["n"]) or body["n"] != 1):
            raise Invalid(f"body.n: must be 1 for scoring; got {show(body['n'])}")
        cands = self.candidates(body)
        suffixes: tuple[tuple[int, ...], ...] = ()
        if "suffixes" in body:
            items = nonempty_list(body["suffixes"], "body.suffixes", "strings or token id lists")
            suffixes = tuple(self.text_or_ids(s, f"body.suffixes[{i}]") for i, s in enumerate(items))
        longest_suffix = max((len(s) for s in suffixes), default=0)
        longest_cand = max(len(c.token_ids) for c in cands)
        # The last candidate token is only scored, never fed back, hence - 1.
        need = len(prompt) + longest_suffix + longest_cand - 1
        if need > self.max_context:
            raise Invalid(f"body: prompt {len(prompt)} + longest suffix {longest_suffix} + longest candidate "
                          f"{longest_cand} - 1 = {need} tokens exceed the model's context of {self.max_context}")
        return ScoreRequest(line, cid, prompt, suffixes, cands, model=body.get("model"))

    def labels_score(self, body: dict, line: int, cid: str, vllm: bool = False) -> ScoreRequest:
        """Each item joined to the query, scored by the next-token probabilities of label_token_ids after it.
        SGLang (/v1/score) joins texts before tokenizing (token lists as lists); vLLM (/generative_scoring)
        tokenizes the query (with special tokens unless add_special_tokens is false) and each item (without) on
        their own and joins the ids, and applies the softmax unless told not to."""
        for key in ("query", "items", "label_token_ids"):
            if key not in body:
                raise Invalid(f"body.{key}: missing (label scoring needs query, items and label_token_ids)")
        item_first = flag(body, "item_first", False)
        softmax = flag(body, "apply_softmax", vllm)
        special = flag(body, "add_special_tokens", True)
        if "priority" in body and not is_int(body["priority"]):
            raise Invalid(f"body.priority: must be an int; got {show(body['priority'])}")
        query, items = body["query"], body["items"]
        if isinstance(items, str) and not vllm:
            items = [items]
        items = nonempty_list(items, "body.items", "strings or token id lists")
        if isinstance(query, list):
            query = self.ids(nonempty_list(query, "body.query", "token ids"), "body.query")
        else:
            query = string_field(query, "body.query", "a non-empty string or token id list")
            if self.tokenizer is None:
                raise Invalid("body.query: model has no tokenizer; send token id lists")
        if vllm and not isinstance(query, tuple):  # vLLM tokenizes the query on its own, once
            query = self.encode(query, "body.query", special=special)
        contexts = []
        for i, item in enumerate(items):
            path = f"body.items[{i}]"
            if vllm:
                tail = self.text_or_ids(item, path)
                contexts.append(tail + query if item_first else query + tail)
            elif isinstance(query, tuple):
                if not isinstance(item, list):
                    raise Invalid(f"{path}: must be a token id list, as the query is; got {show(item)}")
                ids = self.ids(item, path)
                contexts.append(ids + query if item_first else query + ids)
            else:
                item = string_field(item, path, "a string, as the query is")
                contexts.append(self.encode(item + query if item_first else query + item, path, special=True))
        labels = self.ids(nonempty_list(body["label_token_ids"], "body.label_token_ids", "token ids"),
                          "body.label_token_ids")
        longest = max(map(len, contexts))
        if longest > self.max_context:
            raise Invalid(f"body.items: query + item of {longest} tokens exceed the model's context of "
                          f"{self.max_context}")
        kind = ("vllm-" if vllm else "") + ("softmax" if softmax else "probs")
        return ScoreRequest(line, cid, (), tuple(map(tuple, contexts)), tuple(Candidate(None, (t,)) for t in labels),
                            model=body.get("model"), labels=kind)

    def completion(self, body: dict, line: int, cid: str) -> CompletionRequest:
        prompt, text = self.completion_prompt(body)
        echo = flag(body, "echo", False)
        logprobs = body.get("logprobs")
        if logprobs is not None and (not is_int(logprobs) or not 0 <= logprobs <= MAX_LOGPROBS):
            raise Invalid(f"body.logprobs: must be an int in [0, {MAX_LOGPROBS}]; got {show(logprobs)}")
        least = 0 if echo else 1  # echo with max_tokens 0: the prompt's log-probabilities only (scoring)
        max_tokens = self.max_tokens(body, "max_tokens", DEFAULT_MAX_TOKENS, least)
        sampling = self.sampling(body)
        self.check_context(body, prompt, "body.prompt_token_ids" if "prompt_token_ids" in body else "body.prompt",
                           "max_tokens", max_tokens)
        if "best_of" in body and body["best_of"] != sampling["n"]:
            raise Invalid(f"body.best_of: {show(body['best_of'])} is not supported (only best_of = n, "
                          f"{sampling['n']} here)")
        return CompletionRequest(line, cid, prompt, max_tokens, **sampling, logprobs=logprobs, echo=echo,
                                 prompt_text=text, model=body.get("model"))

    def chat_completion(self, body: dict, line: int, cid: str) -> CompletionRequest:
        if self.chat is None:
            raise Invalid("body.messages: this model has no chat template (tokenizer_config.json's chat_template "
                          "or chat_template.jinja); send /v1/completions with a prompt instead")
        if "messages" not in body:
            raise Invalid("body.messages: missing")
        kwargs = body.get("chat_template_kwargs", {})
        if not isinstance(kwargs, dict):
            raise Invalid(f"body.chat_template_kwargs: must be an object; got {show(kwargs)}")
        if flag(body, "continue_final_message", False):
            raise Invalid("body.continue_final_message: true is not supported")
        try:
            text = self.chat.render(body["messages"], add_generation_prompt=flag(body, "add_generation_prompt", True),
                                    kwargs=kwargs)
        except ValueError as e:  # moejax.chat names the field
            raise Invalid(str(e)) from None
        prompt = self.encode(text, "body.messages", special=False)  # the template wrote the special tokens
        if "max_tokens" in body and "max_completion_tokens" in body:
            raise Invalid("body: give max_tokens or max_completion_tokens, not both")
        key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        max_tokens = self.max_tokens(body, key, max(self.max_context - len(prompt), 1), 1)
        want = flag(body, "logprobs", False)
        top = body.get("top_logprobs", 0)
        if not is_int(top) or not 0 <= top <= MAX_LOGPROBS:
            raise Invalid(f"body.top_logprobs: must be an int in [0, {MAX_LOGPROBS}]; got {show(top)}")
        if "top_logprobs" in body and not want:
            raise Invalid("body.top_logprobs: needs logprobs: true")
        sampling = self.sampling(body)
        self.check_context(body, prompt, "body.messages", key, max_tokens)
        return CompletionRequest(line, cid, prompt, max_tokens, **sampling,
                                 logprobs=top if want else None, chat=True, prompt_text=text, model=body.get("model"))

    def max_tokens(self, body: dict, key: str, default: int, least: int) -> int:
        value = body.get(key, default)
        if not is_int(value) or value < least:
            raise Invalid(f"body.{key}: must be an int >= {least}; got {show(value)}")
        return value

    def sampling(self, body: dict) -> dict:
        """SamplingParams, stop, stop_token_ids, n and the text's options, checked."""
        n = body.get("n", 1)
        if not is_int(n) or not 1 <= n <= MAX_N:
            raise Invalid(f"body.n: must be an int in [1, {MAX_N}]; got {show(n)}")
        stop = self.stop(body.get("stop", []))
        stop_ids = body.get("stop_token_ids", [])
        if not isinstance(stop_ids, list):
            raise Invalid(f"body.stop_token_ids: must be a list of token ids; got {show(stop_ids)}")
        stop_ids = self.ids(stop_ids, "body.stop_token_ids")
        # vLLM's spaces_between_special_tokens joins the pieces of a slow tokenizer's decode; a fast tokenizer (every
        # tokenizer.json, so moejax's) ignores it, in vLLM too: accepted, checked, and it changes nothing
        flag(body, "spaces_between_special_tokens", True)
        return dict(sampling=self.sampling_params(body), stop=stop, stop_token_ids=stop_ids, n=n,
                    skip_special_tokens=flag(body, "skip_special_tokens", True),
                    include_stop_str_in_output=flag(body, "include_stop_str_in_output", False))

    def sampling_params(self, body: dict) -> SamplingParams:
        """SamplingParams from the body's fields of the same names (moejax.sampling.RULES), defaults for the rest."""
        values: dict[str, float] = {}
        for key, (kind, rule, _) in RULES.items():
            if key not in body:
                continue
            if kind is float:
                values[key] = number(body[key], f"body.{key}")
            elif is_int(body[key]):
                values[key] = body[key]
            else:
                raise Invalid(f"body.{key}: must be {rule}; got {show(body[key])}")
        try:
            return SamplingParams(**values)  # type: ignore[arg-type]  # each value of its field's type, as RULES says
        except ValueError as e:  # out of its range, named by field
            raise Invalid(f"body.{e}") from None

    def check_context(self, body: dict, prompt: tuple[int, ...], prompt_path: str, key: str, max_tokens: int) -> None:
        """The prompt and max_tokens (under `key`, as sent; or its default) fit the model's context. A prompt that
        alone fills it is the prompt's fault, whatever max_tokens is: the message names the prompt's field."""
        P, C = len(prompt), self.max_context
        if P + max_tokens <= C:
            return
        given = key in body
        if P >= C:
            chat = prompt_path == "body.messages"
            what = " (the messages rendered by the chat template)" if chat else ""
            wanted = f"{key} {max_tokens}" if given else "a completion"
            room = f", leaving no room for {wanted}" if max_tokens else ""
            raise Invalid(f"{prompt_path}: the prompt's {P} tokens{what} {'fill' if P == C else 'exceed'} the "
                          f"model's context of {C}{room}; shorten the {'messages' if chat else 'prompt'}")
        where, fix = (f"body.{key}", f"; send at most {C - P}") if given else (
            "body", f" ({key} {max_tokens} is the default, as none was given: send at most {C - P})")
        raise Invalid(f"{where}: prompt {P} + {key} {max_tokens} = {P + max_tokens} tokens exceed the model's context "
                      f"of {C}{fix}")

    def completion_prompt(self, body: dict) -> tuple[tuple[int, ...], str | None]:
        """A prompt as text, as a token id list (OpenAI allows it), or as a list of one of those; or
        prompt_token_ids. -> (ids, text as sent or None)."""
        value = body.get("prompt")
        if isinstance(value, list) and value and not is_int(value[0]):
            if len(value) > 1:
                raise Invalid(f"body.prompt: a list of {len(value)} prompts; send one prompt per line")
            value = body["prompt"] = value[0]
        if isinstance(value, list) and "prompt_token_ids" not in body:
            return self.ids(nonempty_list(value, "body.prompt", "token ids"), "body.prompt"), None
        return self.prompt(body), body.get("prompt")

    def prompt(self, body: dict) -> tuple[int, ...]:
        if ("prompt" in body) == ("prompt_token_ids" in body):
            raise Invalid("body: needs exactly one of prompt, prompt_token_ids")
        if "prompt_token_ids" in body:
            return self.ids(nonempty_list(body["prompt_token_ids"], "body.prompt_token_ids", "token ids"),
                            "body.prompt_token_ids")
        text = string_field(body["prompt"], "body.prompt")
        if self.tokenizer is None:
            raise Invalid("body.prompt: model has no tokenizer; send prompt_token_ids")
        return self.encode(text, "body.prompt", special=True)

    def candidates(self, body: dict) -> tuple[Candidate, ...]:
        if ("candidates" in body) == ("candidate_token_ids" in body):
            raise Invalid("body: needs exactly one of candidates, candidate_token_ids")
        if "candidate_token_ids" in body:
            items = nonempty_list(body["candidate_token_ids"], "body.candidate_token_ids", "token id lists")
            paths = [f"body.candidate_token_ids[{i}]" for i in range(len(items))]
            return tuple(Candidate(None, self.ids(nonempty_list(c, p, "token ids"), p))
                         for c, p in zip(items, paths, strict=True))
        items = nonempty_list(body["candidates"], "body.candidates", "strings")
        if self.tokenizer is None:
            raise Invalid("body.candidates: model has no tokenizer; send candidate_token_ids")
        texts = [string_field(c, f"body.candidates[{i}]") for i, c in enumerate(items)]
        return tuple(Candidate(t, self.encode(t, f"body.candidates[{i}]", special=False)) for i, t in enumerate(texts))

    def text_or_ids(self, value: object, path: str) -> tuple[int, ...]:  # a request's JSON value
        if isinstance(value, list):
            return self.ids(nonempty_list(value, path, "token ids"), path)
        text = string_field(value, path, "a non-empty string or token id list")
        if self.tokenizer is None:
            raise Invalid(f"{path}: model has no tokenizer; send token ids")
        return self.encode(text, path, special=False)

    def stop(self, value: object) -> tuple[str, ...]:  # body.stop's JSON value
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list):
            raise Invalid(f"body.stop: must be a string or a list of strings; got {show(value)}")
        paths = ["body.stop"] if isinstance(value, str) else [f"body.stop[{i}]" for i in range(len(stops))]
        stops = tuple(string_field(s, p) for s, p in zip(stops, paths, strict=True))
        if stops and self.tokenizer is None:  # stop strings match detokenized text
            raise Invalid("body.stop: model has no tokenizer; use stop_token_ids")
        return stops

    def encode(self, text: str, path: str, *, special: bool) -> tuple[int, ...]:
        assert self.tokenizer is not None  # callers answer text without a tokenizer with Invalid first
        ids = tuple(self.tokenizer.encode(text, add_special_tokens=special).ids)
        if not ids:
            raise Invalid(f"{path}: {show(text)} tokenizes to no tokens")
        # A tokenizer may know added tokens the model's embedding does not have.
        for t in ids:
            if not 0 <= t < self.vocab_size:
                raise Invalid(f"{path}: tokenizer gave id {t}, outside the model's vocabulary [0, {self.vocab_size})")
        return ids

    def ids(self, values: list, path: str) -> tuple[int, ...]:
        if values and set(map(type, values)) == {int} and 0 <= min(values) and max(values) < self.vocab_size:
            return tuple(values)  # the common case, checked in C; the loop below names what is wrong
        for i, t in enumerate(values):
            if not is_int(t):
                raise Invalid(f"{path}[{i}]: must be a token id (int); got {show(t)}")
            if not 0 <= t < self.vocab_size:
                raise Invalid(f"{path}[{i}]: token id {t} outside the vocabulary [0, {self.vocab_size})")
        return tuple(values)
