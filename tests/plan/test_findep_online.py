"""FinDEP's online phase (moejax.plan.findep_online) without devices: one solve per step shape, cache hits on a
repeated shape, pinned fields held, r1 only where the rows split evenly over the attention group, the profile
resolved once; and the load turning r1/r2/order=auto into online fields."""
import dataclasses

import pytest

from moejax.config import ModelConfig
from moejax.layout import Layout
from moejax.plan.auto import plan_layout
from moejax.plan.datasheets import load_profile
from moejax.plan.engine_plan import EnginePlan
from moejax.plan.findep import solve_step
from moejax.plan.findep_online import OnlineDep, even_micro_batches
from moejax.presets import preset_config

CFG = ModelConfig.from_hf(preset_config("deepseek-v2-lite"))  # 64 experts, shared experts
H100 = load_profile("h100")


def _layout(spec: str, online: tuple) -> Layout:
    return dataclasses.replace(Layout.parse(spec).resolve(CFG.num_experts, 8), online=online)


def _planner(spec="experts=dep,attn_devices=4,expert_devices=4", online=("r1", "r2", "order")):
    calls = []

    def find_profile():
        calls.append(1)
        return H100
    return OnlineDep(CFG, _layout(spec, online), find_profile), calls


def test_each_shape_is_solved_once_then_served_from_the_cache():
    planner, calls = _planner()
    first = planner.layout_for(64, 512)
    assert planner.as_dict()["shapes"] == 1 and planner.as_dict()["hits"] == 0
    assert planner.layout_for(64, 512) == first and planner.schedules[(64, 512)].hits == 1
    planner.layout_for(64, 1)  # a decode step's shape: a new solve
    d = planner.as_dict()
    assert d["shapes"] == 2 and d["hits"] == 1 and len(calls) == 1  # the profile resolved once
    assert all(s["solve_s"] > 0 and s["predicted_s"] > 0 for s in d["schedules"])
    # the solution is the solver's for that shape on the fixed split
    choice = solve_step(CFG, H100, attn_devices=4, expert_devices=4, rows=64, tokens_per_row=512,
                        r1_choices=even_micro_batches(64, 4))
    assert (first.r1, first.r2, first.order) == (choice.r1, choice.r2, choice.order)
    assert (first.attn_devices, first.expert_devices) == (4, 4)
    assert "64 rows x 512 tokens" in planner.describe()


def test_pinned_fields_are_held_and_r1_splits_rows_evenly():
    planner, _ = _planner("experts=dep,attn_devices=4,expert_devices=4,r2=3,order=aass", online=("r1",))
    for rows, tokens in ((64, 512), (48, 128), (4, 1)):
        lay = planner.layout_for(rows, tokens)
        assert (lay.r2, lay.order) == (3, "aass")
        assert (rows // 4) % lay.r1 == 0  # equal micro-batches, each a multiple of the 4 attention devices
        assert lay.row_multiple == 4
    assert even_micro_batches(48, 4) == [1, 2, 3, 4, 6, 12] and even_micro_batches(6, 4) == [1]


def test_bad_inputs_name_the_problem():
    with pytest.raises(ValueError, match="layout.online must name some of r1, r2, order"):
        _planner(online=())
    with pytest.raises(ValueError, match="needs a resolved DEP layout"):
        OnlineDep(CFG, Layout.parse("experts=ep").resolve(64, 8), lambda: H100)
    planner, _ = _planner()
    with pytest.raises(ValueError, match="0 rows x 16 tokens has no tokens"):
        planner.layout_for(0, 16)
    with pytest.raises(ValueError, match="r1_choices must be a non-empty list"):
        solve_step(CFG, H100, attn_devices=4, expert_devices=4, rows=8, tokens_per_row=16, r1_choices=[])


def test_a_shape_the_solver_cannot_plan_runs_the_loads_values_and_says_why():
    small = H100.with_overrides({"device.memory_bytes": 2**30})  # the non-expert weights alone do not fit
    lay = _layout("experts=dep,attn_devices=4,expert_devices=4,r1=2,r2=2", ("r1", "r2", "order"))
    planner = OnlineDep(CFG, lay, lambda: small)
    got = planner.layout_for(8, 16)
    assert (got.r1, got.r2, got.order) == (2, 2, "asas")
    assert "memory" in planner.schedules[(8, 16)].why and planner.schedules[(8, 16)].predicted_s is None
    assert planner.layout_for(4, 16).r1 == 1  # 4 rows over 4 attention devices cannot take the load's r1 = 2


def test_auto_fields_become_online_and_pinned_ones_do_not():
    plan = EnginePlan(layout="attn=dp,experts=dep,attn_devices=4,expert_devices=4,r1=auto,order=auto",
                      workload=dataclasses.replace(EnginePlan().workload, tokens=4096, seq_len=512))
    planned, _ = plan_layout(CFG, plan, H100, 8)
    assert isinstance(planned.layout, Layout) and planned.layout.online == ("r1", "order")
    assert planned.layout.r2 == 1  # not auto: the default, pinned
    with pytest.raises(ValueError, match="unknown key 'online'"):
        Layout.parse("experts=dep,online=r1")
