"""bench invariant end to end at small sizes: the record holds both engines' prefill and decode throughput per
round, the cost, and the mode's promise checked on the timed batch (and broken without the mode)."""
import pytest

from launch.bench import cli as bench
from launch.bench.results import read_runs


@pytest.mark.slow  # the CLI end to end: two engines of the qwen3_moe fixture, every shape compiled twice
def test_bench_invariant_records_both_engines_and_the_cost(tmp_path):
    from conftest import fixture_dir
    out = tmp_path / "invariant.json"
    bench.main(["invariant", "--model", fixture_dir("qwen3_moe"), "--dtype", "float32", "--batch", "4",
                "--prompt-len", "24", "--new-tokens", "4", "--repeats", "2", "--out", str(out)])
    [record] = read_runs(str(out))
    assert record["alone_equals_batched"] == {"default": False, "invariant": True}
    for kind in ("prefill", "decode"):
        runs = record["tokens_per_s_runs"][kind]
        assert len(runs["default"]) == len(runs["invariant"]) == 2
        assert record["cost"][kind] == pytest.approx(1 - record["tokens_per_s"][kind]["invariant"]
                                                     / record["tokens_per_s"][kind]["default"])
    assert min(record["tokens_per_s_runs"]["prefill"]["invariant"]) > 0  # (decode's is a slope: noisy this small)
    assert record["device"]["platform"] == "cpu" and record["command"].startswith("python -m launch.bench")
