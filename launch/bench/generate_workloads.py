"""`bench generate`'s workloads: lists of requests {prompt, max_tokens, stop_token_ids}, all greedy.

log-uniform: prompt lengths and max_tokens log-uniform over wide ranges, every request with the same stop ids.
long-tail: prompts of 6-40 tokens (uniform), max_tokens 160; seven in eight requests stop within 5 tokens,
one in eight runs to 160. Nearly every step is host work on a small model: a scheduler's overhead cannot hide."""
from __future__ import annotations

from collections.abc import Iterable
from typing import TypedDict

import numpy as np

from moejax.engine import Engine


class LongTail(TypedDict):
    prompt_range: tuple[int, int]
    max_tokens: int
    stop_within: int
    long_every: int


LONG_TAIL = LongTail(prompt_range=(6, 40), max_tokens=160, stop_within=5, long_every=8)


def log_uniform(n: int, vocab: int, prompt_range: tuple[int, int], max_range: tuple[int, int], stop_ids: Iterable[int],
                seed: int) -> list[dict]:
    """n requests: prompt lengths and max_tokens log-uniform over their ranges, random tokens."""
    rng = np.random.default_rng(seed)

    def draw(lo: int, hi: int) -> int:
        return int(round(np.exp(rng.uniform(np.log(lo), np.log(hi)))))
    return [dict(prompt=rng.integers(1, vocab, draw(*prompt_range)).tolist(),
                 max_tokens=draw(*max_range), stop_token_ids=list(stop_ids)) for _ in range(n)]


def long_tail(engine: Engine, n: int, seed: int) -> list[dict]:
    """n requests; the long ones (a 1/long_every share, at random places) have no stop ids of their own. Each other
    request stops at the token greedy generation makes at a position drawn uniformly from 1..stop_within: one
    batched `engine.generate` call finds them (run it before timing anything; it compiles its own programs)."""
    lo, hi = LONG_TAIL["prompt_range"]
    within = LONG_TAIL["stop_within"]
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, engine.config.vocab_size, rng.integers(lo, hi + 1)).tolist() for _ in range(n)]
    long = set(rng.permutation(n)[: -(-n // LONG_TAIL["long_every"])].tolist())
    at = rng.integers(1, within + 1, n)
    short = [i for i in range(n) if i not in long]
    made = engine.generate([prompts[i] for i in short], within) if short else []
    stops = {i: [made[k][at[i] - 1]] for k, i in enumerate(short)}
    return [dict(prompt=prompts[i], max_tokens=LONG_TAIL["max_tokens"], stop_token_ids=stops.get(i, []))
            for i in range(n)]


def long_tail_check(reqs: list[dict], tokens: list[list[int]]) -> dict:
    """What the run made of the workload: short requests that stopped within stop_within tokens, long ones that ran
    to max_tokens (the model's eos, a stop for every request, can end a long one early)."""
    short = [len(t) for r, t in zip(reqs, tokens, strict=True) if r["stop_token_ids"]]
    long = [len(t) for r, t in zip(reqs, tokens, strict=True) if not r["stop_token_ids"]]
    return dict(short=len(short), short_stopped_within=sum(n <= LONG_TAIL["stop_within"] for n in short),
                long=len(long), long_ran_to_max=sum(n == LONG_TAIL["max_tokens"] for n in long),
                long_lengths_below_max=sorted(n for n in long if n < LONG_TAIL["max_tokens"]))

