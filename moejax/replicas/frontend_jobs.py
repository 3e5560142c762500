"""Requests as the frontend's jobs (moejax.replicas.frontend.Job): the blocks a replica may already hold, the blocks
running one leaves there, and its MoE-Prefill Eq. 2 cost in true FLOPs given what the replica holds."""
from __future__ import annotations

from collections.abc import Callable

from moejax.config import ModelConfig
from moejax.costs import true_prefill_flops
from moejax.models.kv_pool import BLOCK
from moejax.replicas.frontend import Job
from moejax.requests.parse import CompletionRequest, ScoreRequest
from moejax.sched.batch_schedule import score_sequences, tree_flops
from moejax.sched.prefix_cache import BlockHolder, block_hashes


def request_job(key: int, req: ScoreRequest | CompletionRequest, cfg: ModelConfig,
                stored: Callable[[bytes], bool]) -> Job:
    """stored(hash): whether the replica's prefix cache keeps that block (its --kv-cache mode). A scoring request
    costs its prefix tree (tree_flops: siblings and candidates share their common part; blocks the replica holds
    are attended context, not new tokens). A completion costs its prompt after the held blocks plus, per choice,
    max_tokens more tokens after the prompt (an upper bound: a choice may stop early)."""
    if isinstance(req, ScoreRequest):
        seqs = score_sequences(key, req)
        flops_of = tree_flops(cfg)
        hashes = [h for ctx in req.contexts for h in block_hashes(ctx)]
        return Job(key, tuple(block_hashes(req.contexts[0])), _kept(hashes, stored),
                   lambda holder: flops_of(seqs, holder), sum(map(len, req.contexts)))
    prompt = len(req.prompt)
    match = tuple(block_hashes(req.prompt, (prompt - 1) // BLOCK))  # at least one prompt token is computed
    decode = req.n * true_prefill_flops(cfg, req.max_tokens, prompt) if req.max_tokens else 0.0

    def cost(holder: BlockHolder) -> float:
        cached = min(holder.readable(match) * BLOCK, prompt - 1)
        return true_prefill_flops(cfg, prompt - cached, cached) + decode
    return Job(key, match, _kept(block_hashes(req.prompt), stored), cost, prompt)


def _kept(hashes: list[bytes], stored: Callable[[bytes], bool]) -> tuple[bytes, ...]:
    return tuple(dict.fromkeys(h for h in hashes if stored(h)))
