"""launch.bench offload's cached-decode modes (fMoE's §6.5 ablations): TTFT and TPOT of the expert-map predictor and its
ablations against the router, the estimator and LRU-only caching, end to end on a fixture model."""
import json

import pytest
from conftest import fixture_dir

from launch.bench import cli as bench
from launch.bench.offload_modes import parse_modes


def test_modes_parse_with_the_baseline_first_and_unknown_ones_named():
    assert parse_modes("expert_map,on-demand,expert_map-T") == ["on-demand", "expert_map", "expert_map-T"]
    with pytest.raises(ValueError, match="unknown oracle"):
        parse_modes("prefetch,oracle")


@pytest.mark.slow  # a whole benchmark end to end (about a minute alone)
def test_bench_offload_measures_every_mode_and_writes_the_record(tmp_path):
    out = tmp_path / "offload.json"
    modes = "on-demand,prefetch,estimator,expert_map,expert_map-T+S,expert_map-T,moe_infinity,moe_infinity-online"
    bench.main(["offload", "--model", fixture_dir("qwen3_moe"), "--quick", "--sections", "decode", "--modes", modes,
                "--distill-steps", "4", "--calibration-prompts", "3", "--out", str(out),
                "--plot", str(tmp_path / "modes.png")])
    run = json.loads(out.read_text())["runs"][-1]
    assert {"device", "versions", "command"} <= set(run) and run["prefill"] is None
    rows = {r["mode"]: r for r in run["decode"]["rows"]}
    assert list(rows) == ["resident"] + modes.split(",")
    for name, row in rows.items():
        assert row["ttft_s"] > 0 and "tpot_s" in row
        if name != "resident":
            assert 0 <= row["stats"]["hit_rate"] <= 1 and row["tokens_equal_resident"] == 1.0  # prefetch is exact
    assert rows["on-demand"]["stats"]["totals"]["prefetches"] == 0
    assert all(rows[m]["stats"]["totals"]["prefetches"] > 0 for m in modes.split(",")[1:])
    assert all(rows[m]["store"]["maps"] == 3 for m in modes.split(",") if m.startswith("expert_map"))
    # MoE-Infinity: one activation matrix per calibration prompt; online, the warm-up's requests once done
    assert rows["moe_infinity"]["activation_matrices"] == 3 and rows["moe_infinity-online"]["activation_matrices"] > 0
    assert "activation matrices, 3 of capacity 3" in rows["moe_infinity"]["placement"]
    placement = rows["expert_map-T"]["placement"]
    assert "expert_map (3 maps" in placement and "distance 1, T;" in placement  # Map (T): no semantic, no δ
    assert run["decode"]["calibration"]["distill_steps"] == 4
    assert (tmp_path / "modes.png").stat().st_size > 0


@pytest.mark.slow  # calibrates a fixture model (about 10 s alone)
def test_decode_placements_calibration_is_saved_and_read_back(tmp_path):
    """--save-calibration makes the predictors' calibration (nothing timed); --calibration reads it back as it was;
    bad directories and names are refused before any work."""
    import argparse

    import numpy as np

    import moejax
    from launch.bench.decode_placements import Calibration, check_arguments, parse_placements
    from moejax.offload.predict import DefaultVectors
    saved = tmp_path / "calibration"
    out = tmp_path / "offload.json"
    bench.main(["offload", "--model", fixture_dir("qwen3_moe"), "--quick", "--sections", "decode", "--placements",
                "cached-router", "--save-calibration", str(saved), "--out", str(out)])
    run = json.loads(out.read_text())["runs"][-1]
    assert run["decode"]["rows"] == [] and run["decode"]["calibration"]["store"]["maps"] == 4
    args = argparse.Namespace(placements="cached-lru,cached-oracle,cached-expert_map", calibration=str(saved),
                              save_calibration=None, budget_fraction=0.4)
    check_arguments(args)
    read = Calibration(moejax.load(fixture_dir("qwen3_moe"), dtype="float32"), args, print).value
    assert len(read.store) == 4 and read.record["read_from"] == str(saved)
    vectors = DefaultVectors.load(read.vectors_path)
    assert vectors.vectors.shape[0] == 3 and np.any(vectors.vectors != 0)  # the fixture's three layers
    for bad, message in ((dict(save_calibration=str(saved)), "--save-calibration: .* exists"),
                         (dict(calibration=str(tmp_path)), "--calibration: .* does not hold"),
                         (dict(budget_fraction=1.5), "--budget-fraction")):
        with pytest.raises(ValueError, match=message):
            check_arguments(argparse.Namespace(**{**vars(args), **bad}))
    with pytest.raises(ValueError, match="unknown cached-orcale"):
        parse_placements("resident,cached-orcale")
    with pytest.raises(ValueError, match="needs cached-lru before it"):
        parse_placements("cached-oracle,cached-lru")


@pytest.mark.slow  # a whole benchmark section end to end
def test_bench_offload_fmoe_section_sweeps_slots_distance_and_store_policy(tmp_path):
    """fMoE's sensitivity rows: TPOT against the cache size and the prefetch distance, and the online stores
    (empty at start, capacity 2) under §4.4's redundancy and the hit-count policy; every row's tokens are the
    resident model's, the online stores filled to capacity and the hit-count one counted its searches."""
    out = tmp_path / "fmoe.json"
    bench.main(["offload", "--model", fixture_dir("qwen3_moe"), "--quick", "--sections", "fmoe", "--fmoe-slots",
                "8,16", "--fmoe-distances", "1,2", "--fmoe-capacity", "2", "--new-tokens", "4",
                "--calibration-prompts", "2", "--out", str(out)])
    rows = json.loads(out.read_text())["runs"][-1]["fmoe"]["rows"]
    assert [(r["predictor"], r["sweep"], r["value"]) for r in rows] == [
        ("on-demand", "slots", 8), ("expert_map", "slots", 8), ("on-demand", "slots", 16),
        ("expert_map", "slots", 16), ("expert_map", "distance", 1),  # d = 2 dropped: the fixture has 2 MoE layers
        ("expert_map-online-redundancy", "capacity", 2), ("expert_map-online-hits", "capacity", 2)]
    assert all(r["tokens_equal_resident"] == 1.0 and 0 <= r["stats"]["hit_rate"] <= 1 for r in rows)
    assert "distance 1" in rows[4]["placement"]
    online = {r["store"]["policy"]: r["store"] for r in rows[5:]}
    assert online["redundancy"]["maps"] == online["hits"]["maps"] == 2 and online["hits"]["hits"] > 0
