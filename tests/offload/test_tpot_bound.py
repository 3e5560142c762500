"""Speculating Experts' Eq. 1 (moejax.offload.tpot_bound): the bound by hand, and against measured decodes of a model
whose expert copies outweigh its compute even on a CPU (the tiny-wide-experts preset)."""
import argparse
import json

import pytest

from launch.bench import tpot_sweep
from moejax.offload.tpot_bound import misses_per_layer, tpot_bounds

MiB = 1 << 20


def test_bounds_by_hand_per_placement():
    # 2 MoE layers of 8 experts, 4 MiB each at 1 MiB/ms: one copy 4 ms; compute 1 + 2 ms per step
    b = tpot_bounds([1e-3, 2e-3], 4 * MiB, MiB / 1e-3, moe_layers=2, experts_per_layer=8, copied_per_layer=[1, 0.5])
    assert b["resident"].copy_s == 0 and b["resident"].overlapped_s == b["resident"].on_demand_s == pytest.approx(3e-3)
    cached = b["cached"]
    assert cached.experts_copied == 1.5 and cached.copy_s == pytest.approx(6e-3)
    assert cached.on_demand_s == pytest.approx(9e-3) and cached.overlapped_s == pytest.approx(6e-3)
    assert cached.saving_s == pytest.approx(3e-3)  # Eq. 1: at most min(compute, copy) saved
    streamed = b["streamed"]
    assert streamed.experts_copied == 16 and streamed.copy_s == pytest.approx(64e-3)
    assert streamed.overlapped_s == pytest.approx(64e-3) and streamed.on_demand_s == pytest.approx(67e-3)


def test_hit_rate_gives_the_misses_and_bad_inputs_are_named():
    assert misses_per_layer(0.75, top_k=2) == 0.5 and misses_per_layer(0.5, top_k=2, batch=4) == 4
    with pytest.raises(ValueError, match="hit_rate"):
        misses_per_layer(1.5, top_k=2)
    with pytest.raises(ValueError, match="3 copied_per_layer values for 2 MoE layers"):
        tpot_bounds(1e-3, MiB, 1e9, 2, 8, [1, 1, 1])
    with pytest.raises(ValueError, match="copy_bytes_per_s"):
        tpot_bounds(1e-3, MiB, 0.0, 2, 8, 1)


def test_bad_flags_fail_before_any_work():
    args = lambda **kw: argparse.Namespace(**{**_defaults(), **kw})  # noqa: E731
    with pytest.raises(ValueError, match="--contexts"):
        tpot_sweep.defaults(args(contexts="64,x"), gpu=False)
    with pytest.raises(ValueError, match="--placements"):
        tpot_sweep.defaults(args(placements="cached,streamed"), gpu=False)
    with pytest.raises(ValueError, match="--new-tokens"):
        tpot_sweep.defaults(args(new_tokens=3), gpu=False)


def _defaults() -> dict:
    parser = argparse.ArgumentParser()
    tpot_sweep.add_arguments(parser)
    return vars(parser.parse_args([]))


@pytest.mark.slow  # three engines of a 288 MiB model decoding, five rounds (about a minute alone)
def test_measured_tpot_is_above_the_bound_and_ordered_as_it_orders():
    args = tpot_sweep.defaults(argparse.Namespace(**{**_defaults(), "contexts": "64", "repeats": 5}), gpu=False)
    engines = tpot_sweep.load_engines(args)
    # this process's CPU seconds: the test shares its cores with other processes, whose load would inflate the
    # many small dispatches of a decode step far more than one large copy
    point = tpot_sweep.measure_point(engines, list(range(1, 65)), args.new_tokens, args.repeats, args.copy_repeats,
                                     clock="cpu")
    rows = point["placements"]
    print(json.dumps(point, indent=1))  # shown when an assertion fails
    cached = rows["cached"]
    # top-k slots: every MoE layer's experts evict the previous layer's, so each step copies top-k per layer
    assert cached["experts_copied_per_step"] == pytest.approx(2 * 2)
    assert rows["resident"]["experts_copied_per_step"] == 0
    # measured at or above the least TPOT any overlap reaches; CPU timings of one moment and the next differ by
    # ~25%, hence the margin (a copy term 8x too large, bytes for bits, still fails)
    assert cached["tpot_s"] >= 0.8 * cached["bound"]["overlapped_s"]
    # in CPU seconds copies and compute cannot overlap: the on-demand sum bounds it too
    assert cached["tpot_s"] >= 0.8 * cached["bound"]["on_demand_s"]
    # the bound orders the placements as their measurements do; on a CPU copies and compute share the cores, so the
    # on-demand form orders them (without the copy term all three would tie)
    by_bound = sorted(rows, key=lambda name: rows[name]["bound"]["on_demand_s"])
    by_measure = sorted(rows, key=lambda name: rows[name]["tpot_s"])
    assert by_bound == by_measure == ["resident", "cached", "streamed"]
    bounds = [rows[name]["bound"]["on_demand_s"] for name in by_bound]
    assert bounds[0] < bounds[1] < bounds[2]
