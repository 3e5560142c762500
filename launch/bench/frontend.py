"""`python -m launch.bench frontend`: MoE-Prefill's frontend (moejax.replicas.frontend, §7 and App. A) routing
shared-prefix scoring requests over N replicas, simulated from a hardware profile: no devices, pure Python,
deterministic for a seed (MoE-Prefill §8.3, Fig. 10: prefix-aware routing keeps prefix reuse as GPUs are added,
random dispatch scatters same-prefix requests).

Workload: P prefixes of L_p random tokens, Zipf popularity (prefix of rank r drawn with weight 1/r^s); each request
is one prefix, a unique suffix of L_s tokens and 2-4 candidates of 1-3 tokens, as a real ScoreRequest, made a job
by moejax.replicas.frontend_jobs.request_job (the engine's block hasher, Eq. 2 costs by tree_flops), queued FIFO at
time 0 (an offline batch). Every block of a context is stored (kv_cache "on").

Replica: one device running the whole model. Its prefix cache is a real PrefixCache(record=True) of
--cache-share of what moejax.sched.pool_size leaves a KV pool (device memory x (1 - RESERVE_FRACTION/2) - the
weights), in blocks of the model's KV bytes per token; the same for every N. Θ per replica: Eq. 1
(moejax.plan.theta.theta_eq1, mode async_ep over the N devices: Θ / N each, the paper's DP+AsyncEP); at N = 1 one
device gathers no experts and Θ falls back to the FLOPs of one batch of the token budget (Eq. 3 with the transfers
hidden: Θ = F_ref). A share of F FLOPs keeps its replica busy L x max(F / L / rate, T_comm) + --overhead-ms, rate =
the profile's peak x --efficiency (a layer waits for the next layer's experts when its compute is shorter).

Loop, event-driven: a round (Frontend.round) routes the queue's head onto the open replicas; each executes its share
against its own cache, job by job in queue order: the FLOPs it computes are each job's cost against the cache as it
is (blocks an earlier job of the share stored are readable: in-share sharing, one prefix pass for the share), then
the job's blocks are stored (LRU); the cache's events reach the frontend (Frontend.finished) when the share ends.
--rounds sync (default): a round opens every replica once all are idle (App. A: the round fills each to Θ, so they
end close together). --rounds async: a round opens whichever replicas finished; with a deep queue that is mostly one
replica, which every routing must give the queue's head: the routings then differ little (the first round, and
replicas that happen to finish together). --routings least_requests (vLLM's router, MoE-Prefill Fig. 10's third
baseline) has no rounds: every job arrives at time 0 and goes at once to the replica with the fewest jobs routed and
not finished (so by count, whatever their cost or prefix), and each replica runs what it was sent in shares of its Θ,
the next as soon as one ends (--rounds does not apply to it).

Hit rate: cached prompt tokens / prompt tokens; a job's cached tokens are its leading context blocks the replica's
cache holds when the job runs (including blocks stored by earlier jobs of the same share), at most all but the
context's last token (it is recomputed: tree_flops). The single-engine reference is the same simulation at N = 1.
Target: prefix routing keeps >= 90% of the single engine's hit rate at every N, the busiest replica's
computed FLOPs within 10% of the mean."""
from __future__ import annotations

import argparse
import dataclasses
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from launch.bench.frontend_real import real_run
from launch.bench.results import no_file
from moejax.config import ModelConfig
from moejax.costs import param_count, true_prefill_flops
from moejax.lightning.at_load import kv_bytes_per_token
from moejax.models.kv_pool import BLOCK
from moejax.offload.memory_budget import RESERVE_FRACTION
from moejax.plan.hardware import Profile
from moejax.plan.resolve import profile_for
from moejax.plan.theta import theta_eq1
from moejax.presets import preset_config
from moejax.replicas.frontend import PER_REQUEST, ROUTINGS, Frontend, Job
from moejax.replicas.frontend_jobs import request_job
from moejax.requests.parse import Candidate, ScoreRequest
from moejax.sched.batch_size import DEFAULT_TOKENS
from moejax.sched.prefix_cache import BlockHolder, PrefixCache

NOTE = ("A simulation from a hardware profile, no devices: the replicas' caches and the frontend are the real "
        "moejax objects, the time is FLOPs at the profile's peak x efficiency (launch/bench/frontend.py)")
HIT_SHARE, BALANCE = 0.9, 1.10  # the target: hit rate >= 90% of the single engine's, busiest <= 1.10 x mean


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    prefixes: int
    prefix_len: int
    suffix_len: int
    requests: int
    zipf: float = 1.0


WORKLOADS = {w.name: w for w in (Workload("short", 200, 512, 64, 12000), Workload("long", 50, 4096, 256, 3000))}


def make_requests(w: Workload, vocab: int, seed: int) -> list[ScoreRequest]:
    rng = np.random.default_rng(seed)
    prefixes = [tuple(rng.integers(0, vocab, w.prefix_len).tolist()) for _ in range(w.prefixes)]
    weights = 1.0 / np.arange(1, w.prefixes + 1) ** w.zipf
    drawn = rng.choice(w.prefixes, size=w.requests, p=weights / weights.sum())
    out = []
    for i, p in enumerate(drawn.tolist()):
        cands = tuple(Candidate(None, tuple(rng.integers(0, vocab, rng.integers(1, 4)).tolist()))
                      for _ in range(rng.integers(2, 5)))
        out.append(ScoreRequest(i + 1, f"r{i}", prefixes[p] + tuple(rng.integers(0, vocab, w.suffix_len).tolist()),
                                (), cands))
    return out


def make_jobs(requests: list[ScoreRequest], cfg: ModelConfig) -> list[Job]:
    """request_job's jobs, every block stored, each cost memoized by how many leading blocks the holder has: a
    one-context request's sequences all read the context whose hashes are `match`, so tree_flops depends on the
    holder through holder.readable(match) alone (and the simulations evaluate the same few costs many times)."""
    jobs = []
    for key, req in enumerate(requests):
        if len(req.contexts) != 1:
            raise ValueError(f"make_jobs: request {req.custom_id} has {len(req.contexts)} contexts; the memoized "
                             "cost holds for one-context requests only")
        job = request_job(key, req, cfg, lambda h: True)
        jobs.append(dataclasses.replace(job, cost=_memo(job)))
    return jobs


def _memo(job: Job) -> Callable[[BlockHolder], float]:
    table: dict[int, float] = {}

    def cost(holder: BlockHolder) -> float:
        n = holder.readable(job.match)
        if n not in table:
            table[n] = job.cost(holder)
        return table[n]
    return cost


@dataclasses.dataclass(frozen=True)
class Timing:
    """How long a share keeps its replica busy (module docstring)."""
    rate: float  # FLOP/s: peak x efficiency
    layers: int
    t_comm_s: float  # per layer, the slowest expert transfer (0: none)
    overhead_s: float

    def busy(self, flops: float) -> float:
        return self.layers * max(flops / self.layers / self.rate, self.t_comm_s) + self.overhead_s


class Replica:
    """One simulated engine: its prefix cache and what it computed."""

    def __init__(self, capacity_blocks: int) -> None:
        self.cache = PrefixCache(capacity_blocks, record=True)
        self.flops = 0.0
        self.tokens = 0
        self.cached = 0
        self.shares = 0

    def run(self, jobs: list[Job]) -> tuple[float, list[tuple]]:
        """Executes a share (module docstring) -> (its FLOPs, the cache's events)."""
        flops = 0.0
        for job in jobs:
            self.cache.begin_batch()  # what earlier jobs of the share stored is readable now
            cost = job.cost(self.cache)
            hit = len(self.cache.match(job.match))  # marks them used (LRU)
            flops += cost
            self.tokens += job.tokens
            self.cached += min(hit * BLOCK, job.tokens - 1)
            for h in job.stores:
                if h not in self.cache:
                    self.cache.allocate(h)
        self.cache.begin_batch()
        self.flops += flops
        self.shares += 1
        return flops, self.cache.take_events()


@dataclasses.dataclass
class Run:
    row: dict
    frontend: Frontend
    replicas: list[Replica]


def simulate_one(jobs: list[Job], n: int, routing: str, *, theta: float, timing: Timing, capacity_blocks: int,
                 seed: int = 0, barrier: bool = True) -> Run:
    """The frontend routing `jobs` over n replicas (module docstring)."""
    start = time.perf_counter()
    frontend = Frontend([theta] * n, routing, seed=seed)
    replicas = [Replica(capacity_blocks) for _ in range(n)]
    queue = deque(jobs)
    running: dict[int, tuple[float, list[int], list[tuple]]] = {}  # replica -> (ends at, job keys, cache events)
    now, rounds = 0.0, 0
    sent: dict[int, deque[Job]] = {e: deque() for e in range(n)}  # least_requests: routed, not started
    if routing in PER_REQUEST:  # every job arrives at time 0 and is routed at once; no rounds
        for job in jobs:
            sent[frontend.route(job)].append(job)
        queue.clear()
    while queue or running or any(sent.values()):
        idle = [e for e in range(n) if e not in running]
        for e in idle:  # least_requests: a replica idle with jobs sent runs the next share of them (its Θ)
            if sent[e]:
                flops, events = replicas[e].run(share := frontend.share(e, sent[e]))
                running[e] = (now + timing.busy(flops), [j.key for j in share], events)
        if queue and idle and not (barrier and running):
            rounds += 1
            for e, share in frontend.round(queue, idle).items():
                flops, events = replicas[e].run(share)
                running[e] = (now + timing.busy(flops), [j.key for j in share], events)
        if not running:
            raise AssertionError(f"a round left {len(queue)} jobs queued and every replica idle")
        now = min(end for end, _, _ in running.values())
        for e in sorted(e for e, (end, _, _) in running.items() if end <= now):
            _, keys, events = running.pop(e)
            frontend.finished(e, keys, events)
    flops_each = [r.flops for r in replicas]
    tokens, cached = sum(r.tokens for r in replicas), sum(r.cached for r in replicas)
    routed = sum(m.routed_flops for m in frontend.mirrors)
    row = dict(routing=routing, replicas=n, theta_flops=theta, hit_rate=cached / tokens, prompt_tokens=tokens,
               cached_tokens=cached, flops_balance=max(flops_each) / (sum(flops_each) / n),
               total_flops=sum(flops_each), flops_per_replica=flops_each,
               routed_over_computed=routed / sum(flops_each), makespan_s=now, tokens_per_s=tokens / now,
               rounds=rounds, shares=[r.shares for r in replicas],
               evictions=sum(r.cache.evictions for r in replicas), sim_s=time.perf_counter() - start)
    return Run(row, frontend, replicas)


def cache_blocks(cfg: ModelConfig, profile: Profile, share: float) -> tuple[int, str]:
    """Blocks of `share` of what moejax.sched.pool_size leaves a KV pool beside the whole model's weights."""
    dtype = {2: "bfloat16", 4: "float32"}[profile.dtype_bytes]
    weights = param_count(cfg) * profile.dtype_bytes
    room = profile.device.memory_bytes * (1 - RESERVE_FRACTION / 2) - weights
    per_token = kv_bytes_per_token(cfg, dtype)
    if room <= 0:
        raise ValueError(f"bench frontend: the model's {weights / 2**30:.1f} GiB of weights leave no room for a "
                         f"prefix cache on {profile.device.name}")
    blocks = int(share * room // (per_token * BLOCK))
    return blocks, (f"{share:g} x ({profile.device.memory_bytes / 2**30:.0f} GiB x {1 - RESERVE_FRACTION / 2:g} - "
                    f"{weights / 2**30:.1f} GiB of {dtype} weights) / ({per_token} B/token x {BLOCK}) = {blocks} "
                    "blocks")


def theta_for(cfg: ModelConfig, profile: Profile, n: int) -> tuple[float, float, str]:
    """-> (Θ per replica in true FLOPs, T_comm per layer, where Θ came from)."""
    if n == 1:
        return (true_prefill_flops(cfg, DEFAULT_TOKENS), 0.0,
                f"one device gathers no experts: Θ = F_ref, one batch of the {DEFAULT_TOKENS}-token budget")
    est = theta_eq1(cfg, profile, mode="async_ep", devices=n)
    return est.theta_flops / n, est.t_comm_s, f"Eq. 1, async_ep over {n} devices, per device"


def simulate(workloads: list[Workload], replicas: list[int], routings: list[str], *, model: str = "qwen3-30b-a3b",
             profile: str = "h100", efficiency: float = 0.5, overhead_ms: float = 5.0, cache_share: float = 0.5,
             seed: int = 0, barrier: bool = True, record: dict | None = None,
             partial: Callable[[dict, str], None] = no_file) -> dict:
    """Every workload x routing x N, and the single engine (N = 1) per workload -> the record."""
    for r in routings:
        if r not in ROUTINGS:
            raise ValueError(f"bench frontend: routing {r!r} is not one of {', '.join(ROUTINGS)}")
    if not 0 < efficiency <= 1 or not 0 < cache_share <= 1:
        raise ValueError(f"bench frontend: efficiency ({efficiency}) and cache share ({cache_share}) must be in (0, 1]")
    cfg = ModelConfig.from_hf(preset_config(model))
    prof = profile_for(profile, 1, profile)
    capacity, capacity_how = cache_blocks(cfg, prof, cache_share)
    rate = prof.device.flops * efficiency
    out: dict[str, Any] = dict(record or {}, benchmark="frontend-sim", note=NOTE, model=model, profile=prof.name,
               profile_source=prof.source, efficiency=efficiency, rate_flops_per_s=rate, overhead_ms=overhead_ms,
               cache_blocks=capacity, cache_blocks_from=capacity_how, seed=seed,
               rounds="sync" if barrier else "async", workloads=[])
    for w in workloads:
        t0 = time.perf_counter()
        jobs = make_jobs(make_requests(w, cfg.vocab_size, seed), cfg)
        entry: dict[str, Any] = dict(workload=dataclasses.asdict(w), make_jobs_s=time.perf_counter() - t0, rows=[])
        out["workloads"].append(entry)
        for n in [1] + [n for n in replicas if n != 1]:
            theta, t_comm, source = theta_for(cfg, prof, n)
            timing = Timing(rate, cfg.num_layers, t_comm, overhead_ms / 1e3)
            for routing in (["prefix"] if n == 1 else routings):
                row = simulate_one(jobs, n, routing, theta=theta, timing=timing, capacity_blocks=capacity, seed=seed,
                                   barrier=barrier).row
                row.update(theta_from=source, t_comm_s=t_comm)
                if n == 1:
                    entry["single"] = row
                else:
                    single = entry["single"]["hit_rate"]
                    row["hit_vs_single"] = row["hit_rate"] / single if single else None  # None: no reuse at all
                    entry["rows"].append(row)
                partial(out, f"{w.name} {routing} N={n}")
        entry["target"] = check_target(entry)
    return out


def check_target(entry: dict) -> dict:
    """Prefix routing: hit rate >= HIT_SHARE x the single engine's and balance <= BALANCE at every N."""
    misses = [dict(replicas=r["replicas"], hit_vs_single=r["hit_vs_single"], flops_balance=r["flops_balance"])
              for r in entry["rows"] if r["routing"] == "prefix"
              and ((r["hit_vs_single"] or 1.0) < HIT_SHARE or r["flops_balance"] > BALANCE)]
    return dict(hit_share=HIT_SHARE, balance=BALANCE, holds=not misses, misses=misses)


def table(record: dict) -> list[str]:
    lines = []
    for entry in record["workloads"]:
        w, single = entry["workload"], entry["single"]
        lines.append(f"{w['name']}: {w['requests']} requests, {w['prefixes']} prefixes x {w['prefix_len']} + "
                     f"{w['suffix_len']} tokens, Zipf {w['zipf']:g}; single engine: hit {single['hit_rate']:.3f}, "
                     f"{single['total_flops'] / 1e15:.1f} PFLOP, {single['tokens_per_s']:,.0f} tok/s")
        lines.append("  routing           N    hit  /single  balance  PFLOP  rounds  makespan s       tok/s")
        for r in entry["rows"]:
            ratio = "   n/a" if r["hit_vs_single"] is None else f"{r['hit_vs_single']:6.3f}"
            lines.append(f"  {r['routing']:14s} {r['replicas']:4d}  {r['hit_rate']:.3f}  {ratio}  "
                         f"{r['flops_balance']:7.3f}  {r['total_flops'] / 1e15:5.1f}  {r['rounds']:6d}  "
                         f"{r['makespan_s']:10.2f}  {r['tokens_per_s']:10,.0f}")
        t = entry["target"]
        lines.append(f"  target (prefix: hit >= {t['hit_share']:.0%} of single, balance <= {t['balance']:.2f}): " +
                     ("holds at every N" if t["holds"] else "misses at " + ", ".join(
                         f"N={m['replicas']} (hit x{m['hit_vs_single'] or 0:.3f}, balance {m['flops_balance']:.3f})"
                         for m in t["misses"])))
    return lines


def _counts(text: str) -> list[int]:
    """--replicas: comma-separated replica counts, each >= 1."""
    try:
        counts = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 2,4,8; got {text!r}") from None
    if min(counts) < 1:
        raise argparse.ArgumentTypeError(f"replica counts must be >= 1; got {text!r}")
    return counts


def _routings(text: str) -> list[str]:
    bad = [r for r in text.split(",") if r not in ROUTINGS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown routing {bad[0]!r}; routings: {', '.join(ROUTINGS)}")
    return text.split(",")


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1; got {text!r}")
    return int(text)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = sub.add_parser("frontend", help="the frontend's routing over N replicas, simulated from a hardware profile")
    p.add_argument("--workloads", default="short,long", help=f"of {', '.join(WORKLOADS)}")
    p.add_argument("--requests", type=_positive, default=None, help="requests per workload (default: the workload's)")
    p.add_argument("--replicas", type=_counts, default="2,4,8,16,32,64",
                   help="replica counts N (N = 1 always runs: the reference)")
    p.add_argument("--routings", type=_routings, default=",".join(ROUTINGS))
    p.add_argument("--model", default="qwen3-30b-a3b", help="preset whose config prices the FLOPs")
    p.add_argument("--profile", default="h100", help="hardware profile: a datasheet name or a profile JSON")
    p.add_argument("--efficiency", type=float, default=0.5, help="achieved share of the profile's peak FLOP/s")
    p.add_argument("--overhead-ms", type=float, default=5.0, help="fixed time per share")
    p.add_argument("--cache-share", type=float, default=0.5,
                   help="share of the KV pool's room (memory - weights) each replica's prefix cache gets")
    p.add_argument("--rounds", default="sync", choices=["sync", "async"], help="see the module docstring")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None,
                   help="JSON file (default bench/results/frontend-sim.json, with --real frontend-real.json)")
    g = p.add_argument_group("--real: 2 engine replicas on this machine (Ray) under each routing, and one engine")
    g.add_argument("--real", action="store_true", help="run replicas for real instead of the simulation")
    g.add_argument("--real-model", default="pycode-moe")
    g.add_argument("--real-prefixes", type=_positive, default=6)
    g.add_argument("--real-prefix-len", type=_positive, default=96)
    g.add_argument("--real-suffix-len", type=_positive, default=8)
    g.add_argument("--real-requests", type=_positive, default=96)
    g.add_argument("--real-batch-tokens", type=_positive, default=512)
    return p


def frontend(args: argparse.Namespace, env: dict, partial: Callable[[dict, str], None] = no_file) -> dict:
    if args.real:
        return real_run(args, env, partial)
    workloads = []
    for name in args.workloads.split(","):
        if name not in WORKLOADS:
            raise SystemExit(f"bench frontend: unknown workload {name!r}; workloads: {', '.join(WORKLOADS)}")
        w = WORKLOADS[name]
        workloads.append(w if args.requests is None else dataclasses.replace(w, requests=args.requests))
    record = simulate(workloads, args.replicas, args.routings,
                      model=args.model, profile=args.profile, efficiency=args.efficiency,
                      overhead_ms=args.overhead_ms, cache_share=args.cache_share, seed=args.seed,
                      barrier=args.rounds == "sync", record=env, partial=partial)
    print("\n".join(table(record)))
    return record
