"""Engine replicas on a local Ray instance behind MoE-Prefill's frontend (moejax.replicas.run): the result file
is one engine's (float32, greedy; see assert_same_results for what "the same" takes), the frontend's mirrored
block tables equal the replicas' own, requests sharing a prefix
go to one replica, a replica killed mid-run or one that cannot start loses nothing, and a run resumes a journal
one engine started (replica settings do not change results, so they are not in its fingerprint)."""
import functools
import json
import os
import subprocess
import sys

import pytest

ray = pytest.importorskip("ray")

import moejax  # noqa: E402
from moejax.replicas.run import ReplicaPlan, ReplicaRun, ReplicasFailed  # noqa: E402
from moejax.sched.batch import serve_lines  # noqa: E402
from moejax.sched.serving_options import ServingOptions  # noqa: E402

pytestmark = pytest.mark.slow

QWEN3 = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "qwen3_moe")
FORMATS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "examples", "formats.jsonl")
NONCE = 11
OPTIONS = ServingOptions(max_batch_tokens=256)
PREFIXES = ["The clever fox reads a map of the old city and the river, then walks along the quiet bridge past the "
            "market where", "Seven blue clouds drift over the tiny engine while every robot sings a long song about "
            "the sea and the"]


def workload() -> list[str]:
    """Scoring requests that share two long prefixes (several blocks each), interleaved, then greedy completions
    and the formats example (chat, SGLang and vLLM scoring, echo, n=2 sampled with a seed)."""
    lines = []
    for k in range(8):
        prefix = PREFIXES[k % 2]
        lines.append(json.dumps({"custom_id": f"score-{k}", "method": "POST", "url": "/v1/score",
                                 "body": {"prompt": f"{prefix} number {k} says", "candidates": [" yes", " no"]}}))
    for k in range(3):
        lines.append(json.dumps({"custom_id": f"greedy-{k}", "method": "POST", "url": "/v1/completions",
                                 "body": {"prompt": f"{PREFIXES[k % 2]} {k}", "max_tokens": 5, "temperature": 0}}))
    with open(FORMATS) as f:
        lines += f.read().splitlines()
    return lines


# partials of moejax.load: Ray pickles them by reference to moejax, which a replica's process imports (a function
# of this test module would not be importable there)
make_engine = functools.partial(moejax.load, QWEN3, dtype="float32")
bad_engine = functools.partial(moejax.load, QWEN3, dtype="float32", placement="no-such-placement")


def results(path) -> list[dict]:
    """The result lines, less what is not a result: `created` (wall time) and how many prompt tokens came from a
    prefix cache (which cache holds what depends on the batches; one engine's own count changes with its
    --max-batch-tokens)."""
    out = []
    with open(path) as f:
        for text in f:
            result = json.loads(text)
            body = result["response"]["body"]
            body.pop("created", None)
            usage = body.get("usage", {})
            usage.pop("cached_prompt_tokens", None)
            usage.pop("prompt_tokens_details", None)
            out.append(result)
    return out


def assert_same_results(path, reference) -> None:
    """Every line as one engine wrote it: ids, custom ids, fingerprints, token ids, texts, finish reasons and
    counts exactly; log-probabilities to float32 round-off (1e-5 relative), since a request's float32 scores move
    in the last bits with the batch it shares (on one engine too: the same request scored alone or beside another
    differs at 1e-7)."""
    got, want = results(path), results(reference)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        _same(g, w, g.get("custom_id"))


def _same(g, w, where) -> None:
    if isinstance(w, float) and isinstance(g, float):
        assert g == pytest.approx(w, rel=1e-5, abs=1e-6), where
    elif isinstance(w, dict):
        assert isinstance(g, dict) and g.keys() == w.keys(), where
        for k in w:
            _same(g[k], w[k], f"{where}.{k}")
    elif isinstance(w, list):
        assert isinstance(g, list) and len(g) == len(w), where
        for a, b in zip(g, w, strict=True):
            _same(a, b, where)
    else:
        assert g == w, where


@pytest.fixture(scope="module")
def local_ray():
    os.environ.setdefault("RAY_worker_niceness", "0")
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def one_engine(tmp_path_factory):
    """The reference: the workload through one engine in this process."""
    path = str(tmp_path_factory.mktemp("one") / "out.jsonl")
    engine = make_engine()
    serve_lines(engine, workload(), path, OPTIONS, seed_nonce=NONCE, settings=settings_of(engine))
    return path


def settings_of(engine) -> dict:
    from moejax.sched.batch import engine_settings
    return {**engine_settings(engine), "placement": engine.memory_budget.placement}


def run_replicas(path, replicas: int, routing: str = "prefix", *, on_round=None, faults=()):
    run = ReplicaRun(make_engine, OPTIONS, ReplicaPlan(replicas=replicas, routing=routing), model=QWEN3)
    try:
        infos = run.start(faults)
        base, placement = run.settings(infos)
        summary = run.serve(workload(), path, {**base, "placement": placement}, infos, seed_nonce=NONCE,
                            on_round=on_round)
        tables = run.tables()
    finally:
        run.stop()
    return run, summary, tables


def served_by(run, lines: list[str]) -> dict[str, int]:
    """custom_id -> the replica that served it."""
    ids = {n: json.loads(text)["custom_id"] for n, text in enumerate(lines, start=1)}
    return {ids[line]: e for line, e in run.served_by.items()}


def test_two_replicas_write_one_engines_file_and_mirror_their_tables(local_ray, one_engine, tmp_path):
    path = str(tmp_path / "out.jsonl")
    run, summary, tables = run_replicas(path, 2)
    assert_same_results(path, one_engine)
    assert summary["requests_ok"] == len(workload()) and summary["requests_failed"] == 0
    # the mirrors: what the frontend learnt from the events equals what each replica's cache holds
    assert tables and any(tables.values())
    for e, table in tables.items():
        assert run.frontend.mirrors[e].committed == table
        assert not run.frontend.mirrors[e].pending and run.frontend.mirrors[e].work == 0
    # same prefix -> same replica (scoring requests; the prefixes are several blocks long)
    owner = served_by(run, workload())
    for p in range(2):
        assert len({owner[f"score-{k}"] for k in range(p, 8, 2)}) == 1
    assert summary["cached_prompt_tokens"] > 0
    assert [r["state"] for r in summary["replicas"]] == ["serving", "serving"]


@pytest.mark.parametrize("routing", ["round_robin", "least_requests"])
def test_three_replicas_under_a_baseline_routing_write_the_same_file(local_ray, one_engine, tmp_path, routing):
    path = str(tmp_path / "out.jsonl")
    run, summary, _ = run_replicas(path, 3, routing)
    assert_same_results(path, one_engine)
    assert len(set(run.served_by.values())) == 3  # both used all three
    if routing == "least_requests":  # every request arrived at once: an equal count each
        routed = [m.routed for m in run.frontend.mirrors]
        assert sum(routed) == summary["requests_ok"] and max(routed) - min(routed) <= 1
        assert not any(m.requests for m in run.frontend.mirrors)


def test_a_replica_killed_mid_run_loses_nothing(local_ray, one_engine, tmp_path):
    path = str(tmp_path / "out.jsonl")
    killed = []

    def kill_one(run):
        busy = [e for e in run.frontend.alive() if run.frontend.in_flight(e)]
        if not killed and len(busy) > 1:
            killed.append(busy[-1])
            ray.kill(run.handles[busy[-1]], no_restart=True)

    run, summary, _ = run_replicas(path, 2, on_round=kill_one)
    assert killed
    assert_same_results(path, one_engine)
    assert summary["replicas"][killed[0]]["state"] == "lost" and summary["rerouted"] > 0
    assert summary["requests_failed"] == 0


def test_a_serve_after_a_replica_was_lost_gives_each_survivor_its_own_theta(local_ray, one_engine, tmp_path):
    """start()'s descriptions stay one per replica that started: after replica 0 is lost in one serve, the next
    serve still reads replica 1's Θ from replica 1's description (not the first one left, replica 0's)."""
    killed: list[int] = []

    def kill_replica_0(run):
        if not killed and run.frontend.in_flight(0) and len(run.frontend.alive()) > 1:
            killed.append(0)
            ray.kill(run.handles[0], no_restart=True)

    run = ReplicaRun(make_engine, OPTIONS, ReplicaPlan(replicas=2), model=QWEN3)
    try:
        infos = run.start()
        base, placement = run.settings(infos)
        settings = {**base, "placement": placement}
        run.serve(workload(), str(tmp_path / "first.jsonl"), settings, infos, seed_nonce=NONCE,
                  on_round=kill_replica_0)
        assert killed == [0]
        # distinct Θ per description (the same device gives both the same): which one replica 1 gets shows
        marked = [dict(info, theta_flops=1e9 * (i + 1)) for i, info in enumerate(infos)]
        path = str(tmp_path / "second.jsonl")
        summary = run.serve(workload(), path, settings, marked, seed_nonce=NONCE)
    finally:
        run.stop()
    assert [r["state"] for r in summary["replicas"]] == ["lost", "serving"]
    assert run.stats[1].theta_flops == marked[1]["theta_flops"]
    assert_same_results(path, one_engine)


def test_a_replica_that_cannot_start_is_reported_and_the_others_serve(local_ray, one_engine, tmp_path, capfd):
    path = str(tmp_path / "out.jsonl")
    run, summary, _ = run_replicas(path, 2, faults=[bad_engine])
    assert_same_results(path, one_engine)
    failed = summary["replicas"][0]
    assert failed["state"] == "failed to start" and "no-such-placement" in failed["error"]
    assert "replica 0 could not start" in capfd.readouterr().err
    with pytest.raises(ReplicasFailed, match="no replica started: replica 0: .*no-such-placement"):
        run_replicas(str(tmp_path / "none.jsonl"), 1, faults=[bad_engine])


def test_replicas_resume_a_journal_one_engine_started(local_ray, one_engine, tmp_path):
    """The journal an interrupted one-engine run leaves (its header and five results) is resumed by replicas."""
    from moejax.requests.results import ResultStore, request_id
    path = str(tmp_path / "out.jsonl")
    lines = workload()
    with open(one_engine) as f:
        done = [json.loads(text) for text in f.read().splitlines()]
    store = ResultStore(path, {n: json.loads(t)["custom_id"] for n, t in enumerate(lines, start=1)},
                        {n: request_id(n, t) for n, t in enumerate(lines, start=1)},
                        settings=settings_of(make_engine()), seed_nonce=NONCE)
    with store:
        for n in (1, 4, 9, 10, 12):
            store.write(n, done[n - 1])
    assert os.path.exists(path + ".partial") and not os.path.exists(path)
    run, summary, _ = run_replicas(path, 2)
    assert summary["requests_resumed"] == 5 and summary["requests_ok"] == len(lines) - 5
    assert_same_results(path, one_engine)


def test_launch_serve_replicas_from_the_command_line(tmp_path):
    """`launch.serve --replicas 2` as a user runs it (its own local Ray): every line served, the summary and
    --metrics show each replica's share."""
    out, metrics = tmp_path / "out.jsonl", tmp_path / "metrics.json"
    done = subprocess.run([sys.executable, "-m", "launch.serve", "--model", QWEN3, "--dtype", "float32", "--input",
                           FORMATS, "--output", str(out), "--replicas", "2", "--metrics", str(metrics)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(out.read_text().splitlines()) == 6
    summary = json.loads(metrics.read_text())
    assert [r["state"] for r in summary["replicas"]] == ["serving", "serving"]
    assert sum(r["requests"] for r in summary["replicas"]) == 6 == summary["requests_ok"]
    assert "on 2 replicas (prefix routing): 6 ok" in done.stderr
    assert "#   replica 0 [serving]" in done.stderr and "#   replica 1 [serving]" in done.stderr


def test_replicas_of_two_devices_each_run_a_layout(local_ray, one_engine, tmp_path):
    """--devices-per-replica 2 with an expert-parallel layout: each replica's engine spans its own two (simulated)
    devices, and the results are one engine's (the fingerprint names the layout, so it is the one field that
    differs)."""
    path = str(tmp_path / "out.jsonl")
    make = functools.partial(moejax.load, QWEN3, dtype="float32", layout="attn=dp,experts=ep")
    run = ReplicaRun(make, OPTIONS, ReplicaPlan(replicas=2, devices_per_replica=2), model=QWEN3)
    try:
        infos = run.start()
        base, placement = run.settings(infos)
        run.serve(workload(), path, {**base, "placement": placement}, infos, seed_nonce=NONCE)
    finally:
        run.stop()
    assert [i["devices"] for i in infos] == [2, 2] and "ep" in base["layout"]
    got, want = tmp_path / "got.jsonl", tmp_path / "want.jsonl"
    for source, target in ((path, got), (one_engine, want)):
        with open(source) as f, open(target, "w") as out:
            for text in f:
                result = json.loads(text)
                result["response"]["body"].pop("system_fingerprint", None)
                out.write(json.dumps(result) + "\n")
    assert_same_results(str(got), str(want))


def test_launch_serve_on_an_existing_ray_cluster(local_ray, tmp_path):
    """--ray ADDRESS: the replicas go to that cluster (here the local instance this module started), which the
    run leaves running."""
    out = tmp_path / "out.jsonl"
    address = ray.get_runtime_context().gcs_address
    done = subprocess.run([sys.executable, "-m", "launch.serve", "--model", QWEN3, "--dtype", "float32", "--input",
                           FORMATS, "--output", str(out), "--ray", address, "--replicas", "2"],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(out.read_text().splitlines()) == 6 and "on 2 replicas" in done.stderr
    assert ray.is_initialized() and ray.cluster_resources().get("CPU") == 3


pipeline_engine = functools.partial(moejax.load, QWEN3, dtype="float32", layout="attn=pp,experts=pp")


def test_replicas_of_the_pipeline_answer_generation_400_and_score_as_one_engine(local_ray, tmp_path):
    """A prefill-only layout on replicas: completions that generate get one engine's 400 with the reason (not a 500
    per share), scoring lines are served with the prefix cache off (kv_cache auto), equal to one engine's."""
    lines = [line for line in workload() if '"/v1/score"' in line][:4] + [workload()[8]]
    one = str(tmp_path / "one.jsonl")
    serve_lines(make_engine(), lines, one, OPTIONS, seed_nonce=NONCE)
    run = ReplicaRun(pipeline_engine, OPTIONS, ReplicaPlan(replicas=2), model=QWEN3)
    try:
        infos = run.start(())
        base, placement = run.settings(infos)
        summary = run.serve(lines, str(tmp_path / "pp.jsonl"), {**base, "placement": placement}, infos,
                            seed_nonce=NONCE)
    finally:
        run.stop()
    got, want = results(tmp_path / "pp.jsonl"), results(one)
    assert summary["requests_batch_failed"] == 0 and summary["requests_invalid"] == 1
    assert got[4]["response"]["status_code"] == 400
    assert "prefill-only scoring" in got[4]["response"]["body"]["error"]["message"]
    for g, w in zip(got[:4], want[:4], strict=True):
        for a, b in zip(g["response"]["body"]["results"][0]["candidates"],
                        w["response"]["body"]["results"][0]["candidates"], strict=True):
            assert a["logprob"] == pytest.approx(b["logprob"], rel=1e-5, abs=1e-6)
