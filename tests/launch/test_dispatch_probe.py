"""launch.dispatch_probe on the CPU: it records a continuous run's decode calls and replays every variant of them
(the numbers only mean something on a GPU, bench/README.md's fifth check)."""
import json
import sys

import pytest

from launch import dispatch_probe


@pytest.mark.slow  # 25 s: a model's continuous run, then four replays
def test_the_probe_replays_every_variant(tmp_path, monkeypatch, capsys):
    out = tmp_path / "probe.json"
    monkeypatch.setattr(sys, "argv", ["dispatch_probe", "--model", "tiny-qwen3-moe", "--requests", "3",
                                      "--max-new", "12", "--out", str(out)])
    dispatch_probe.main()
    record = json.loads(out.read_text())
    variants = record["variants"]
    assert record["decode_calls"] > 0
    for name in ("as run", "inputs on device", "no donation", "no donation, exit checked every token"):
        assert variants[name]["calls"] == record["decode_calls"] and variants[name]["wall_ms_per_call"] > 0
    assert variants["guard"] == "no read back to the host inside the dispatch"
    assert "decode calls" in capsys.readouterr().out
