"""bench generate's long-tail workload and --overhead: the parts on their own, then both end to end on the
micro preset cut to one layer, a few requests."""
import jax
import numpy as np
import pytest
from conftest import fixture_dir

import moejax
from launch.bench import cli as bench
from launch.bench import generate as bench_generate
from launch.bench import generate_workloads, sched_overhead
from launch.bench.results import read_runs
from moejax.sampling import Sampling, SamplingParams
from moejax.steps.rows import ChunkRows, PagedDecodeRows

TINY_RUN = ["generate", "--model", "micro-qwen3-moe", "--num-layers", "1", "--workload", "long-tail", "--requests",
            "4", "--no-transformers", "--max-batch-tokens", "1024"]


class _Greedy:
    """An engine whose greedy tokens are known: prompt p makes p[0] * 10 + k at position k (1-based)."""
    config = type("Config", (), {"vocab_size": 320})()

    def __init__(self):
        self.calls = []

    def generate(self, prompts, max_new_tokens):
        self.calls.append((len(prompts), max_new_tokens))
        return [[p[0] * 10 + k for k in range(1, max_new_tokens + 1)] for p in prompts]


def test_long_tail_stops_at_greedy_tokens_within_five():
    engine = _Greedy()
    reqs = generate_workloads.long_tail(engine, 16, seed=3)
    long = [r for r in reqs if not r["stop_token_ids"]]
    assert len(long) == 2 and engine.calls == [(14, 5)]  # one batched call for the short ones
    for r in reqs:
        assert 6 <= len(r["prompt"]) <= 40 and r["max_tokens"] == 160
        if r["stop_token_ids"]:
            assert 1 <= r["stop_token_ids"][0] - r["prompt"][0] * 10 <= 5
    made = [[0] * 160 if not r["stop_token_ids"] else [0] * 3 for r in reqs]
    made[reqs.index(long[0])] = [0] * 20  # ended early
    check = generate_workloads.long_tail_check(reqs, made)
    assert check == dict(short=14, short_stopped_within=14, long=2, long_ran_to_max=1, long_lengths_below_max=[20])


def test_noop_steps_keep_the_pool_and_fill_each_budget():
    engine = type("Engine", (), {"row_multiple": 1})()
    noop = sched_overhead.NoopSteps(engine, token=7)
    assert noop.row_multiple == 1  # everything else is the engine's
    pool = [{"k": jax.numpy.zeros((2, 16, 1, 4))}]
    keys = jax.random.split(jax.random.key(0), 4)
    rows, carry = np.zeros(4, np.int32), np.full(4, -1, np.int32)
    slot = np.array([0, 4, 2, 4], np.int32)  # rows 1 and 3 keep no token
    sampling = Sampling.of([SamplingParams()] * 4, keys, rows)
    same, carry, tok = noop.paged_chunk(pool, carry, ChunkRows(np.zeros((4, 16), np.int32), rows, rows,
                                                               np.zeros((4, 8), np.int32), slot, sampling), fresh=True)
    assert same[0]["k"] is pool[0]["k"] and tok.shape == (4,) and tok.dtype == np.int32 and set(np.asarray(tok)) == {7}
    np.testing.assert_array_equal(carry, [7, -1, 7, -1])
    budget = np.array([3, 0, 8, 1], np.int32)
    chain = np.array([True, False, False, True])  # row 3 chains on slot 1: no token there, so it makes none
    slot = np.array([0, 3, 2, 1], np.int32)
    decode = PagedDecodeRows(rows, chain, rows, budget, np.zeros((4, 8), np.int32), slot,
                             np.full((4, 4), -1, np.int32), sampling)
    _, carry, out = noop.paged_decode(pool, carry, decode, steps=8)
    np.testing.assert_array_equal((np.asarray(out) == 7).sum(axis=1), [3, 0, 8, 0])
    assert ((np.asarray(out) == 7) | (np.asarray(out) == -1)).all()
    np.testing.assert_array_equal(carry, [7, -1, 7, -1])
    assert sched_overhead.free_token([{"stop_token_ids": [1, 2]}, {"stop_token_ids": []}], (0,), 320) == 3


@pytest.fixture(scope="module")
def engine():
    """One engine for both runs: the stop tokens' generate call compiles once."""
    return moejax.load("micro-qwen3-moe", num_layers=1, dtype="float32", compilation_cache=False)


@pytest.fixture
def runs(engine, tmp_path, monkeypatch):
    monkeypatch.setattr(bench_generate.moejax, "load", lambda *args, **kwargs: engine)
    out = str(tmp_path / "generate.json")

    def run(*flags) -> dict:
        bench.main(TINY_RUN + list(flags) + ["--out", out])
        return read_runs(out)[-1]
    return run


@pytest.mark.slow  # a whole benchmark or CLI run end to end (tens of seconds)
def test_overhead_reports_host_time_per_step(runs):
    run = runs("--overhead")
    o = run["overhead"]
    assert run["scheduler"]["decode_steps"] == o["decode_steps"]  # the scheduler's own stats, its step times with them
    assert o["output_tokens"] == 4 * 160  # the no-op never stops a request: each runs to max_tokens
    assert o["chunk_steps"] > 0 and o["decode_steps"] > 0 and o["iterations"] > 0
    assert all(o[k] > 0 for k in ("chunk_us", "decode_us", "step_us", "iteration_us"))
    assert 0 < o["between_steps_us_per_iteration"] < o["iteration_us"]
    assert o["target_ms"] == 2.0 and isinstance(o["target_met"], bool)


@pytest.mark.slow  # a whole benchmark or CLI run end to end (tens of seconds)
def test_long_tail_compares_warm_and_compilation_included(runs):
    run = runs("--no-mixed")
    assert set(run["ratios"]) == {"continuous / static", "continuous / static, compilation included"}
    assert run["config"]["made"]["short_stopped_within"] == run["config"]["made"]["short"] == 3
    rows = {r["batching"]: r for r in run["results"]}
    assert set(rows) == {"continuous", "static"}
    compiled = {k: set(r["first_run_compiles"]["by_function"]) for k, r in rows.items()}
    assert "jit(chunk)" in compiled["continuous"] and "jit(chunk)" not in compiled["static"]
    for r in rows.values():  # each first run compiled its own step programs: nothing left from another
        compiles = r["first_run_compiles"]
        assert compiles["programs"] > 0 and compiles["compile_s_by_function"]["jit(decode)"] > 0
        assert r["same_tokens_as_static"] == 1.0 and r["first_run_s"] > r["seconds_median"]


def test_failed_requests_stop_the_benchmark_with_their_error():
    """A GPU run had every request fail (a kernel's tiles over shared memory): the bench names the error instead
    of a KeyError on the missing answer."""
    engine = moejax.load(fixture_dir("qwen3_moe"), dtype="float32")
    bad = dict(prompt=[engine.config.vocab_size + 5], max_tokens=2, stop_token_ids=[])
    with pytest.raises(SystemExit, match=r"bench generate: 1 of 1 requests failed under static batching; the first "
                                         r"\(g0\): .*vocab"):
        bench_generate._moejax(engine, [bad], "static", None, 256, None)
