"""Engine replicas as Ray actors behind MoE-Prefill's prefix-aware frontend (`launch.serve --replicas N`).

The driver (this process) parses the input, keeps the one journal and output (moejax.requests.results: written once,
in input order, resumable), and routes the requests in scheduling rounds (moejax.replicas.frontend); each replica is a
Ray actor holding one Engine on its own devices (`devices_per_replica` GPUs, or as many simulated CPU devices) and
serving its shares with one prefix cache across them (moejax.replicas.replica_session). A share's results come back
with its cache's events (the frontend's mirror) and its counters.

Failures: a replica that cannot start is reported with its error and the run goes on without it (none started:
ReplicasFailed); a replica that dies mid-run has its requests in flight routed again to the others, and the run
completes. Ray is the optional extra `moejax[ray]`, imported only here, only when replicas are asked for.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import Any

import jax

from moejax import options
from moejax.costs import true_prefill_flops
from moejax.engine import Engine
from moejax.loading import read_model
from moejax.options import option
from moejax.replicas.frontend import PER_REQUEST, ROUTINGS, Frontend, Job
from moejax.replicas.frontend_jobs import request_job
from moejax.replicas.replica_session import ReplicaSession, ShareDone
from moejax.replicas.watchdog import Watchdog
from moejax.requests.parse import BadLine, Request, ScoreRequest, parse_lines
from moejax.requests.results import ResultStore, error_line
from moejax.sched.batch import engine_settings, open_results, refuse_generation, write_invalid
from moejax.sched.batch_size import DEFAULT_TOKENS
from moejax.sched.prefix_cache import block_hashes
from moejax.sched.serving_options import ServingOptions

SHARES_AHEAD = 2  # shares routed to a replica and not finished: the one it runs and the next, queued behind it
CONNECT_TIMEOUT_S = 30.0  # --ray HOST:PORT: how long its TCP connection may take


class ReplicasFailed(RuntimeError):
    """No replica could serve (none started, or every one died): the message says why for each."""


@dataclasses.dataclass(frozen=True)
class ReplicaPlan:
    """Engine replicas behind the frontend (launch.serve's flags). None of these changes a result: every replica
    computes each request as one engine would, so the journal does not record them and a run resumes under any."""
    replicas: int = option(1, minimum=1,
                           help="engine replicas, each a Ray actor with its own devices; requests are routed to them "
                                "by MoE-Prefill's frontend (--routing); 1: one engine in this process, no Ray")
    devices_per_replica: int = option(1, minimum=1,
                                      help="devices of each replica (GPUs; on a CPU-only cluster, simulated CPU "
                                           "devices): each may run a --layout or an offloaded --placement")
    ray: str | None = option(None, type=str,
                             help="address of an existing Ray cluster to start the replicas on (default: a local Ray "
                                  "instance, started and stopped by the run); needs the ray extra, moejax[ray]")
    routing: str = option("prefix", choices=ROUTINGS,
                          help="how requests go to replicas: prefix (the longest cached or promised prefix, ties to "
                               "the least true-FLOPs load, in rounds filled to each replica's Θ), or the baselines "
                               "round_robin and random (same rounds), or least_requests (no rounds: each request as "
                               "it arrives to the replica with the fewest requests in flight, as vLLM's router)")
    start_timeout_s: float = option(900.0, above=0,
                                    help="a replica not loaded by then (or that Ray cannot place) counts as failed "
                                         "to start; the run goes on without it")

    def __post_init__(self) -> None:
        options.check(self)


def import_ray() -> Any:
    try:
        import ray  # optional: the ray extra
    except ImportError:
        raise ReplicasFailed("engine replicas run as Ray actors, and Ray is not installed: "
                             "pip install 'moejax[ray]'") from None
    return ray


class ReplicaWorker:
    """One replica (a Ray actor once wrapped by ray.remote): loads its engine with make_engine() on its devices."""

    def __init__(self, make_engine: Callable[[], Engine], options: ServingOptions, devices: int, gpu: bool):
        if not gpu:  # simulated CPU devices: set before this process first asks JAX for a device
            os.environ["JAX_PLATFORMS"] = "cpu"
            flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
                     if not f.startswith("--xla_force_host_platform_device_count")]
            os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])

        self.engine = make_engine()
        self.options = options
        self.session: Any = None
        device = jax.devices()[0]
        if len(jax.devices()) != devices:
            raise RuntimeError(f"replica asked for {devices} devices and JAX sees {len(jax.devices())}")
        sat = self.engine.saturation
        budget = self.engine.memory_budget
        self.info = {"settings": engine_settings(self.engine),
                     "placement": budget.placement if budget is not None else None,
                     "theta_flops": sat.theta_flops if sat is not None else None,
                     "device": f"{device.platform}:{device.device_kind}", "devices": len(jax.devices()),
                     "host": os.uname().nodename, "pid": os.getpid(),
                     "no_generation": self.engine.placement.no_generation}

    def describe(self) -> dict:
        return self.info

    def begin(self, settings: dict) -> None:
        self.session = ReplicaSession(self.engine, self.options, settings)

    def serve(self, requests: list[Request], ids: dict[int, str], keep: frozenset[bytes]) -> ShareDone:
        return self.session.serve(requests, ids, keep)

    def table(self) -> set[bytes]:
        return self.session.table()


@dataclasses.dataclass
class ReplicaStats:
    """One replica's counters over the run (the summary's per-replica balance)."""
    index: int
    device: str = ""
    theta_flops: float | None = None  # the Θ its rounds were filled to (None: the fallback below)
    round_flops: float = 0.0  # what a round fills it to: Θ, or one batch of the token budget without one
    state: str = "starting"  # serving, failed to start, lost
    error: str | None = None
    shares: int = 0
    requests: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    computed_tokens: int = 0
    generated_tokens: int = 0
    busy_s: float = 0.0
    compile_s: float = 0.0  # of busy_s, compiling programs (new batch shapes)
    routed_flops: float = 0.0  # Eq. 2 FLOPs routed to it (its load as the frontend counted it)

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["tokens_per_s"] = (self.prompt_tokens + self.generated_tokens) / self.busy_s if self.busy_s else None
        run_s = self.busy_s - self.compile_s
        d["tokens_per_s_compiled"] = (self.prompt_tokens + self.generated_tokens) / run_s if run_s > 0 else None
        d["prefix_cache_hit_rate"] = self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        return d


class ReplicaRun:
    """A set of replica actors and the frontend routing to them, for one run (start, serve, stop)."""

    def __init__(self, make_engine: Callable[[], Engine], options: ServingOptions, plan: ReplicaPlan, *,
                 model: str, num_layers: int | None = None, log_to_driver: bool = True):
        """make_engine: a picklable callable that loads the engine a replica serves (every replica the same);
        model/num_layers: what the driver reads the tokenizer and config from (moejax.loading.read_model)."""
        if plan.ray:
            bound_ray_connect()
        self.ray = import_ray()
        self.make_engine, self.options, self.plan = make_engine, options, plan
        self.model, self.num_layers = model, num_layers
        self._started_ray = False
        self._watchdog = Watchdog()  # over the local Ray cluster this run starts (moejax.replicas.watchdog)
        self._log_to_driver = log_to_driver
        self.handles: list = []
        self.stats: list[ReplicaStats] = []
        self.described: list[int] = []  # the replicas whose engines started, in the order start() returned them
        self.frontend: Frontend | None = None
        self.rerouted = 0
        self._metrics: list[dict] = []  # each finished share's counters
        self.served_by: dict[int, int] = {}  # input line -> the replica whose result was written

    # -- start --------------------------------------------------------------------------------------------
    def start(self, faults: Sequence[Callable[[], Engine] | None] = ()) -> list[dict]:
        """Start the actors and wait for their engines -> each started replica's description. faults: per replica,
        another make_engine to use instead (tests: a replica that cannot start)."""
        ray, plan = self.ray, self.plan
        if not ray.is_initialized():
            # Ray runs its workers at niceness 15 by default: a replica is the run's main work, not a background job
            os.environ.setdefault("RAY_worker_niceness", "0")
            if plan.ray:
                connect_ray(ray, plan.ray, log_to_driver=self._log_to_driver)
            else:  # a local cluster: its processes are this run's, and end with it however it ends
                self._watchdog.start()
                ray.init(include_dashboard=False, log_to_driver=self._log_to_driver,
                         num_cpus=max(plan.replicas, 2))
            self._started_ray = True
            terminate_as_exit()
        gpus = ray.cluster_resources().get("GPU", 0)
        gpu = gpus > 0
        need = plan.replicas * plan.devices_per_replica
        if gpu and gpus < need:
            raise ReplicasFailed(f"{plan.replicas} replicas of {plan.devices_per_replica} GPUs need {need} GPUs; the "
                                 f"Ray cluster has {gpus:g}")
        actor = ray.remote(ReplicaWorker)
        resources = {"num_gpus": plan.devices_per_replica, "num_cpus": 1} if gpu else {"num_cpus": 1}
        faults = list(faults) + [None] * plan.replicas
        self.handles = [actor.options(max_restarts=0, max_task_retries=0, **resources).remote(
            faults[i] or self.make_engine, self.options, plan.devices_per_replica, gpu) for i in range(plan.replicas)]
        self.stats = [ReplicaStats(i) for i in range(plan.replicas)]
        waiting = {h.describe.remote(): i for i, h in enumerate(self.handles)}
        ready, late = ray.wait(list(waiting), num_returns=len(waiting), timeout=plan.start_timeout_s)
        infos: dict[int, dict] = {}
        for ref in ready:
            i = waiting[ref]
            try:
                infos[i] = ray.get(ref)
            except Exception as e:  # its engine did not load (or the actor died): go on without it
                self._failed(i, _cause(e))
        for ref in late:
            self._failed(waiting[ref], f"not started within {plan.start_timeout_s:g} s (loading, or Ray could not "
                                       "place it: see `ray status`)")
        if not infos:
            raise ReplicasFailed("no replica started: "
                                 + "; ".join(f"replica {s.index}: {s.error}" for s in self.stats))
        for i, info in infos.items():
            self.stats[i].device, self.stats[i].state = f"{info['device']} x{info['devices']}", "serving"
        self.described = sorted(infos)
        return [infos[i] for i in self.described]

    def _failed(self, i: int, error: str) -> None:
        self.stats[i].state, self.stats[i].error = "failed to start", error
        print(f"replica {i} could not start: {error}", file=sys.stderr)
        self.ray.kill(self.handles[i], no_restart=True)

    def settings(self, infos: list[dict]) -> tuple[dict, str | None]:
        """The engine settings every started replica has (they decide results, so they must agree) and its
        placement."""
        first = infos[0]
        for info in infos[1:]:
            if (info["settings"], info["placement"]) != (first["settings"], first["placement"]):
                raise ReplicasFailed(f"replicas loaded with different settings, which change results: "
                                     f"{first['settings']} ({first['placement']}) and {info['settings']} "
                                     f"({info['placement']})")
        return first["settings"], first["placement"]

    # -- serve --------------------------------------------------------------------------------------------
    def serve(self, lines: Sequence[str], store_path: str | None, run_settings: dict, infos: list[dict], *,
              seed_nonce: int | None = None, error_file: str | None = None,
              on_round: Callable[[ReplicaRun], None] | None = None) -> dict:
        """Serve `lines` into `store_path` (None: stdout) -> the run summary. run_settings: what decides the results
        (the journal's header; a resume must match). on_round(self): called after each round is dispatched."""
        cfg, tokenizer, chat = read_model(self.model, self.num_layers)
        entries = parse_lines(lines, tokenizer=tokenizer, vocab_size=cfg.vocab_size,
                              max_context=cfg.max_position_embeddings, chat=chat)
        entries = refuse_generation(infos[0].get("no_generation"), entries)  # 400s, as one engine answers them
        store, todo = open_results(entries, lines, store_path, run_settings, seed_nonce)
        start = time.perf_counter()
        with store:
            bad = write_invalid(store, entries)
            stored = self._stored_blocks(todo)
            jobs = [request_job(k, r, cfg, stored) for k, r in enumerate(todo)]
            fallback = true_prefill_flops(cfg, self.options.max_batch_tokens or DEFAULT_TOKENS)
            self._metrics, self.served_by, self.rerouted = [], {}, 0  # this run's counters (a fresh cache each)
            self.stats = [ReplicaStats(s.index, s.device, state=s.state, error=s.error) for s in self.stats]
            started = {s.index for s in self.stats if s.state == "serving"}
            self.ray.get([self.handles[i].begin.remote(run_settings) for i in sorted(started)])
            # by replica: one lost in an earlier serve is still among infos, but no longer started
            for i, info in zip(self.described, infos, strict=True):
                if i in started:
                    self.stats[i].theta_flops = info["theta_flops"]
                    self.stats[i].round_flops = info["theta_flops"] or fallback
            # (a replica that did not start gets the fallback too: it is marked lost at once)
            self.frontend = Frontend([s.round_flops or fallback for s in self.stats], self.plan.routing,
                                     depth=SHARES_AHEAD)
            for s in self.stats:
                if s.index not in started:
                    self.frontend.lost(s.index)
            failed = self._route(todo, jobs, store, on_round)
            store.finish(error_file)
        return self._summary(entries, store, bad, failed, time.perf_counter() - start)

    def _stored_blocks(self, todo: Sequence[Request]) -> Callable[[bytes], bool]:
        """Which blocks a replica's prefix cache keeps: every block (--kv-cache on), none (off), or (auto) the
        blocks more than one request of the run reads, which a later share may find."""
        mode = self.options.kv_cache
        if mode != "auto":
            return (lambda h: True) if mode == "on" else (lambda h: False)
        counts: Counter[bytes] = Counter()
        for r in todo:
            contexts = r.contexts if isinstance(r, ScoreRequest) else (r.prompt,)
            counts.update({h for ctx in contexts for h in block_hashes(ctx)})
        recurring = {h for h, n in counts.items() if n > 1}
        return recurring.__contains__

    def _route(self, todo: list[Request], jobs: list[Job], store: ResultStore,
               on_round: Callable[[ReplicaRun], None] | None) -> int:
        """Rounds until every request has its result -> how many failed as a whole share."""
        ray, frontend = self.ray, self.frontend
        assert frontend is not None
        queue: deque[Job] = deque(jobs)
        inflight: dict[Any, tuple[int, list[Job]]] = {}
        sent: dict[int, deque[Job]] = {e: deque() for e in range(len(frontend.mirrors))}  # least_requests: routed
        failed = 0
        while queue or inflight or any(sent.values()):
            busy = Counter(owner for owner, _ in inflight.values())
            if self.plan.routing in PER_REQUEST:
                # no rounds: every request of the file has arrived, each goes at once to the replica with the fewest
                # in flight; a replica is handed what it was sent in shares of its Θ, two at a time (SHARES_AHEAD)
                while queue and frontend.alive():
                    job = queue.popleft()
                    sent[frontend.route(job)].append(job)
                for e in frontend.alive():
                    while sent[e] and busy[e] < SHARES_AHEAD:
                        self._dispatch(e, frontend.share(e, sent[e]), todo, store, inflight)
                        busy[e] += 1
                if on_round is not None:
                    on_round(self)
            # A round opens over every replica at once (App. A), when each has at most one share left in flight:
            # the next share waits in the actor's queue behind the running one, so no replica idles for a round,
            # and a round never opens for one replica alone (it would hand that one the head of the queue
            # whatever its prefix, scattering prefixes as random routing does).
            elif queue and all(busy[e] < SHARES_AHEAD for e in frontend.alive()):
                for e, share in frontend.round(queue).items():
                    self._dispatch(e, share, todo, store, inflight)
                if on_round is not None:
                    on_round(self)
            if not inflight:
                if not frontend.alive():
                    raise ReplicasFailed(f"every replica died; {len(queue)} requests have no result (the journal "
                                         "keeps the others: rerun to resume)")
                continue
            (ref,), _ = ray.wait(list(inflight), num_returns=1)
            e, share = inflight.pop(ref)
            try:
                done = ray.get(ref)
            except ray.exceptions.RayActorError as err:  # the replica died: its shares go to the others
                if not frontend.mirrors[e].alive:
                    continue  # its other share, routed again with the first
                back = frontend.lost(e)
                sent[e].clear()  # (routed to it and not started: among `back`)
                queue.extendleft(reversed(back))
                self.rerouted += len(back)
                self.stats[e].state, self.stats[e].error = "lost", _cause(err)
                print(f"replica {e} died ({_cause(err)}); {len(back)} requests routed again to the others",
                      file=sys.stderr)
                continue
            except Exception as err:  # the share raised as a whole: its requests fail (500), a rerun retries them
                message = f"replica {e}: {_cause(err)}"
                for r in (todo[j.key] for j in share):
                    store.write(r.line, error_line(r.line, r.custom_id, message, code="internal_error", status=500,
                                                   rid=store.ids[r.line]))
                failed += len(share)
                frontend.finished(e, [j.key for j in share])
                continue
            for line, text in sorted(done.results.items()):
                store.write(line, json.loads(text))
                self.served_by[line] = e
            frontend.finished(e, [j.key for j in share], done.events)
            self._count(e, share, done)
        return failed

    def _dispatch(self, e: int, share: list[Job], todo: list[Request], store: ResultStore,
                  inflight: dict[Any, tuple[int, list[Job]]]) -> None:
        """Send `share` to replica e to serve (its results come back as a Ray object, kept in `inflight`)."""
        reqs = [todo[j.key] for j in share]
        keep = frozenset(h for j in share for h in j.stores)
        ref = self.handles[e].serve.remote(reqs, {r.line: store.ids[r.line] for r in reqs}, keep)
        inflight[ref] = (e, share)

    def _count(self, e: int, share: list[Job], done: ShareDone) -> None:
        s, m = self.stats[e], done.metrics
        s.shares += 1
        s.requests += len(share)
        s.busy_s += done.busy_s
        s.compile_s += done.compile_s
        for field in ("prompt_tokens", "cached_prompt_tokens", "computed_tokens", "generated_tokens"):
            setattr(s, field, getattr(s, field) + m[field])
        s.routed_flops = self.frontend.mirrors[e].routed_flops if self.frontend is not None else 0.0
        self._metrics.append(m)

    def _summary(self, entries: list[Request | BadLine], store: ResultStore, bad: int, failed: int, wall: float
                 ) -> dict:
        shares = self._metrics
        total = {k: sum(m.get(k, 0) for m in shares) for k in ("requests_ok", "requests_failed", "prompt_tokens",
                                                                  "cached_prompt_tokens", "computed_tokens",
                                                                  "padded_tokens", "generated_tokens", "batches")}
        serving = [s for s in self.stats if s.shares]
        loads = [s.routed_flops for s in serving]
        total["requests_failed"] += failed
        return {"lines": len(entries), "replicas": [s.as_dict() for s in self.stats], "routing": self.plan.routing,
                "rerouted": self.rerouted, **total, "requests_batch_failed": total["requests_failed"],
                "requests_invalid": sum(isinstance(e, BadLine) for e in entries), "requests_resumed": store.resumed,
                "invalid_written": bad, "wall_s": wall,
                "tokens_per_s": (total["prompt_tokens"] + total["generated_tokens"]) / wall if wall else None,
                "prefix_cache_hit_rate": (total["cached_prompt_tokens"] / total["prompt_tokens"]
                                          if total["prompt_tokens"] else 0.0),
                "shared_prefill_saving": (1 - total["computed_tokens"] / total["prompt_tokens"]
                                          if total["prompt_tokens"] else 0.0),
                "flops_balance": max(loads) / (sum(loads) / len(loads)) if loads and sum(loads) else None}

    def tables(self) -> dict[int, set[bytes]]:
        """Each serving replica's own prefix-cache table now (to compare with the frontend's mirrors)."""
        live = [s.index for s in self.stats if s.state == "serving"]
        return dict(zip(live, self.ray.get([self.handles[i].table.remote() for i in live]), strict=True))

    def stop(self) -> None:
        for h in self.handles:
            try:
                self.ray.kill(h, no_restart=True)
            except Exception:  # already gone
                pass
        if self._started_ray:
            self.ray.shutdown()
            self._started_ray = False
        self._watchdog.stop()  # and it ends whatever the shutdown left


# --ray ADDRESS: Ray's own limits on connecting, which it otherwise retries for minutes printing only warnings (the
# GCS client's wait, its RPC connection's, and one attempt: the address answered a TCP connection first). Set before
# Ray is imported (it reads the first then); a value the user set wins.
RAY_CONNECT_LIMITS = {"RAY_py_gcs_connect_timeout_s": "10", "RAY_gcs_rpc_server_connect_timeout_s": "5",
                      "RAY_gcs_server_port_wait_time_s": "1"}


def bound_ray_connect() -> None:
    """Ray's connection to an existing cluster bounded (RAY_CONNECT_LIMITS: about 20 s in all)."""
    for name, value in RAY_CONNECT_LIMITS.items():
        os.environ.setdefault(name, value)


def connect_ray(ray: Any, address: str, timeout_s: float = CONNECT_TIMEOUT_S, **init: Any) -> None:
    """ray.init on the cluster at `address`; ReplicasFailed saying so when nothing answers there. A HOST:PORT is first
    tried as a plain TCP connection (refused at once, or after timeout_s); the Ray connection itself is bounded by
    bound_ray_connect, called before Ray was imported."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if host and port.isdigit():
        try:
            socket.create_connection((host, int(port)), timeout=timeout_s).close()
        except OSError as e:
            raise ReplicasFailed(f"no Ray cluster answers at {address} ({e.strerror or e}); start one there with "
                                 "`ray start --head`, or drop --ray to start a local one") from None
    try:
        ray.init(address=address, **init)
    except ConnectionError as e:
        raise ReplicasFailed(f"could not connect to a Ray cluster at {address} ({_cause(e)}); is it a Ray "
                             "cluster's GCS address? `ray status --address ADDRESS` checks it") from None


def terminate_as_exit() -> None:
    """SIGTERM raises SystemExit (status 143, the signal's own) in this process, so that a run's `finally` stops the
    replicas and the Ray processes it started. Called after ray.init, whose core worker installs a handler that
    aborts the process instead (SIGKILL runs nothing: moejax.replicas.watchdog ends them then). On the main thread
    only, where Python handles signals."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_on_signal)


def _exit_on_signal(signum: int, frame: object) -> None:
    print(f"signal {signal.Signals(signum).name}: stopping the replicas", file=sys.stderr)
    raise SystemExit(128 + signum)


def _cause(e: BaseException) -> str:
    """What went wrong in a replica, in one line: the exception's type and the last line of its text (Ray wraps the
    replica's own exception with a traceback)."""
    cause = getattr(e, "cause", None) or e
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[-1] if text else ''}".rstrip(": ")

