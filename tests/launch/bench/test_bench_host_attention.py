"""bench host-attention end to end at tiny shapes: a row per context with both times, and the plot."""
import pytest

from launch.bench import cli as bench
from launch.bench.results import read_runs


@pytest.mark.slow  # the CLI end to end: three programs compiled per context
def test_bench_host_attention_writes_a_row_per_context_and_the_plot(tmp_path):
    out, plot = tmp_path / "host-attention.json", tmp_path / "fig9.png"
    bench.main(["host-attention", "--contexts", "16,64", "--batch", "2", "--heads", "4", "--kv-heads", "2",
                "--head-dim", "8", "--dtype", "float32", "--repeats", "1", "--out", str(out), "--plot", str(plot)])
    [record] = read_runs(str(out))
    assert [r["context"] for r in record["rows"]] == [16, 64]
    assert record["rows"][1]["kv_bytes"] == 4 * record["rows"][0]["kv_bytes"]  # 4 blocks of 16 per row against 1
    assert all(r["host_s"] > 0 and r["move_s"] > 0 for r in record["rows"])
    assert "Fig. 9" in record["figure"] and record["command"].startswith("python -m launch.bench")
    try:
        import matplotlib  # noqa: F401  (optional: without it the record has no plot)
    except ImportError:
        assert record["plot"] is None
    else:
        assert record["plot"] == str(plot) and plot.stat().st_size > 0
