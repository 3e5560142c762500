"""bench frontend's simulation (launch/bench/frontend.py): a few hundred shared-prefix requests over 2 and 4 replicas
with small caches (evictions) and a small Θ (many rounds); the CLI's record."""
import sys

import pytest

from launch.bench import cli as bench
from launch.bench import frontend as bf
from launch.bench.results import read_runs
from moejax.config import ModelConfig
from moejax.presets import preset_config
from moejax.replicas.frontend import ROUTINGS
from moejax.replicas.frontend_jobs import request_job
from moejax.sched.prefix_cache import PrefixCache

TINY = bf.Workload("tiny", prefixes=6, prefix_len=64, suffix_len=16, requests=300)


@pytest.fixture(scope="module")
def cfg():
    return ModelConfig.from_hf(preset_config("qwen3-30b-a3b"))


@pytest.fixture(scope="module")
def requests(cfg):
    return bf.make_requests(TINY, cfg.vocab_size, seed=0)


@pytest.fixture(scope="module")
def runs(cfg, requests):
    jobs = bf.make_jobs(requests, cfg)
    one = jobs[0].cost(PrefixCache(1))  # a request with nothing cached
    timing = bf.Timing(rate=5e14, layers=cfg.num_layers, t_comm_s=0.0, overhead_s=0.005)
    return {(n, routing): bf.simulate_one(jobs, n, routing, theta=8 * one, timing=timing, capacity_blocks=30)
            for n in (2, 4) for routing in ("prefix", "random", "least_requests")}


def test_memoized_cost_is_request_jobs_cost(cfg, requests):
    jobs = bf.make_jobs(requests[:3], cfg)
    cache = PrefixCache(64)
    for h in jobs[0].match[:2]:  # two of the first request's prefix blocks
        cache.allocate(h)
    cache.begin_batch()
    for key, job in enumerate(jobs):
        direct = request_job(key, requests[key], cfg, lambda h: True).cost(cache)
        assert job.cost(cache) == direct
        assert job.cost(PrefixCache(1)) == request_job(key, requests[key], cfg, lambda h: True).cost(PrefixCache(1))


@pytest.mark.parametrize("n", [2, 4])
def test_prefix_routing_beats_random_on_hit_rate(runs, requests, n):
    prefix, random = runs[n, "prefix"].row, runs[n, "random"].row
    assert prefix["rounds"] > 2 and prefix["evictions"] > 0  # the caches turned over across rounds
    assert prefix["hit_rate"] > random["hit_rate"]
    assert prefix["prompt_tokens"] == random["prompt_tokens"] == sum(len(r.prompt) for r in requests)
    assert prefix["total_flops"] < random["total_flops"]


@pytest.mark.parametrize("n", [2, 4])
def test_least_requests_spreads_by_count_without_rounds_and_scatters_prefixes(runs, requests, n):
    """Every request arrives at once: each replica is sent an equal count (at most one apart), runs it in shares
    of its Θ, and shared prefixes scatter as under random routing."""
    run = runs[n, "least_requests"]
    routed = [m.routed for m in run.frontend.mirrors]
    assert sum(routed) == len(requests) and max(routed) - min(routed) <= 1
    assert run.row["rounds"] == 0 and min(run.row["shares"]) > 1
    assert run.row["prompt_tokens"] == runs[n, "prefix"].row["prompt_tokens"]
    assert runs[n, "prefix"].row["hit_rate"] > run.row["hit_rate"]


def test_mirrors_equal_replica_caches_at_the_end(runs):
    for run in runs.values():
        for mirror, replica in zip(run.frontend.mirrors, run.replicas, strict=True):
            assert mirror.committed == replica.cache.hashes() and len(replica.cache) > 0
            assert not mirror.pending and mirror.work == 0.0
        assert not any(run.frontend.in_flight(e) for e in range(len(run.replicas)))


def test_cli_writes_a_record_with_the_fields(tmp_path, monkeypatch):
    out = tmp_path / "frontend-sim.json"
    argv = ["frontend", "--workloads", "short", "--requests", "120", "--replicas", "2,4", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", ["launch/bench/cli.py", *argv])  # the record's command is read from sys.argv
    bench.main(argv)
    record = read_runs(str(out))[-1]
    assert record["benchmark"] == "frontend-sim" and "simulation" in record["note"] and "no devices" in record["note"]
    assert "-m launch.bench frontend --workloads short" in record["command"] and record["versions"]["moejax"]
    assert record["cache_blocks"] > 0 and "partial" not in record
    entry = record["workloads"][0]
    assert entry["workload"]["requests"] == 120 and entry["single"]["replicas"] == 1
    assert {(r["routing"], r["replicas"]) for r in entry["rows"]} == {
        (routing, n) for routing in ROUTINGS for n in (2, 4)}
    assert "least_requests" in ROUTINGS
    for row in entry["rows"]:
        for field in ("hit_rate", "hit_vs_single", "flops_balance", "total_flops", "tokens_per_s", "makespan_s",
                      "theta_flops", "theta_from"):
            assert row[field] is not None, field
    assert set(entry["target"]) == {"hit_share", "balance", "holds", "misses"}


def test_cli_names_a_bad_replica_count(capsys):
    with pytest.raises(SystemExit):
        bench.main(["frontend", "--replicas", "2,x"])
    assert "--replicas" in capsys.readouterr().err
