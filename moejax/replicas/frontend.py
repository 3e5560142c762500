"""MoE-Prefill's frontend (§7, App. A, B.2-B.3): which engine replica serves each request.

Per replica the frontend keeps a mirror (`ReplicaMirror`): the committed table (prefix blocks the replica's cache
holds, from the events it reports), the pending table (blocks promised by requests routed to it and not finished:
in-round reuse) and a work counter W in true FLOPs (moejax.costs.true_prefill_flops, Eq. 2 after in-round and
cross-round sharing; the unit of Θ too). A scheduling round (`Frontend.round`, App. A's Algorithm 1) drains the
FIFO queue: each request goes to an unsaturated replica (W < Θ), the one whose committed ∪ pending blocks match
the longest run of its leading blocks, ties and no match at all to the least loaded; W grows by the request's
Eq. 2 cost there and the replica is marked saturated once W ≥ Θ. A popular prefix that saturates its replica
spills to the next-best one by the same rule. W decays by the same costs when the replica reports the requests
done, so enqueue and decay never drift apart. Two additions to App. A: a run's last round, with less work queued
than it would add, fills every replica's total to one even level (`even_end`), and `depth` lets a replica hold a
second Θ routed behind the share it runs (the replica driver's 2: it never waits for a round).

Pure bookkeeping, no devices: `launch.serve --replicas` drives Ray actors with it (moejax.replicas.run) and
`launch.bench frontend` simulates many replicas with it. Baselines (`routing`): round_robin and random pick among
the same unsaturated replicas and ignore the tables. least_requests is the router vLLM's deployments put in front
of their engines (MoE-Prefill Fig. 10's third baseline): no rounds, each request goes as it arrives (`route`) to the
live replica with the fewest requests in flight (routed and not reported done), ties to the lowest index; the
replica then cuts what it was sent into shares of its Θ itself (`share`).
"""
from __future__ import annotations

import dataclasses
import random
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence

from moejax.sched.prefix_cache import BlockHolder

ROUTINGS = ("prefix", "round_robin", "random", "least_requests")
PER_REQUEST = ("least_requests",)  # routings without rounds: Frontend.route, not Frontend.round


@dataclasses.dataclass(frozen=True)
class Job:
    """A request as the frontend sees it. match: its leading prompt blocks' hashes (moejax.sched.prefix_cache's
    hasher, the replicas' own); stores: the blocks running it leaves in the replica's cache; cost(holder): its
    Eq. 2 FLOPs on a replica holding `holder`'s blocks (`holder.readable(hashes)`: how many leading hashes it has)."""
    key: int
    match: tuple[bytes, ...]
    stores: tuple[bytes, ...]
    cost: Callable[[BlockHolder], float]
    tokens: int = 0  # prompt tokens, for hit rates


class ReplicaMirror:
    """The frontend's copy of one replica's prefix-cache block table and load."""

    def __init__(self, theta: float):
        self.theta = float(theta)  # FLOPs a round fills this replica to (its Θ)
        self.committed: set[bytes] = set()
        self.pending: Counter[bytes] = Counter()  # hash -> requests in flight that will store it
        self.work = 0.0  # W: Eq. 2 FLOPs routed here and not reported done
        self.alive = True
        self.routed_flops = 0.0  # totals, for the metrics
        self.routed = 0
        self.requests = 0  # requests routed here and not reported done (least_requests' measure)

    @property
    def saturated(self) -> bool:
        return self.work >= self.theta

    def holds(self, h: bytes) -> bool:
        return h in self.committed or h in self.pending

    def readable(self, hashes: Sequence[bytes]) -> int:
        """Leading hashes held, committed or pending (the same contract as PrefixCache.readable)."""
        n = 0
        for h in hashes:
            if not self.holds(h):
                break
            n += 1
        return n

    def apply(self, events: Iterable[tuple]) -> None:
        """The replica's block-cache lifecycle events, in order: ("stored", h), ("evicted", h), ("cleared",)."""
        for event in events:
            kind = event[0]
            if kind == "stored":
                self.committed.add(event[1])
            elif kind == "evicted":
                self.committed.discard(event[1])
            elif kind == "cleared":
                self.committed.clear()
            else:
                raise ValueError(f"unknown prefix-cache event {event!r}")


class Frontend:
    def __init__(self, thetas: Sequence[float], routing: str = "prefix", *, seed: int = 0, even_end: bool = True,
                 depth: int = 1):
        """thetas: each replica's Θ in true FLOPs (a round adds that much to a replica). routing: prefix
        (MoE-Prefill), round_robin or random (in rounds), or least_requests (request by request: `route`).
        even_end: a round with less work queued than it would add fills the replicas to an even level instead (see
        _fill); False: to Θ, as App. A. depth: Θs a replica may hold routed and unfinished (2: one share running
        and the next queued behind it, so it never waits for a round)."""
        if routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}; got {routing!r}")
        if not thetas:
            raise ValueError("a frontend needs at least one replica")
        if depth < 1:
            raise ValueError(f"depth must be at least 1; got {depth}")
        if min(thetas) <= 0:
            raise ValueError(f"each replica's Θ must be above 0 FLOPs; got {list(thetas)}")
        self.routing, self.even_end, self.depth = routing, even_end, depth
        self.mirrors = [ReplicaMirror(t) for t in thetas]
        self._rng = random.Random(seed)
        self._next = 0  # round_robin's turn
        self._owed: dict[int, tuple[int, float, Job]] = {}  # job key -> (replica, cost, job) while in flight

    def round(self, queue: deque[Job], open_: Iterable[int] | None = None) -> dict[int, list[Job]]:
        """One scheduling round (App. A): jobs taken from the front of `queue` onto the unsaturated replicas among
        `open_` (default: every live one) until each is saturated (its Θ added, at most depth Θ held) or the queue
        is empty -> replica -> its jobs, in queue order."""
        if self.routing in PER_REQUEST:
            raise ValueError(f"routing {self.routing} routes each request as it arrives (Frontend.route), not in "
                             "rounds")
        allowed = set(range(len(self.mirrors)) if open_ is None else open_)
        full = {e: self._full(e) for e in sorted(allowed) if self.mirrors[e].alive}
        fill = self._fill(queue, full)
        ready = [e for e in fill if self.mirrors[e].work < fill[e]]
        opened = list(ready)
        out: dict[int, list[Job]] = {}
        while queue and ready:
            job = queue.popleft()
            e = self.pick(job, ready)
            self.assign(e, job)
            out.setdefault(e, []).append(job)
            if self.mirrors[e].work >= fill[e]:
                ready.remove(e)
            if not ready and queue and any(fill[e] < full[e] for e in opened):
                # the even level was an estimate and the queue is not empty: the rest still fits this round, and a
                # round of its own would leave the replicas waiting on a few stragglers
                fill = {e: full[e] for e in opened}
                ready = [e for e in opened if self.mirrors[e].work < fill[e]]
        return out

    def _full(self, e: int) -> float:
        """What a round fills replica e to: its Θ more, at most depth Θ routed and unfinished."""
        m = self.mirrors[e]
        return min(m.work + m.theta, self.depth * m.theta)

    def _fill(self, queue: deque[Job], full: dict[int, float]) -> dict[int, float]:
        """What this round fills each replica to: `full`, unless the queue holds less work than that adds (a run's
        last round): then the replicas' totals over the run to one even level, so the run ends with them about as
        busy, not with the first ones full and the last ones short (a replica that an earlier round filled past
        Θ by a large request gets that much less). The queue's work is counted as if it all ran on one replica
        holding nothing yet (its requests sharing their prefixes: a lower bound of what N replicas do)."""
        if not self.even_end or not full:
            return full
        room = sum(full[e] - self.mirrors[e].work for e in full)
        left, together = 0.0, ReplicaMirror(1.0)  # the queue's work with its own sharing, as on one replica
        for job in queue:
            left += job.cost(together)
            together.pending.update(job.stores)
            if left >= room:
                return full  # the queue outlasts this round
        mirrors = self.mirrors
        level = (left + sum(mirrors[e].routed_flops for e in full)) / len(full)
        return {e: min(target, mirrors[e].work + max(0.0, level - mirrors[e].routed_flops))
                for e, target in full.items()}

    def pick(self, job: Job, ready: Sequence[int]) -> int:
        """F1 among the unsaturated replicas: the longest held prefix, ties (and no match) to the smallest W."""
        if self.routing == "random":
            return self._rng.choice(list(ready))
        if self.routing == "round_robin":
            n = len(self.mirrors)
            for step in range(n):
                e = (self._next + step) % n
                if e in ready:
                    self._next = (e + 1) % n
                    return e
            raise AssertionError("round_robin: no ready replica")
        return max(ready, key=lambda e: (self.mirrors[e].readable(job.match), -self.mirrors[e].work, -e))

    def route(self, job: Job) -> int:
        """least_requests: `job`, as it arrives, to the live replica with the fewest requests in flight (ties to the
        lowest index) -> that replica (assigned)."""
        if self.routing not in PER_REQUEST:
            raise ValueError(f"routing {self.routing} routes in rounds (Frontend.round), not request by request")
        live = self.alive()
        if not live:
            raise ValueError("no live replica to route to")
        e = min(live, key=lambda e: (self.mirrors[e].requests, e))
        self.assign(e, job)
        return e

    def share(self, e: int, sent: deque[Job]) -> list[Job]:
        """What replica e runs next of the jobs routed to it and not started (`sent`, in arrival order): from the
        front until their Eq. 2 costs as routed reach its Θ (one job at least), as an engine fills its batches."""
        out: list[Job] = []
        work, theta = 0.0, self.mirrors[e].theta
        while sent and (not out or work < theta):
            job = sent.popleft()
            owner, cost, _ = self._owed[job.key]
            if owner != e:
                raise ValueError(f"job {job.key} is in flight on replica {owner}, not {e}")
            out.append(job)
            work += cost
        return out

    def assign(self, e: int, job: Job) -> float:
        """F2: route `job` to replica e: W += its Eq. 2 cost there, its new blocks pending -> the cost."""
        m = self.mirrors[e]
        cost = float(job.cost(m))
        m.work += cost
        m.routed_flops += cost
        m.routed += 1
        m.requests += 1
        for h in job.stores:
            m.pending[h] += 1
        self._owed[job.key] = (e, cost, job)
        return cost

    def finished(self, e: int, keys: Iterable[int], events: Iterable[tuple] = ()) -> None:
        """Replica e reports `keys` done and its cache's events since its last report: the events update the
        committed table first (the blocks are there now), then each job's promises leave the pending table and
        its cost leaves W."""
        m = self.mirrors[e]
        m.apply(events)
        for key in keys:
            owner, cost, job = self._owed.get(key, (None, 0.0, None))
            if owner != e or job is None:
                raise ValueError(f"replica {e} reported job {key} done, which is not in flight there (owner: "
                                 f"{owner})")
            del self._owed[key]
            m.work = max(0.0, m.work - cost)
            m.requests -= 1
            m.pending.subtract(job.stores)
            m.pending += Counter()  # drops the hashes no longer promised
        if not any(owner == e for owner, _, _ in self._owed.values()):
            m.work = 0.0  # idle: exactly, whatever rounding the float sums of the costs left (ties need idle == 0)

    def lost(self, e: int) -> list[Job]:
        """Replica e died: it takes no more work, its tables are gone -> its jobs in flight, to route again."""
        m = self.mirrors[e]
        m.alive = False
        back = [job for key, (owner, _, job) in list(self._owed.items()) if owner == e]
        for job in back:
            del self._owed[job.key]
        m.committed.clear()
        m.pending.clear()
        m.work = 0.0
        m.requests = 0
        return sorted(back, key=lambda j: j.key)

    def in_flight(self, e: int) -> list[int]:
        return sorted(k for k, (owner, _, _) in self._owed.items() if owner == e)

    def alive(self) -> list[int]:
        return [e for e, m in enumerate(self.mirrors) if m.alive]
