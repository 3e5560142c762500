"""MoE-Prefill's frontend (§7.2-7.4, App. A, B.2-B.3): per-replica mirrors of the prefix cache (committed and
pending tables) and of the load (W, true FLOPs); rounds that route each job to the unsaturated replica with the
longest held prefix, mark replicas saturated at Θ and spill a popular prefix to the next-best replica; requests as
jobs with Eq. 2 costs. Pure bookkeeping: synthetic jobs with made-up block hashes, real requests over the tiny
preset's config; no model, no device."""
import functools
import hashlib
import random
from collections import Counter, deque

import pytest

from moejax.config import ModelConfig
from moejax.costs import true_prefill_flops
from moejax.models.kv_pool import BLOCK
from moejax.presets import preset_config
from moejax.replicas.frontend import Frontend, Job, ReplicaMirror
from moejax.replicas.frontend_jobs import request_job
from moejax.replicas.frontend_plan import plan_routing
from moejax.requests.parse import Candidate, CompletionRequest, ScoreRequest
from moejax.sampling import SamplingParams
from moejax.sched.prefix_cache import PrefixCache, block_hashes

TINY = ModelConfig.from_hf(preset_config("tiny-qwen3-moe"))
BIG = 1e18  # a Θ no test's queue reaches: one round takes the whole queue

# App. A's rounds as the paper writes them: every round fills replicas to Θ (no even split of a run's last round,
# which test_a_short_queue_is_split_evenly checks)
AppA = functools.partial(Frontend, even_end=False)


def h(name: str) -> bytes:
    return hashlib.blake2b(name.encode(), digest_size=16).digest()


PREFIX = (h("p0"), h("p1"))  # a popular two-block prefix


def job(key: int, blocks: tuple[bytes, ...], per_block: float = 10.0) -> Job:
    """A job whose blocks are `blocks`, stores them all, and costs per_block FLOPs for each leading block the
    replica does not hold (the shape of Eq. 2: held blocks are not computed again)."""
    return Job(key, blocks, blocks, lambda holder: per_block * (len(blocks) - holder.readable(blocks)))


def shared(key: int) -> Job:
    """The popular prefix, then one block of the job's own."""
    return job(key, PREFIX + (h(f"own{key}"),))


def flat(key: int, cost: float) -> Job:
    """A job with no blocks: the same cost everywhere."""
    return Job(key, (), (), lambda holder: cost)


def keys(out: dict[int, list[Job]]) -> dict[int, list[int]]:
    return {e: [j.key for j in jobs] for e, jobs in out.items()}


def stored(*jobs: Job) -> list[tuple]:
    """The events a replica reports after running `jobs`: every block they store is in its cache now."""
    return [("stored", b) for j in jobs for b in j.stores]


# -- same prefix, same replica (§7.2) ----------------------------------------------------------------------------


def test_prefix_routing_keeps_a_shared_prefix_on_one_replica_within_a_round():
    """The first job promises the prefix (pending table); the rest find it there and follow, each paying only its
    own block, although another replica is idle."""
    f = AppA([BIG] * 3)
    out = f.round(deque(shared(k) for k in range(6)))
    assert keys(out) == {0: list(range(6))}
    assert f.mirrors[0].pending[PREFIX[0]] == f.mirrors[0].pending[PREFIX[1]] == 6
    assert f.mirrors[0].work == 30 + 5 * 10  # one prefix pass, then own blocks only
    assert f.mirrors[1].work == f.mirrors[2].work == 0


def test_round_robin_spreads_a_shared_prefix():
    f = AppA([BIG] * 3, "round_robin")
    out = f.round(deque(shared(k) for k in range(6)))
    assert keys(out) == {0: [0, 3], 1: [1, 4], 2: [2, 5]}
    assert [m.work for m in f.mirrors] == [40, 40, 40]  # three prefix passes where prefix routing needs one


def test_committed_prefix_attracts_the_next_rounds_jobs():
    """Round 1 puts the prefix on replica 1 (replica 0 took an unrelated job first). Once replica 1 reports its jobs
    done with its cache's stored events, the prefix is committed there and nothing is pending or owed; round 2's
    jobs with the same prefix go to replica 1 (without the table the tie of idle replicas would pick 0) and pay only
    their own block."""
    f = AppA([BIG] * 3)
    other = job(100, (h("x0"),))
    first = [shared(k) for k in range(3)]
    assert keys(f.round(deque([other, *first]))) == {0: [100], 1: [0, 1, 2]}
    f.finished(0, [100], stored(other))
    f.finished(1, [0, 1, 2], stored(*first))
    m = f.mirrors[1]
    assert m.committed == set(PREFIX) | {h(f"own{k}") for k in range(3)}
    assert m.pending == Counter() and m.work == 0 and f.in_flight(1) == []

    assert keys(f.round(deque(shared(k) for k in range(3, 6)))) == {1: [3, 4, 5]}
    assert m.work == 3 * 10


# -- spill (§7.4, App. A) ----------------------------------------------------------------------------------------


def test_popular_prefix_spills_to_the_next_best_unsaturated_replica():
    """Θ = 100 everywhere. Replica 0 holds the whole prefix, 2 and 3 its first block (2 with more load), 1 and 4
    nothing. Jobs cost 10 per block not held. Replica 0 takes jobs at 10 until W = 100; the next job goes to the
    longest match among the rest (2 and 3: one block), the less loaded of them (3), and the jobs after it follow it
    there (two blocks now, one pending); then 2; then the tie of 1 and 4 (no match, W = 0) goes to the lower index.
    The round ends when every replica is saturated; the rest stays queued."""
    f = AppA([100.0] * 5)
    f.mirrors[0].apply([("stored", PREFIX[0]), ("stored", PREFIX[1])])
    for e in (2, 3):
        f.mirrors[e].apply([("stored", PREFIX[0])])
    f.assign(2, flat(900, 20.0))
    f.assign(3, flat(901, 5.0))
    queue = deque(shared(k) for k in range(45))
    out = f.round(queue)
    assert keys(out) == {0: list(range(0, 10)),  # 10 x 10
                         3: list(range(10, 19)),  # 5 + 20 + 8 x 10 = 105
                         2: list(range(19, 26)),  # 20 + 20 + 6 x 10 = 100
                         1: list(range(26, 34)),  # 30 + 7 x 10
                         4: list(range(34, 42))}
    assert [m.work for m in f.mirrors] == [100, 100, 100, 105, 100]
    assert [j.key for j in queue] == [42, 43, 44]


# -- saturation bound (§7.4) -------------------------------------------------------------------------------------


@pytest.mark.parametrize("routing", ["prefix", "round_robin", "random"])
@pytest.mark.parametrize("seed", range(5))
def test_round_fills_each_replica_to_its_theta_and_leaves_the_rest_queued_in_order(routing, seed):
    """Replicas are marked saturated one at a time, so after a round that the queue outlasts each W lies in
    [Θ_e, Θ_e + the largest job cost). The round takes the queue's front in FIFO order and stops once all are
    saturated; a second round then routes nothing."""
    rng = random.Random(seed)
    thetas = [50.0, 120.0, 75.0, 200.0, 10.0]
    costs = [float(rng.randint(1, 40)) for _ in range(200)]
    jobs = [flat(k, c) for k, c in enumerate(costs)]
    f = Frontend(thetas, routing, seed=seed)
    queue = deque(jobs)
    out = f.round(queue)
    for e, m in enumerate(f.mirrors):
        assert m.theta <= m.work < m.theta + max(costs), (e, m.work)
        assert m.saturated
        assert m.work == sum(j.cost(m) for j in out[e])
    taken = sorted(k for e in out for k in keys(out)[e])
    assert taken == list(range(len(taken)))  # the queue's front
    assert all(ks == sorted(ks) for ks in keys(out).values())  # each replica's jobs in queue order
    assert list(queue) == jobs[len(taken):]
    assert f.round(queue) == {} and list(queue) == jobs[len(taken):]


# -- Eq. 2 costs of real requests (§7.3) -------------------------------------------------------------------------


def tokens(n: int, seed: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(1, TINY.vocab_size) for _ in range(n))


def completion(prompt: tuple[int, ...], max_tokens: int, n: int) -> CompletionRequest:
    return CompletionRequest(1, "c", prompt, max_tokens, SamplingParams(seed=0), (), (), n=n, echo=max_tokens == 0)


def score(prompt: tuple[int, ...], candidates: list[tuple[int, ...]],
          suffixes: tuple[tuple[int, ...], ...] = ()) -> ScoreRequest:
    return ScoreRequest(1, "s", prompt, suffixes, tuple(Candidate(None, c) for c in candidates))


def holding(hashes) -> ReplicaMirror:
    m = ReplicaMirror(BIG)
    m.apply(("stored", x) for x in hashes)
    return m


def always(_: bytes) -> bool:
    return True


@pytest.mark.parametrize("max_tokens, n", [(4, 2), (0, 1)])
@pytest.mark.parametrize("held", [[], [0], [0, 1], [0, 1, 2, 3], [0, 2]])
def test_completion_costs_its_prompt_after_the_held_leading_blocks_plus_its_choices(held, max_tokens, n):
    """Eq. 2: the prompt's tokens after the leading blocks the replica holds, attending to them, plus n choices of
    max_tokens after the whole prompt. A block held after a gap is no help."""
    prompt = tokens(4 * BLOCK + 3, 1)
    blocks = block_hashes(prompt)
    job_ = request_job(7, completion(prompt, max_tokens, n), TINY, always)
    run = 0
    while run < len(held) and held[run] == run:
        run += 1
    cached = run * BLOCK
    decode = n * true_prefill_flops(TINY, max_tokens, len(prompt)) if max_tokens else 0
    expected = true_prefill_flops(TINY, len(prompt) - cached, cached) + decode
    assert job_.cost(holding(blocks[i] for i in held)) == expected
    assert job_.key == 7 and job_.tokens == len(prompt)


def test_completion_whose_prompt_is_whole_blocks_computes_its_last_block():
    """At least the last prompt token is computed, so a prompt of whole blocks matches on all but its last block
    and, held entirely, still computes that block."""
    prompt = tokens(4 * BLOCK, 2)
    blocks = block_hashes(prompt)
    job_ = request_job(0, completion(prompt, 0, 1), TINY, always)
    assert job_.match == tuple(blocks[:3])
    assert job_.cost(holding(blocks)) == true_prefill_flops(TINY, BLOCK, 3 * BLOCK)


def test_completion_stores_the_blocks_its_replica_keeps():
    prompt = tokens(4 * BLOCK + 3, 3)
    blocks = block_hashes(prompt)
    job_ = request_job(0, completion(prompt, 4, 1), TINY, lambda b: b != blocks[1])
    assert job_.stores == (blocks[0], blocks[2], blocks[3])
    assert job_.match == tuple(blocks)
    assert request_job(0, completion(prompt, 4, 1), TINY, lambda b: False).stores == ()


@pytest.mark.parametrize("held", [0, 3, 5])
def test_score_request_with_two_candidates_computes_the_shared_context_once(held):
    """Two candidates of two tokens: two sequences, context + each candidate's first token. The context is computed
    once (after the held leading blocks), the second sequence only its last token, attending to the context."""
    prompt = tokens(5 * BLOCK + 2, 4)
    blocks = block_hashes(prompt)
    job_ = request_job(0, score(prompt, [(5, 6), (7, 8)]), TINY, always)
    L, cached = len(prompt), held * BLOCK
    expected = true_prefill_flops(TINY, L + 1 - cached, cached) + true_prefill_flops(TINY, 1, L)
    cost = job_.cost(holding(blocks[:held]))
    assert cost == expected
    assert cost < 2 * true_prefill_flops(TINY, L + 1 - cached, cached)  # not two full passes
    assert job_.match == tuple(blocks) and job_.tokens == L


def test_score_request_held_entirely_recomputes_its_last_context_token():
    """The last context token is read (its logits score the first candidate token), so it is computed even when
    every context block is held."""
    prompt = tokens(4 * BLOCK, 5)
    L = len(prompt)
    job_ = request_job(0, score(prompt, [(5, 6), (7, 8)]), TINY, always)
    expected = true_prefill_flops(TINY, 2, L - 1) + true_prefill_flops(TINY, 1, L)
    assert job_.cost(holding(block_hashes(prompt))) == expected


def test_score_request_matches_its_first_context_and_stores_every_siblings_kept_blocks():
    """Siblings (prompt + suffix) share the prompt's blocks: routing matches the first context; the stored blocks
    are every context's, each once, those the replica keeps."""
    prompt = tokens(2 * BLOCK, 6)
    suffixes = (tokens(BLOCK + 5, 7), tokens(BLOCK + 5, 8))
    req = score(prompt, [(5,)], suffixes)
    first, second = (block_hashes(c) for c in req.contexts)
    assert first[:2] == second[:2] and first[2] != second[2]
    job_ = request_job(0, req, TINY, always)
    assert job_.match == tuple(first)
    assert job_.stores == (*first, second[2])
    assert request_job(0, req, TINY, lambda b: b != first[2]).stores == (first[0], first[1], second[2])
    assert job_.tokens == 2 * (3 * BLOCK + 5)


def test_pending_blocks_count_as_held():
    """In-round reuse (B.2): a block promised by a job routed earlier in the round counts like a committed one."""
    prompt = tokens(3 * BLOCK + 1, 9)
    req = completion(prompt, 2, 1)
    committed, pending = holding(block_hashes(prompt)), ReplicaMirror(BIG)
    pending.pending.update(block_hashes(prompt))
    job_ = request_job(0, req, TINY, always)
    assert job_.cost(pending) == job_.cost(committed) < job_.cost(ReplicaMirror(BIG))


# -- the mirror follows the replica's cache (B.3) ----------------------------------------------------------------


def test_mirror_applying_the_caches_events_equals_the_cache():
    """Random begin_batch / allocate / match / clear on a small cache (evicting, refusing when full of the current
    batch, clearing), its recorded events applied to a mirror after every step: the committed table is the cache's
    table throughout."""
    pool = [h(f"b{i}") for i in range(10)]
    seen = Counter()
    for seed in range(10):
        rng = random.Random(seed)
        cache, mirror = PrefixCache(4, record=True), ReplicaMirror(BIG)
        for step in range(300):
            op = rng.random()
            if op < 0.15:
                cache.begin_batch()
            elif op < 0.75:
                seen["refused" if cache.allocate(rng.choice(pool)) is None else "allocated"] += 1
            elif op < 0.97:
                seen["hit"] += bool(cache.match(rng.sample(pool, rng.randint(1, 4))))
            else:
                cache.clear()
                seen["cleared"] += 1
            mirror.apply(cache.take_events())
            assert mirror.committed == cache.hashes(), (seed, step)
        seen["evicted"] += cache.evictions
    assert min(seen[k] for k in ("allocated", "refused", "hit", "cleared", "evicted")) > 0, seen


# -- decay, lost replicas, bad input (B.2) -----------------------------------------------------------------------


@pytest.mark.parametrize("costs, order", [
    ([0.1, 0.2, 0.3], [0, 1, 2]),
    # FLOPs of a long prompt on a large MoE and of a shorter one: past 2**53 floats are 2 apart, so W rounds up
    ([8e15 + 3, 2e15], [0, 1]),
])
def test_finished_returns_w_to_exactly_zero_and_empties_pending(costs, order):
    """W decays by the costs it grew by; once every job is reported the replica is exactly idle, whatever the
    float sums of the costs did (an idle replica that is not at 0 loses ties it should win)."""
    f = AppA([BIG, BIG])
    jobs = [Job(k, (h(f"b{k}"),), (h(f"b{k}"), PREFIX[0]), lambda holder, c=c: c) for k, c in enumerate(costs)]
    for j in jobs:
        f.assign(0, j)
    assert f.mirrors[0].pending[PREFIX[0]] == len(jobs)
    for k in order:
        f.finished(0, [k])
    assert f.mirrors[0].work == 0.0
    assert f.mirrors[0].pending == Counter() and f.in_flight(0) == []
    assert keys(f.round(deque([flat(9, 1.0)]))) == {0: [9]}  # the idle tie goes to the lower index


def test_finished_decays_only_the_reported_jobs():
    f = AppA([BIG])
    jobs = [shared(k) for k in range(4)]
    f.round(deque(jobs))  # costs 30, 10, 10, 10
    f.finished(0, [0, 2], stored(jobs[0], jobs[2]))
    m = f.mirrors[0]
    assert m.work == 20
    assert m.pending == Counter({PREFIX[0]: 2, PREFIX[1]: 2, h("own1"): 1, h("own3"): 1})
    assert f.in_flight(0) == [1, 3]
    f.finished(0, [3, 1])
    assert m.work == 0 and m.pending == Counter()


def test_lost_replica_returns_its_jobs_in_flight_and_takes_no_more():
    f = AppA([BIG] * 3)
    mine = [shared(k) for k in (9, 2, 5)]
    out = f.round(deque([flat(50, 1.0), *mine, flat(60, 1.0)]))
    assert keys(out) == {0: [50], 1: [9, 2, 5], 2: [60]}
    back = f.lost(1)
    assert [j.key for j in back] == [2, 5, 9]
    assert all(b is next(j for j in mine if j.key == b.key) for b in back)
    m = f.mirrors[1]
    assert not m.alive and m.work == 0 and not m.committed and not m.pending
    assert f.in_flight(1) == [] and f.alive() == [0, 2]

    # Replica 1 (W = 0 while 50 and 60 load the others) would win every tie; it gets nothing, now or later.
    for _ in range(3):
        out = f.round(deque([*back, flat(70, 1.0)]))
        assert 1 not in out and sorted(k for e in out for k in keys(out)[e]) == [2, 5, 9, 70]
        for e, js in out.items():
            f.finished(e, [j.key for j in js], stored(*js))
    f.finished(0, [50])
    f.finished(2, [60])
    assert [m.work for m in f.mirrors] == [0, 0, 0]


def test_unknown_cache_event_is_an_error():
    f = AppA([BIG])
    with pytest.raises(ValueError, match=r"unknown prefix-cache event \('moved'"):
        f.finished(0, [], [("stored", h("a")), ("moved", h("a"))])


def test_bad_frontend_arguments_are_errors_that_name_the_problem():
    with pytest.raises(ValueError, match="at least one replica"):
        Frontend([])
    with pytest.raises(ValueError, match=r"routing must be one of .*'least_loaded'"):
        Frontend([1.0], "least_loaded")


# -- random routing ----------------------------------------------------------------------------------------------


def test_random_routing_is_reproducible_by_seed_and_uses_every_replica():
    def routed(seed: int) -> dict[int, list[int]]:
        return keys(AppA([BIG] * 4, "random", seed=seed).round(deque(shared(k) for k in range(200))))

    first = routed(3)
    assert first == routed(3)
    assert sorted(first) == [0, 1, 2, 3]  # the shared prefix does not hold it to one replica
    assert routed(4) != first


def test_a_short_queue_is_split_evenly():
    """A round with less work queued than its replicas' Θ add up to (a run's last) fills each to an even part, so
    the run ends balanced: the busiest replica within one job of the mean, where App. A leaves it at Θ and the
    others short."""
    jobs = [Job(k, (bytes([k]) * 16,), (), lambda holder: 10.0) for k in range(40)]  # 400 FLOPs in all
    even = Frontend([1000.0] * 4)
    loads = [sum(10.0 for _ in share) for share in even.round(deque(jobs)).values()]
    assert len(loads) == 4 and max(loads) - min(loads) <= 10.0
    plain = AppA([1000.0] * 4)
    assert [len(s) for s in plain.round(deque(jobs)).values()] == [10, 10, 10, 10]  # (no prefix: least W)
    heavy = [Job(k, (b"p" * 16,), (b"p" * 16,), lambda holder: 10.0) for k in range(40)]  # one shared prefix
    assert list(AppA([1000.0] * 4).round(deque(heavy))) == [0]  # App. A keeps it on one replica
    assert len(Frontend([1000.0] * 4).round(deque(heavy))) == 4  # the even end spreads the last round


def test_depth_two_queues_a_second_share_behind_the_running_one():
    """depth=2 (the replica driver's): a round adds about Θ to each replica; a second round right after adds
    another Θ (the share queued behind the running one); a third adds nothing until one finishes, and then only
    that replica's Θ more."""
    jobs = deque(Job(k, (bytes([k % 250]) * 16,), (), lambda holder: 10.0) for k in range(100))
    f = Frontend([30.0, 30.0], depth=2)
    first, second, third = f.round(jobs), f.round(jobs), f.round(jobs)
    assert [len(first[e]) for e in (0, 1)] == [3, 3] and [len(second[e]) for e in (0, 1)] == [3, 3]
    assert third == {} and [m.work for m in f.mirrors] == [60.0, 60.0]
    f.finished(0, [j.key for j in first[0]])
    fourth = f.round(jobs)
    assert list(fourth) == [0] and len(fourth[0]) == 3 and f.mirrors[0].work == 60.0
    with pytest.raises(ValueError, match="depth must be at least 1"):
        Frontend([1.0], depth=0)


def test_the_last_round_evens_the_run_totals():
    """The even level of a run's last round counts what earlier rounds routed: a replica an earlier round filled
    60 FLOPs further gets that much less now (totals 70 and 70, not 60 + 40 and 40)."""
    f = Frontend([100.0, 100.0])
    f.mirrors[0].routed_flops = 60.0  # as a first round that gave replica 0 one large request more, long finished
    out = f.round(deque(Job(k, (bytes([k]) * 16,), (), lambda holder: 10.0) for k in range(8)))
    assert [len(out.get(e, [])) for e in (0, 1)] == [1, 7]
    assert [m.routed_flops for m in f.mirrors] == [70.0, 70.0]
    with pytest.raises(ValueError, match="Θ must be above 0"):
        Frontend([100.0, 0.0])


# -- least requests in flight (vLLM's router: MoE-Prefill Fig. 10's third baseline) --------------------------------


def test_least_requests_routes_each_arrival_to_the_replica_with_fewest_in_flight():
    """Arrivals and completions interleaved: each request goes, when it arrives, to the live replica with the
    fewest requests routed and not reported done (ties to the lowest index), whatever its cost or prefix."""
    f = Frontend([BIG] * 3, "least_requests")
    assert [f.route(shared(k)) for k in range(3)] == [0, 1, 2]  # all idle: by index, the prefix held nowhere else
    assert f.route(flat(3, 1e6)) == 0  # 1, 1, 1 in flight: the tie to replica 0, though it is the heaviest now
    f.finished(2, [2])  # replica 2 done: 2, 1, 0 in flight
    assert f.route(shared(4)) == 2  # not replica 0, which holds its prefix pending
    assert f.route(shared(5)) == 1  # 2, 1, 1: the tie to 1
    f.finished(0, [0, 3])  # 0, 2, 1
    assert [f.route(flat(k, 1.0)) for k in (6, 7, 8)] == [0, 0, 2]
    assert [m.requests for m in f.mirrors] == [2, 2, 2] == [len(f.in_flight(e)) for e in range(3)]
    back = f.lost(1)  # a lost replica takes no more; its requests are routed again by the same rule
    assert [j.key for j in back] == [1, 5] and f.mirrors[1].requests == 0
    assert [f.route(j) for j in back] == [0, 2]


def test_least_requests_has_no_rounds_and_shares_what_a_replica_was_sent_by_its_theta():
    f = Frontend([25.0, 25.0], "least_requests")
    with pytest.raises(ValueError, match="routes each request as it arrives"):
        f.round(deque([flat(0, 1.0)]))
    with pytest.raises(ValueError, match="routes in rounds"):
        Frontend([1.0]).route(flat(0, 1.0))
    sent: dict[int, deque] = {0: deque(), 1: deque()}
    for k, cost in enumerate([10.0, 1.0, 10.0, 1.0, 10.0, 1.0, 30.0]):
        sent[f.route(flat(k, cost))].append(flat(k, cost))
    assert [[j.key for j in sent[e]] for e in (0, 1)] == [[0, 2, 4, 6], [1, 3, 5]]  # by count: 70 and 3 FLOPs
    assert [j.key for j in f.share(0, sent[0])] == [0, 2, 4]  # until its Θ (25) is reached
    assert [j.key for j in f.share(0, sent[0])] == [6]  # one job at least, however large
    assert [j.key for j in f.share(1, sent[1])] == [1, 3, 5] and not sent[1]
    with pytest.raises(ValueError, match="in flight on replica 0, not 1"):
        f.share(1, deque([flat(0, 10.0)]))


def test_explains_plan_routes_least_requests_without_rounds():
    frontend, rounds = plan_routing([shared(k) for k in range(7)], [15.0] * 3, "least_requests")
    assert rounds == 0 and [m.routed for m in frontend.mirrors] == [3, 2, 2]
    assert not any(frontend.in_flight(e) for e in range(3)) and all(m.requests == 0 for m in frontend.mirrors)
    assert frontend.mirrors[0].committed >= set(PREFIX)  # every share taken as finished, its blocks stored
