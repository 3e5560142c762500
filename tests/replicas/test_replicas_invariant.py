"""batch_invariant=True across engine replicas (Ray): in bfloat16, where the default engine's last bits follow the
batch a request is packed in, two replicas write exactly one engine's results, log-probabilities bit for bit. (This
small workload happens to come out equal without the mode too; tests/models/test_batch_invariant.py shows the
batch moving a request's bits without it.)"""
import functools
import json
import os

import pytest

ray = pytest.importorskip("ray")

import moejax  # noqa: E402
from moejax.replicas.run import ReplicaPlan, ReplicaRun  # noqa: E402
from moejax.sched.batch import engine_settings, serve_lines  # noqa: E402
from moejax.sched.serving_options import ServingOptions  # noqa: E402

pytestmark = pytest.mark.slow

QWEN3 = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "qwen3_moe")
OPTIONS = ServingOptions(max_batch_tokens=256)
NONCE = 5
# a partial of moejax.load: Ray pickles it by reference to moejax, which a replica's process imports
make_engine = functools.partial(moejax.load, QWEN3, dtype="bfloat16", batch_invariant=True)


def workload() -> list[str]:
    """Scoring requests sharing one of two prefixes, and greedy completions."""
    prefixes = ["The clever fox reads a map of the old city and the river, then walks along the quiet bridge past",
                "Seven blue clouds drift over the tiny engine while every robot sings a long song about the sea"]
    lines = [json.dumps({"custom_id": f"score-{k}", "url": "/v1/score", "body": {
        "prompt": f"{prefixes[k % 2]} number {k} says", "candidates": [" yes", " no", " maybe so"]}}) for k in range(8)]
    lines += [json.dumps({"custom_id": f"greedy-{k}", "url": "/v1/completions", "body": {
        "prompt": f"{prefixes[k % 2]} {k}", "max_tokens": 8, "temperature": 0}}) for k in range(4)]
    return lines


def results(path) -> dict[str, object]:
    """custom_id -> what the engine computed (scores, tokens, texts), less the ids, times and cache counts."""
    out = {}
    with open(path) as f:
        for line in map(json.loads, f):
            body = line["response"]["body"]
            out[line["custom_id"]] = body.get("results") or body.get("choices")
    return out


def test_two_replicas_write_one_engines_results_bit_for_bit(tmp_path):
    one = str(tmp_path / "one.jsonl")
    engine = make_engine()
    serve_lines(engine, workload(), one, OPTIONS, seed_nonce=NONCE,
                settings={**engine_settings(engine), "placement": engine.memory_budget.placement})
    two = str(tmp_path / "two.jsonl")
    os.environ.setdefault("RAY_worker_niceness", "0")
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)
    try:
        run = ReplicaRun(make_engine, OPTIONS, ReplicaPlan(replicas=2, routing="round_robin"), model=QWEN3)
        try:
            infos = run.start(())
            base, placement = run.settings(infos)
            run.serve(workload(), two, {**base, "placement": placement}, infos, seed_nonce=NONCE)
        finally:
            run.stop()
        assert len(set(run.served_by.values())) == 2  # both replicas served
    finally:
        ray.shutdown()
    assert results(two) == results(one)  # exact: floats compared by value, every bit
