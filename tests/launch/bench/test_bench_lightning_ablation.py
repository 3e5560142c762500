"""bench lightning-ablation end to end at small sizes: both launch orders timed in one engine, the same tokens, the
ratio their tokens/s make."""
import pytest

from launch.bench import cli as bench
from launch.bench.results import read_runs


@pytest.mark.slow  # the CLI end to end: a lightning engine of the qwen3_moe fixture compiled and run 5 times
def test_bench_lightning_ablation_times_both_orders(tmp_path):
    from conftest import fixture_dir
    out = tmp_path / "ablation.json"
    bench.main(["lightning-ablation", "--model", fixture_dir("qwen3_moe"), "--requests", "4", "--prompt-len", "8",
                "--new-tokens", "4", "--micro-batch", "2", "--repeats", "2", "--out", str(out)])
    [record] = read_runs(str(out))
    assert record["same_tokens"] and record["peak_rows"] == 4 and record["policy"]["micro_batches"] == 2
    rate = {r["schedule"]: r for r in record["runs"]}
    assert set(rate) == {"cgopipe", "flexgen"} and all(len(r["seconds_each"]) == 2 for r in rate.values())
    assert rate["cgopipe"]["generated_tokens"] == 4 * 4
    assert record["cgopipe_vs_flexgen"] == pytest.approx(rate["cgopipe"]["tokens_per_s"]
                                                         / rate["flexgen"]["tokens_per_s"])
    assert record["command"].startswith("python -m launch.bench")
