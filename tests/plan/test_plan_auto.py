"""Typed plans (EnginePlan, PlacementSettings) as moejax.load takes them, and `auto` asking the planners: the layout
planner on datasheet profiles, placement auto once bytes alone do not decide."""
import dataclasses

import pytest

import moejax
from moejax.config import ModelConfig
from moejax.offload.settings import PlacementSettings
from moejax.plan.datasheets import load_profile
from moejax.plan.engine_plan import EnginePlan, Workload
from moejax.plan.layouts import candidates, choose_layout, predict_layout
from moejax.presets import preset_config

QWEN3 = ModelConfig.from_hf(preset_config("qwen3-30b-a3b"))
MIXTRAL = ModelConfig.from_hf(preset_config("mixtral-8x7b"))


def test_a_plan_loads_what_the_keywords_load():
    keywords = moejax.load("tiny-qwen3-moe", placement="streamed", window=1, device_memory_gb=1.0)
    plan = EnginePlan(PlacementSettings(placement="streamed", window=1, device_memory_gb=1.0))
    typed = moejax.load("tiny-qwen3-moe", plan=plan)
    assert typed.memory_budget == keywords.memory_budget and typed.plan == keywords.plan == plan
    with pytest.raises(TypeError, match="give plan= or the options \\['window'\\], not both"):
        moejax.load("tiny-qwen3-moe", plan=plan, window=2)


@pytest.mark.parametrize("settings, message", [
    (dict(placement="everywhere"), "placement must be one of auto, resident, streamed, cached"),
    (dict(placement="resident", window=2), "window applies to placement 'streamed', not 'resident'"),
    (dict(placement="cached", cache_slots=0), "cache_slots must be an int >= 1, got 0"),
    (dict(predictor="router"), "predictor 'router' needs default_vectors"),
    (dict(stream="jit", window=1), "window applies to stream='python'"),
])
def test_settings_are_checked_where_they_are_built(settings, message):
    with pytest.raises(ValueError, match=message):
        PlacementSettings(**settings)
    with pytest.raises(ValueError, match=message):  # the keyword form goes through the same check
        moejax.load("tiny-qwen3-moe", **settings)


def test_bad_plan_fields_name_themselves():
    with pytest.raises(ValueError, match="plan_tokens must be an int >= 1, got 0"):
        Workload(tokens=0)
    with pytest.raises(ValueError, match="unknown key 'expert'"):
        EnginePlan(layout="attn=dp,expert=ep")
    with pytest.raises(ValueError, match="r1 applies to experts=dep, not ep"):
        EnginePlan(layout="experts=ep,r1=auto")


def test_a_profile_asked_for_that_does_not_exist_is_refused():
    """A profile named but missing is the user's mistake: refused, not replaced by a measured one (one is measured
    only when none is asked for: tests/plan/test_quick_profile.py)."""
    with pytest.raises(ValueError, match="profile 'no-such-profile' is neither a datasheet profile"):
        moejax.load("tiny-qwen3-moe", layout="auto", profile="no-such-profile")


def test_placement_auto_asks_the_planner_when_streamed_and_cached_both_fit():
    """A budget too small for every expert but room for two layers of them: bytes allow streamed and cached; the
    h100 profile's model decides for 8192-token steps (streamed: the copy hides behind that much compute) and
    names the runner-up with its predicted rate. A single decode token is the other way round."""
    prefill = moejax.load("tiny-qwen3-moe", device_memory_gb=0.0022, profile="h100")
    assert prefill.memory_budget.placement == "streamed"
    text = "\n".join(prefill.decisions)
    assert "placement auto: streamed predicted" in text and "cached:" in text
    decode = moejax.load("tiny-qwen3-moe", device_memory_gb=0.0022, profile="h100", plan_tokens=1)
    assert decode.memory_budget.placement == "cached", decode.decisions
    no_profile = moejax.load("tiny-qwen3-moe", device_memory_gb=0.0022)  # CPU: bytes decide, and it says so
    assert no_profile.memory_budget.placement == "streamed" and "by bytes alone" in no_profile.decisions[0]


def test_layout_planner_prefers_what_its_model_says_and_lists_what_does_not_fit():
    h100 = load_profile("h100")
    choice = choose_layout(MIXTRAL, h100, 8, 16384, 2048)
    times = [o.predicted_s for o in choice.options if o.predicted_s is not None]
    assert times == sorted(times) and choice.best.predicted_s == times[0]
    unfit = [o for o in choice.options if o.predicted_s is None]
    assert {o.spec.split(",devices")[0] for o in unfit} >= {"attn=dp,experts=replicated"}  # 87 GiB > 72 GiB
    assert all("does not fit" in o.why for o in unfit if "replicated" in o.spec)
    # slower links make the layouts that move activations (ep's all-to-alls) slower, not the compute
    ep = next(layout for layout in candidates(QWEN3, 8) if layout.experts == "ep")
    slow = h100.with_overrides({"all_to_all.bandwidth": h100.all_to_all.bandwidth / 10})
    base, slowed = predict_layout(QWEN3, h100, ep, 16384, 2048), predict_layout(QWEN3, slow, ep, 16384, 2048)
    assert slowed.compute_s == base.compute_s and slowed.comm_s > 5 * base.comm_s
    assert dataclasses.replace(choice, options=()).best == choice.best
