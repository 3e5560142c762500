"""bench serve --orders longest,spf under --placement streamed with --profile: a CPU has no hardware profile, so Θ
comes from the one named; the default order fills its batches to Θ (fewer, larger batches than the token budget),
shortest prefill first keeps to the budget, and neither changes a score."""
import numpy as np
import pytest

from launch.bench import cli as bench
from launch.bench.results import read_runs


@pytest.mark.slow  # the tiny preset streamed, each order compiled
def test_theta_batching_against_shortest_prefill_first_with_a_named_profile(tmp_path):
    out = tmp_path / "serve.json"
    bench.main(["serve", "--model", "tiny-qwen3-moe", "--workloads", "mixed", "--kv-modes", "off", "--orders",
                "longest,spf", "--requests", "12", "--prefix", "96", "--suffix", "8", "--max-batch-tokens", "256",
                "--no-resident", "--repeats", "1", "--placement", "streamed", "--profile", "t4", "--out", str(out)])
    [record] = read_runs(str(out))
    config = record["config"]
    assert config["profile"] == "t4" and "t4" in config["theta_source"]
    assert config["theta_tokens"] > 256  # the T4's Θ for this model is far above the batch budget
    rows = {r["order"]: r for r in record["results"]}
    theta, spf = rows["longest"], rows["spf"]
    assert theta["computed_tokens"] == spf["computed_tokens"] == theta["prompt_tokens"]
    assert theta["batches"] < spf["batches"]  # Θ-batching fills batches past the budget; spf keeps to it
    for a, b in zip(theta["sample"], spf["sample"], strict=True):
        assert a["custom_id"] == b["custom_id"]
        np.testing.assert_allclose(a["logprobs"], b["logprobs"], rtol=1e-5, atol=1e-5)
