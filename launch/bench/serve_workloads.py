"""`bench serve`'s scoring workloads: request lines for /v1/score, seeded and deterministic (the same arguments give
the same lines), random token ids in 1..vocab-1.

The first three are the bench's own comparisons (prefix cache on / off):
- distinct: prompts of --prefix + --suffix tokens sharing nothing;
- shared: one --prefix shared by every request, --suffix unique tokens after it;
- mixed: prompt lengths spread over 16x (1/8 to 2x --prefix, then --suffix), sharing nothing.
The rest stand in for MoE-Prefill's context regimes (arXiv 2605.02960, §8):
- shared-prefix: short prompts over shared prefixes, as many requests under a few system prompts or few-shot sets:
  --prefixes prefixes of --prefix tokens, each request under one of them (in turn) with --suffix tokens of its own;
- long-context: few requests (--long-requests) of long prompts (--context tokens), sharing nothing;
- multi-select: one context (--prefix + --suffix tokens, its own) and --candidates candidate continuations of
  --choice-tokens tokens each, every candidate scored, as multiple choice;
- mix: the three regimes in one file, shuffled: half the requests shared-prefix, half multi-select, and half the
  long-context requests (at least one).
Single-token candidates except in multi-select (and its share of mix)."""
from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np

COMPARISONS = ("distinct", "shared", "mixed")
REGIMES = ("shared-prefix", "long-context", "multi-select", "mix")
KINDS = COMPARISONS + REGIMES


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What the flags ask of a workload (see the module docstring for which kind reads which)."""
    requests: int
    prefix: int
    suffix: int
    candidates: int
    prefixes: int = 1
    context: int = 2048
    long_requests: int = 4
    choice_tokens: int = 8


def _line(cid: str, prompt: list[int], candidates: list[list[int]]) -> str:
    return json.dumps({"custom_id": cid, "url": "/v1/score",
                       "body": {"prompt_token_ids": prompt, "candidate_token_ids": candidates}})


def _single(rng: np.random.Generator, vocab: int, n: int) -> list[list[int]]:
    """n distinct single-token candidates."""
    return [[int(t)] for t in rng.choice(np.arange(1, vocab), n, replace=False)]


def _draw(rng: np.random.Generator, vocab: int, n: int) -> list[int]:
    return rng.integers(1, vocab, n).tolist()


def _comparison(kind: str, sizes: Sizes, vocab: int, rng: np.random.Generator) -> list[str]:
    shared = _draw(rng, vocab, sizes.prefix)
    lines = []
    for i in range(sizes.requests):
        head = shared if kind == "shared" else _draw(rng, vocab, sizes.prefix)
        if kind == "mixed":  # lengths spread over 16x: a prefix of 1/8 to 2x --prefix tokens, shared with nothing
            head = _draw(rng, vocab, max(1, int(sizes.prefix * 2.0 ** rng.uniform(-3, 1))))
        candidates = [[int(t)] for t in rng.choice(vocab, sizes.candidates, replace=False)]  # as the bench always drew
        lines.append(_line(f"{kind}-{i}", head + _draw(rng, vocab, sizes.suffix), candidates))
    return lines


def shared_prefix(sizes: Sizes, vocab: int, rng: np.random.Generator, n: int | None = None) -> list[str]:
    heads = [_draw(rng, vocab, sizes.prefix) for _ in range(sizes.prefixes)]
    n = sizes.requests if n is None else n
    return [_line(f"shared-prefix-{i}", heads[i % sizes.prefixes] + _draw(rng, vocab, sizes.suffix),
                  _single(rng, vocab, sizes.candidates)) for i in range(n)]


def long_context(sizes: Sizes, vocab: int, rng: np.random.Generator, n: int | None = None) -> list[str]:
    n = sizes.long_requests if n is None else n
    return [_line(f"long-context-{i}", _draw(rng, vocab, sizes.context), _single(rng, vocab, sizes.candidates))
            for i in range(n)]


def multi_select(sizes: Sizes, vocab: int, rng: np.random.Generator, n: int | None = None) -> list[str]:
    n = sizes.requests if n is None else n
    return [_line(f"multi-select-{i}", _draw(rng, vocab, sizes.prefix + sizes.suffix),
                  [_draw(rng, vocab, sizes.choice_tokens) for _ in range(sizes.candidates)]) for i in range(n)]


def mix_counts(sizes: Sizes) -> dict[str, int]:
    """Requests of each regime in `mix`."""
    return {"shared-prefix": sizes.requests // 2, "multi-select": sizes.requests - sizes.requests // 2,
            "long-context": max(1, sizes.long_requests // 2)}


def workload(kind: str, sizes: Sizes, vocab: int, seed: int) -> list[str]:
    """The request lines of `kind` (KINDS)."""
    rng = np.random.default_rng(seed)
    if kind in COMPARISONS:
        return _comparison(kind, sizes, vocab, rng)
    if kind == "mix":
        made = {"shared-prefix": shared_prefix, "multi-select": multi_select, "long-context": long_context}
        lines = [line for name, n in mix_counts(sizes).items() for line in made[name](sizes, vocab, rng, n)]
        return [lines[i] for i in rng.permutation(len(lines))]
    return {"shared-prefix": shared_prefix, "long-context": long_context, "multi-select": multi_select}[kind](
        sizes, vocab, rng)


def asked(kind: str, sizes: Sizes) -> dict[str, Any]:
    """The sizes `kind` reads, for the record."""
    common = dict(candidates=sizes.candidates)
    if kind in COMPARISONS:
        return dict(requests=sizes.requests, prefix=sizes.prefix, suffix=sizes.suffix, **common,
                    shared_prefixes=1 if kind == "shared" else 0)
    if kind == "shared-prefix":
        return dict(requests=sizes.requests, prefix=sizes.prefix, suffix=sizes.suffix, shared_prefixes=sizes.prefixes,
                    **common)
    if kind == "long-context":
        return dict(requests=sizes.long_requests, context=sizes.context, **common)
    if kind == "multi-select":
        return dict(requests=sizes.requests, context=sizes.prefix + sizes.suffix, choice_tokens=sizes.choice_tokens,
                    **common)
    return dict(requests=mix_counts(sizes), prefix=sizes.prefix, suffix=sizes.suffix, shared_prefixes=sizes.prefixes,
                context=sizes.context, choice_tokens=sizes.choice_tokens, **common)


def held(lines: list[str]) -> dict[str, Any]:
    """What the lines hold, counted from them: prompt lengths, candidate tokens, and the prefix-sharing ratio, the
    share of prompt tokens that repeat a prefix of another prompt (1 - the tokens of the prompts' prefix tree / all
    prompt tokens): what a prefix cache that kept everything would not compute again."""
    bodies = [json.loads(line)["body"] for line in lines]
    prompts = sorted(tuple(b["prompt_token_ids"]) for b in bodies)
    lengths = np.array([len(p) for p in prompts])
    # the prefix tree's nodes: every prompt's tokens less its common prefix with the one before it, in sorted order
    common = sum(next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
                 for a, b in zip(prompts, prompts[1:], strict=False))
    total = int(lengths.sum())
    candidates = [len(c) for b in bodies for c in b["candidate_token_ids"]]
    return dict(requests=len(bodies), prompt_tokens=total, prompt_len_min=int(lengths.min()),
                prompt_len_mean=float(lengths.mean()), prompt_len_max=int(lengths.max()),
                candidates_per_request=len(candidates) / len(bodies), candidate_tokens=int(sum(candidates)),
                prefix_tree_tokens=total - common, prefix_sharing_ratio=common / total if total else 0.0)
