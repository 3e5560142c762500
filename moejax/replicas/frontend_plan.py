"""The frontend's routing of a file, planned without replicas (`launch.serve --replicas N --explain`): rounds as
moejax.replicas.frontend runs them, every share taken as finished at once with its blocks stored (caches that never
evict), so what it shows is where each request would go and how the true-FLOPs load would balance."""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from moejax.costs import true_prefill_flops
from moejax.engine import Engine
from moejax.replicas.frontend import PER_REQUEST, Frontend, Job, ReplicaMirror
from moejax.replicas.frontend_jobs import request_job
from moejax.requests.parse import CompletionRequest, ScoreRequest, parse_lines
from moejax.sched.batch_size import DEFAULT_TOKENS


def plan_routing(jobs: Sequence[Job], thetas: Sequence[float], routing: str) -> tuple[Frontend, int]:
    """Route every job -> the frontend after it (its mirrors hold the totals) and the rounds it took (0: a routing
    without rounds)."""
    frontend = Frontend(thetas, routing)
    queue, rounds = deque(jobs), 0
    if routing in PER_REQUEST:  # no rounds: each job as it arrives, then each replica's in shares of its Θ
        sent: dict[int, deque[Job]] = {e: deque() for e in range(len(thetas))}
        for job in jobs:
            sent[frontend.route(job)].append(job)
        for e, mine in sent.items():
            while mine:
                share = frontend.share(e, mine)
                frontend.finished(e, [j.key for j in share], [("stored", h) for j in share for h in j.stores])
        return frontend, 0
    while queue:
        rounds += 1
        for e, share in frontend.round(queue).items():
            frontend.finished(e, [j.key for j in share], [("stored", h) for j in share for h in j.stores])
    return frontend, rounds


def routing_lines(engine: Engine, lines: Sequence[str], replicas: int, routing: str, max_batch_tokens: int | None,
                  kv_cache: str) -> str:
    """The planned routing of `lines` over `replicas` copies of `engine`, as text."""
    cfg = engine.config
    todo = [e for e in parse_lines(lines, tokenizer=engine.tokenizer, vocab_size=cfg.vocab_size,
                                   max_context=cfg.max_position_embeddings, chat=engine.chat_template)
            if isinstance(e, (ScoreRequest, CompletionRequest))]
    jobs = [request_job(k, r, cfg, lambda h: kv_cache != "off") for k, r in enumerate(todo)]
    sat = engine.saturation
    theta = sat.theta_flops if sat is not None else true_prefill_flops(cfg, max_batch_tokens or DEFAULT_TOKENS)
    frontend, rounds = plan_routing(jobs, [theta] * replicas, routing)
    alone = sum(j.cost(ReplicaMirror(0.0)) for j in jobs)  # every request on a replica holding nothing
    loads = [m.routed_flops for m in frontend.mirrors]
    mean = sum(loads) / len(loads)
    source = "the engine's Θ" if sat is not None else "no Θ: one batch of the token budget"
    how = f"in {rounds} rounds" if rounds else "as they arrive, each replica running shares"
    out = [f"routing ({routing}) of {len(jobs)} requests over {replicas} replicas {how}, each filled to "
           f"{theta:.3g} FLOPs ({source}); caches taken as never evicting:"]
    for e, m in enumerate(frontend.mirrors):
        out.append(f"  replica {e}: {m.routed} requests, {m.routed_flops:.3g} FLOPs (Eq. 2, after sharing)")
    out.append(f"  busiest replica {max(loads) / mean:.2f}x the mean load; sharing saves "
               f"{1 - sum(loads) / alone:.1%} of {alone:.3g} FLOPs" if mean and alone else "  nothing to route")
    return "\n".join(out)

