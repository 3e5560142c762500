"""MoE-Lightning's request batching (arXiv 2411.11217 App. A.2, Alg. 2): requests of different input lengths
split into micro-batches of balanced token counts, longest first into the micro-batch with the fewest tokens, so each
micro-batch's work in the pipeline (§4, Alg. 1: one micro-batch's attention on the host while another runs on the
accelerator) is close to the policy's. Pure Python: the scheduler calls it before anything is compiled."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class Balanced:
    """Alg. 2's result. micro_batches: request indices per micro-batch, each in the order its requests were placed
    (the full ones in the order they closed, then those left open); tokens: each micro-batch's sum of input lengths;
    aborted: the requests left for the next batch, in the order Alg. 2 turned them away."""
    micro_batches: list[list[int]]
    tokens: list[int]
    aborted: list[int]


def balance(requests: Sequence[tuple[int, int]], micro_batches: int, per_micro_batch: int,
            cache_tokens: int | None) -> Balanced:
    """Alg. 2 over `requests` (per request: input_len, gen_len), `micro_batches` partitions (n_ub) of at most
    `per_micro_batch` requests (ubs) and at most `cache_tokens` KV cache tokens each (cache_size; None: no limit).

    Requests are taken by input length, longest first (a stable sort: equal lengths keep their request order); each
    goes to the open partition with the fewest input tokens (ties: the lowest partition). A partition holding
    `per_micro_batch` requests closes: it is a micro-batch. A request is aborted when no partition is open, or when it
    would overflow the chosen partition's cache: (its inputs + input_len) + (its gen lens + gen_len) > cache_tokens.
    Alg. 2 line 9 has one gen_len for every request, (1 + |partition|) * gen_len; with every gen_len equal the sum of
    gen lens above is exactly that. An aborted request does not end the loop: a shorter one after it may still fit.

    Two departures from the listing: lines 6-7 abort when no partition is open but then fall through to an argmin over
    no partitions; here the request is aborted and the loop goes on (the intended `continue`). And the partitions still
    open at the end, not full, are returned as micro-batches after the full ones (Alg. 2 drops them from its output):
    every admitted request must run, or it would be neither run nor retried. Partitions that got no request are
    dropped: an empty micro-batch has nothing to run."""
    _check_count(micro_batches, "micro_batches", "balance")
    _check_count(per_micro_batch, "per_micro_batch", "balance")
    if cache_tokens is not None and cache_tokens < 1:
        raise ValueError(f"balance: cache_tokens must be >= 1 or None (no limit), got {cache_tokens}")
    for i, (input_len, gen_len) in enumerate(requests):
        if input_len < 0 or gen_len < 0:
            raise ValueError(f"balance: requests[{i}] has a negative length: input_len={input_len}, gen_len={gen_len}")

    open_parts: list[list[int]] = [[] for _ in range(micro_batches)]  # pop() keeps the rest in partition order
    closed: list[list[int]] = []
    aborted: list[int] = []
    for r in _longest_first([input_len for input_len, _ in requests]):
        if not open_parts:
            aborted.append(r)
            continue
        idx = _fewest_tokens([sum(requests[q][0] for q in part) for part in open_parts])
        part = open_parts[idx]
        if cache_tokens is not None:
            inputs = sum(requests[q][0] for q in part) + requests[r][0]
            gens = sum(requests[q][1] for q in part) + requests[r][1]
            if inputs + gens > cache_tokens:
                aborted.append(r)
                continue
        part.append(r)
        if len(part) == per_micro_batch:
            closed.append(open_parts.pop(idx))
    batches = closed + [part for part in open_parts if part]
    return Balanced(micro_batches=batches, tokens=[sum(requests[q][0] for q in b) for b in batches], aborted=aborted)


@dataclasses.dataclass(frozen=True)
class BatchLimit:
    """Alg. 2's limits on one decode batch: `micro_batches` (n_ub) of at most `per_micro_batch` requests (ubs), each
    micro-batch's KV at most `cache_tokens` (cache_size). The continuous-batching scheduler asks `admits` before it
    admits a request into the running batch (moejax.sched.continuous): a request Alg. 2 would abort waits for a later
    batch, as the paper's aborted requests do, whatever room the block pool has."""
    micro_batches: int
    per_micro_batch: int
    cache_tokens: int

    def __post_init__(self) -> None:
        _check_count(self.micro_batches, "micro_batches", "BatchLimit")
        _check_count(self.per_micro_batch, "per_micro_batch", "BatchLimit")
        _check_count(self.cache_tokens, "cache_tokens", "BatchLimit")

    def admits(self, running: Sequence[tuple[int, int]], request: tuple[int, int]) -> bool:
        """Whether Alg. 2 places every one of `running` and `request` (each: input_len, gen_len) in this batch."""
        return not balance([*running, request], self.micro_batches, self.per_micro_batch, self.cache_tokens).aborted


def split_rows(lengths: Sequence[int], micro_batches: int) -> list[list[int]]:
    """The rows of one decode step, `lengths` their current context lengths, split into at most `micro_batches`
    groups of balanced token sums by Alg. 2's greedy without its size cap and cache limit: longest first (stable),
    each into the group with the fewest tokens (ties: the lowest group). Groups that got no row are dropped; each
    group's row indices are sorted ascending."""
    _check_count(micro_batches, "micro_batches", "split_rows")
    for i, n in enumerate(lengths):
        if n < 0:
            raise ValueError(f"split_rows: lengths[{i}] is negative: {n}")
    groups: list[list[int]] = [[] for _ in range(micro_batches)]
    sums = [0] * micro_batches
    for r in _longest_first(lengths):
        idx = _fewest_tokens(sums)
        groups[idx].append(r)
        sums[idx] += lengths[r]
    return [sorted(g) for g in groups if g]


def _check_count(value: int, name: str, where: str) -> None:
    if value < 1:
        raise ValueError(f"{where}: {name} must be >= 1, got {value}")


def _longest_first(lengths: Sequence[int]) -> list[int]:
    # sorted() is stable, with reverse=True too: equal lengths keep their index order
    return sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True)


def _fewest_tokens(sums: Sequence[int]) -> int:
    # min() returns the first of equal minima: ties go to the lowest index
    return min(range(len(sums)), key=lambda i: sums[i])
