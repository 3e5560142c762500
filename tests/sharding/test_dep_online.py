"""DEP with FinDEP's online phase (r1, r2, order re-solved per step shape, from a cache of solutions) and DEP under
continuous batching (paged steps whose rows split into micro-batches over the one KV pool), each against the
one-device float32 model, in a process with 8 simulated CPU devices (tests/dep_online_worker.py)."""
import pytest
from workers import run_workers

TOL = 1e-5


@pytest.fixture(scope="module")
def results():
    return run_workers("dep_online_worker.py", [[]], devices=8, timeout=1200)[0]


def _solved(log):
    return {(s["rows"], s["tokens_per_row"]): s for s in log["schedules"]}


@pytest.mark.slow  # two DEP engines compiled (about 2 minutes on 2 shared cores)
def test_online_schedules_are_solved_per_shape_cached_and_run(results):
    """r1, r2, order=auto on attn_devices=4, expert_devices=4 (deepseek_v2_lite fixture; the h100 datasheet without
    per-op overheads, so the tiny model's shapes get different schedules): the first shape is solved, a second
    shape is solved anew, the first again is a cache hit; each step runs the schedule solved for its shape, with
    the one-device logits."""
    r = results["online"]
    assert r["layout_online"] == ["r1", "r2", "order"] and r["row_multiple"] == 4  # A, not A * r1: r1 is per step
    for key in ("rel_a", "rel_b", "rel_a_again"):
        assert r[key] <= TOL, key
    a, b = (4, 16), (16, 16)
    assert list(_solved(r["log_a"])) == [a] and r["log_a"]["hits"] == 0
    assert list(_solved(r["log_b"])) == [a, b] and r["log_b"]["hits"] == 0  # a new shape: a new solve
    again = _solved(r["log_a_again"])
    assert again[a]["hits"] == 1 and again[b]["hits"] == 0 and r["log_a_again"]["shapes"] == 2  # no new solve
    assert again[a]["solve_s"] == _solved(r["log_a"])[a]["solve_s"] > 0
    for shape, ran in ((a, r["ran_a"]), (b, r["ran_b"]), (a, r["ran_a_again"])):
        s = again[shape]
        assert not s["why"] and s["predicted_s"] > 0
        assert (ran["r1"], ran["r2"], ran["order"]) == (s["r1"], s["r2"], s["order"])
        assert (ran["micro_batches"], ran["chunks"]) == (s["r1"], s["r2"])  # what the attention group dispatched
    assert (again[a]["r1"], again[a]["r2"], again[a]["order"]) != (again[b]["r1"], again[b]["r2"], again[b]["order"])
    assert again[b]["r1"] > 1  # the larger step is split into micro-batches


@pytest.mark.slow
def test_online_dep_generates_the_reference_tokens_static_and_continuous(results):
    r = results["online"]
    assert r["same_tokens"]
    assert r["continuous_tokens"] == results["reference_tokens"]
    log = _solved(r["log_end"])
    assert any(t == 1 for _, t in log) and r["log_end"]["hits"] > r["log_a_again"]["hits"]  # decode steps too
    assert "online FinDEP: r1, r2, order re-solved per step shape" in r["explain"]


@pytest.mark.slow
def test_dep_runs_continuous_batching_with_rows_split_over_the_pool(results):
    """r1=2, r2=2, AASS pinned: every chunk and decode step of the scheduler runs as two micro-batches of rows over
    the shared KV pool, with the one-device tokens. The 21-token prompt fills two rows of the first chunk step, which
    fall in different micro-batches (rows 3 and 4 of 8): the second reads the keys the first wrote in the same
    step. Pinned fields are not re-solved."""
    r = results["pinned"]
    assert r["continuous"] and r["chunk_steps"] >= 1
    assert r["continuous_tokens"] == results["reference_tokens"]
    assert r["micro_batches"] == [0, 1]
    assert not r["has_online"]
