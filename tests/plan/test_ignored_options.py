"""Options for a placement that `auto` did not choose are kept (on another machine auto may choose it) but said as
ignored, with why, on stderr and in --explain; under an explicit placement they stay refused. --devices-per-replica
without replicas is said as ignored too."""
import pytest
from conftest import fixture_dir

import moejax
from launch.serve import main

MODEL = fixture_dir("qwen3_moe")  # fits any device: auto chooses resident
CACHED_OPTIONS = dict(predictor="oracle", cache_slots=3, prefill_experts="stream")


def test_auto_keeps_other_placements_options_and_says_they_are_ignored(capsys):
    engine = moejax.load(MODEL, dtype="float32", placement="auto", **CACHED_OPTIONS)
    assert engine.placement.name == "resident"
    said = ("ignored: cache_slots (--cache-slots), predictor (--predictor), prefill_experts (--prefill-experts) apply "
            "to placement cached, and placement auto chose resident")
    assert any(d.startswith(said) for d in engine.decisions)
    assert f"note: {said}" in capsys.readouterr().err
    assert said in engine.explain()
    assert not [d for d in moejax.load(MODEL, dtype="float32").decisions if d.startswith("ignored")]


def test_an_explicit_placement_still_refuses_them():
    with pytest.raises(ValueError, match="cache_slots applies to placement 'cached', not 'resident'"):
        moejax.load(MODEL, dtype="float32", placement="resident", **CACHED_OPTIONS)


def test_serve_says_what_it_ignores_on_stderr_and_in_explain(tmp_path, capsys):
    (tmp_path / "in.jsonl").write_text('{"custom_id": "c", "url": "/v1/completions", "body": {"prompt": [1, 2], '
                                       '"max_tokens": 2}}\n')
    assert main(["--model", MODEL, "--input", str(tmp_path / "in.jsonl"), "--devices-per-replica", "4",
                 "--predictor", "oracle", "--cache-slots", "3", "--explain"]) == 0
    out, err = capsys.readouterr()
    for said in ("--devices-per-replica 4 is ignored: it sizes each engine replica, and --replicas 1 runs one engine",
                 "ignored: cache_slots (--cache-slots), predictor (--predictor) apply to placement cached"):
        assert said in out and said in err
