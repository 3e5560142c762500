"""bench generate at full size and --decode-batches: a real-shaped preset at full depth never gets a transformers
checkpoint (its weights are drawn on the device); the fixed-batch decode mode runs each batch with that many decode
rows and writes out the bytes behind its MBU."""
import argparse

import pytest

from launch.bench import cli as bench
from launch.bench import generate as bench_generate
from launch.bench import util as bench_util
from launch.bench.results import read_runs


def test_a_real_shaped_preset_at_full_size_builds_no_transformers_checkpoint(tmp_path, monkeypatch):
    built = []
    monkeypatch.setattr(bench_util, "hf_checkpoint", lambda config, directory, seed: built.append(
        config["num_hidden_layers"]))

    def where(model, layers):
        return bench_generate._checkpoint(argparse.Namespace(model=model, num_layers=layers, no_transformers=False,
                                                             seed=0), str(tmp_path))
    assert where("qwen3-30b-a3b", None) == ("qwen3-30b-a3b", {}) and built == []  # 48 layers: on the device
    assert where("qwen3-30b-a3b", 48) == ("qwen3-30b-a3b", {"num_layers": 48}) and built == []
    assert where("qwen3-30b-a3b", 4) == (str(tmp_path), {}) and built == [4]  # a slice: both engines, one checkpoint
    assert where("tiny-qwen3-moe", None) == (str(tmp_path), {}) and built == [4, 4]  # a tiny one: cheap, compared


@pytest.mark.slow  # the CLI end to end: a one-layer model, two batches, about 30 s
def test_decode_batches_run_each_batch_with_its_rows(tmp_path):
    out = tmp_path / "decode.json"
    bench.main(["--note", "CPU, small sizes", "generate", "--model", "micro-qwen3-moe", "--num-layers", "1",
                "--decode-batches", "1,3", "--prompt-len", "8", "--output-len", "9", "--decode-steps", "4",
                "--chunk-tokens", "32", "--row-tokens", "16", "--copy-gbps", "10", "--out", str(out)])
    [record] = read_runs(str(out))
    assert record["note"] == "CPU, small sizes" and record["copy_ceiling"]["value"] == 10
    assert record["config"]["weights"]["source"] == "preset, drawn on the device"
    assert record["xla_startup"]["command_buffers"] is False
    one = record["results"][0]
    assert one["decode_iterations"] == 2 * 8 and one["mean_rows"] == 1  # one row: each sequence's 8 tokens alone
    for row, batch in zip(record["results"], (1, 3), strict=True):
        assert row["batch"] == batch and row["requests"] == 2 * batch and row["output_tokens"] == 2 * batch * 9
        assert row["scheduler"]["peak_rows"] == batch and row["bytes"]["tokens"] == 2 * batch * 8
        assert 1 <= row["mean_rows"] <= batch  # rows a token iteration: the batch at most
        assert row["bytes"]["iterations"] == row["decode_iterations"] and row["bytes"]["total"] > 0
