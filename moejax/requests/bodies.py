"""Response bodies in the shapes clients parse: OpenAI's text_completion and chat.completion (choices, logprobs,
usage), moejax's candidate scoring, SGLang's /v1/score (`scores`) and vLLM's generative scoring (`data[].score`).
A body starts with `id`, `object`, `created`, `model` and `system_fingerprint` (the settings that made it; see
results.fingerprint)."""
from __future__ import annotations

import math
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from tokenizers import Tokenizer

from moejax.requests.parse import CompletionRequest, ScoreRequest
from moejax.requests.token_text import TokenText


@dataclass
class Choice:
    """One generated continuation: its tokens, why it ended, and (when asked) per-token log-probabilities:
    logprobs[t] of tokens[t], top[t] = [(id, logprob)] most likely first."""
    tokens: list[int]
    finish_reason: str
    logprobs: list[float] | None = None
    top: list[list[tuple[int, float]]] | None = None


class Bodies:
    def __init__(self, tokenizer: Tokenizer | None, model: str, fingerprint: str) -> None:
        self.tokenizer, self.model, self.fingerprint = tokenizer, model, fingerprint
        self.tokens = TokenText(tokenizer)

    def head(self, kind: str, rid: str, req: CompletionRequest | ScoreRequest) -> dict:
        prefixes = {"text_completion": "cmpl", "chat.completion": "chatcmpl", "list": "generative-score"}
        prefix = prefixes.get(kind, "score")
        return {"id": f"{prefix}-{rid}", "object": kind, "created": int(time.time()), "model": req.model or self.model,
                "system_fingerprint": self.fingerprint}

    def decode(self, ids: Sequence[int]) -> str | None:
        """Text as transformers' tokenizer.decode gives it by default, special tokens kept: prompts (echo) and
        candidates, as lm-eval reads them back."""
        return self.tokens.decode(ids)

    def generated_text(self, req: CompletionRequest, ids: Sequence[int]) -> str | None:
        """Generated text as vLLM and SGLang return it: without the special tokens unless the request's
        skip_special_tokens is false (stop strings are looked for in this text too)."""
        return self.tokens.decode(ids, req.skip_special_tokens)

    # -- generation --------------------------------------------------------------------------------------------
    def cut_at_stop(self, req: CompletionRequest, choice: Choice, stop_ids: Collection[int]
                    ) -> tuple[Choice, str | None]:
        """The choice ended at the first stop string (text and tokens cut there), and its text. A stop token
        ends the tokens; its text, as a stop string's, is in the text only with include_stop_str_in_output."""
        out = choice.tokens
        stopped = bool(out) and out[-1] in stop_ids
        finish = "stop" if stopped else choice.finish_reason
        text = self.generated_text(req, out[:-1] if stopped else out)
        if req.stop and text is not None:
            cut, hit = min(((text.find(s), s) for s in req.stop if s in text), key=lambda c: c[0],
                           default=(-1, ""))
            if cut >= 0:
                text, finish = text[:cut + (len(hit) if req.include_stop_str_in_output else 0)], "stop"
                # text is not None: there is a tokenizer, so decode gives text
                n = next(n for n in range(1, len(out) + 1)
                         if any(s in (self.generated_text(req, out[:n]) or "") for s in req.stop))
                choice = Choice(out[:n], finish, choice.logprobs and choice.logprobs[:n], choice.top and choice.top[:n])
                stopped = False
        if stopped and req.include_stop_str_in_output:
            text = self.generated_text(req, out)
        choice.finish_reason = finish
        return choice, text

    def completion(self, req: CompletionRequest, rid: str, choices: list[tuple[Choice, str | None]], cached: int,
                   prompt_logprobs: tuple[list[float], list] | None) -> dict:
        body = self.head("chat.completion" if req.chat else "text_completion", rid, req)
        out = []
        for i, (c, text) in enumerate(choices):
            if req.chat:
                entry = {"index": i, "message": {"role": "assistant", "content": text},
                         "logprobs": None if req.logprobs is None else {"content": self.chat_logprobs(req, c)}}
            else:
                # text is a string, as OpenAI's: without a tokenizer "" (vLLM's when it does not detokenize)
                prompt_text = (self.echoed_prompt(req) or "") if req.echo else ""
                entry = {"index": i, "text": prompt_text + (text or ""), "logprobs": None if req.logprobs is None
                         else self.completion_logprobs(req, c, prompt_logprobs)}
            out.append({**entry, "token_ids": c.tokens, "finish_reason": c.finish_reason})
        completion = sum(len(c.tokens) for c, _ in choices)
        body.update(choices=out, seed=req.sampling.seed, usage={
            "prompt_tokens": len(req.prompt), "completion_tokens": completion,
            "total_tokens": len(req.prompt) + completion, "prompt_tokens_details": {"cached_tokens": cached},
            "cached_prompt_tokens": cached})
        return body

    def completion_logprobs(self, req: CompletionRequest, c: Choice, prompt_logprobs: tuple[list[float], list] | None
                            ) -> dict:
        """OpenAI's legacy shape: tokens, token_logprobs, top_logprobs (dicts, the chosen token included),
        text_offset; with echo the prompt's tokens come first (the first has no log-probability). Tokens are named
        by TokenText.completion_name (part of a character: `bytes:\\xNN...`), so every top entry has its own key;
        text_offset indexes the choice's text (characters), the prompt's tokens into the prompt's text (special tokens
        kept); a generated special token the text skips is at the offset of the character after it."""
        assert c.logprobs is not None and c.top is not None  # generated with them: req.logprobs is set
        tokens, lps, tops, offsets = [], [], [], []
        if req.echo:
            assert prompt_logprobs is not None  # the prompt was scored for echo
            first_lps, first_tops = prompt_logprobs
            tokens += list(req.prompt)
            lps += [None] + list(first_lps)
            tops += [None] + list(first_tops)
            offsets += self.tokens.offsets(req.prompt)
        prompt_chars = len(self.echoed_prompt(req) or "") if req.echo else 0
        offsets += [prompt_chars + at for at in self.tokens.offsets(c.tokens, req.skip_special_tokens)]
        tokens += c.tokens
        lps += c.logprobs
        tops += c.top
        top_dicts = [None if top is None else self.top_dict(t, lp, top[: req.logprobs])
                     for t, lp, top in zip(tokens, lps, tops, strict=True)]
        return {"tokens": [self.tokens.completion_name(t) for t in tokens], "token_logprobs": lps,
                "top_logprobs": top_dicts, "text_offset": offsets}

    def echoed_prompt(self, req: CompletionRequest) -> str | None:
        """The prompt's text before the completion's with echo: as sent, else decoded."""
        return req.prompt_text if req.prompt_text is not None else self.decode(req.prompt)

    def top_dict(self, token: int, logprob: float | None, top: Sequence[tuple[int, float]]) -> dict:
        d: dict[str, float | None] = {self.tokens.completion_name(t): lp for t, lp in top}
        d.setdefault(self.tokens.completion_name(token), logprob)
        return d

    def chat_logprobs(self, req: CompletionRequest, c: Choice) -> list[dict]:
        """OpenAI's chat shape: each token with its real bytes (TokenText.chat_item) and its top alternatives."""
        item = self.tokens.chat_item
        assert c.logprobs is not None and c.top is not None  # generated with them: req.logprobs is set
        return [{**item(t, lp), "top_logprobs": [item(a, b) for a, b in top[: req.logprobs]]}
                for t, lp, top in zip(c.tokens, c.logprobs, c.top, strict=True)]

    # -- scoring -----------------------------------------------------------------------------------------------
    def score(self, req: ScoreRequest, rid: str, logprobs: list[list[float]], cached: int) -> dict:
        """logprobs[s][j]: candidate j's log-probability after context s."""
        if req.labels is not None:
            return self.label_scores(req, rid, logprobs, cached)
        results = []
        for lps in logprobs:
            norm = max(lps) + math.log(sum(math.exp(x - max(lps)) for x in lps))
            cands = [{"text": c.text if c.text is not None else self.decode(c.token_ids),
                      "token_ids": list(c.token_ids), "logprob": x, "prob": math.exp(x - norm)}
                     for c, x in zip(req.candidates, lps, strict=True)]
            best = max(range(len(lps)), key=lps.__getitem__)
            results.append({"candidates": cands, "best": cands[best]["text"], "best_index": best})
        return {**self.head("score", rid, req), "results": results,
                "usage": {"prompt_tokens": req.prompt_tokens, "cached_prompt_tokens": cached}}

    def label_scores(self, req: ScoreRequest, rid: str, logprobs: list[list[float]], cached: int) -> dict:
        """Per item, the label tokens' probabilities (softmax: renormalised over the labels). SGLang answers all
        of them (`scores`); vLLM the first label's (`data[].score`)."""
        assert req.labels is not None  # score() sends only label requests here
        scores = []
        for lps in logprobs:
            if req.labels.endswith("softmax"):
                top = max(lps)
                total = sum(math.exp(x - top) for x in lps)
                scores.append([math.exp(x - top) / total for x in lps])
            else:
                scores.append([math.exp(x) for x in lps])
        usage = {"prompt_tokens": req.prompt_tokens, "completion_tokens": 0, "total_tokens": req.prompt_tokens,
                 "cached_prompt_tokens": cached}
        if req.labels.startswith("vllm"):
            return {**self.head("list", rid, req), "data": [{"index": i, "object": "score", "score": s[0]}
                                                            for i, s in enumerate(scores)], "usage": usage}
        return {**self.head("scoring", rid, req), "scores": scores, "usage": usage}
