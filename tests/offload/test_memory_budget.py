"""The memory budgeting: budget -> placement and sizes, or a refusal that states the numbers."""
import pytest

import moejax
from moejax.offload.memory_budget import RESERVE_FRACTION, MemoryBudgetError
from moejax.placements.budget import budget_memory

GiB = 2**30
# a model of 48 MoE layers x 128 experts of 9 MiB (Qwen3-30B-A3B in bf16) + 3 GiB of other weights
EXPERT, E, L, K = 9 * 2**20, 128, 48, 8
TOTAL = 3 * GiB + EXPERT * E * L


def plan(budget_gb, **kw):
    return budget_memory(total_bytes=TOTAL, expert_bytes=EXPERT, experts_per_layer=E, moe_layers=L, top_k=K,
                         budget_bytes=None if budget_gb is None else int(budget_gb * GiB), **kw)


def test_a_model_that_fits_stays_resident():
    p = plan(80)
    assert p.placement == "resident" and p.device_bytes == TOTAL
    assert plan(None).placement == "resident"


def test_auto_streams_with_the_window_that_fits():
    p = plan(10)
    free = 10 * GiB * (1 - RESERVE_FRACTION) - 3 * GiB
    assert p.placement == "streamed" and p.window == 2  # the default window, 4 would fit
    assert (p.window + 1) * EXPERT * E <= free
    assert p.device_bytes <= 10 * GiB
    assert plan(10, window=4).window == 4
    with pytest.raises(MemoryBudgetError, match=r"window 6 needs 7 layers of experts = 7.88 GiB .*\(window 4 at most"):
        plan(10, window=6)


def test_auto_falls_back_to_a_cache_when_two_layers_do_not_fit():
    p = plan(5)  # 5 - 0.5 reserve - 3 resident = 1.5 GiB free < 2 layers (2.25 GiB)
    assert p.placement == "cached"
    assert (p.cache_slots + p.pass_experts) * EXPERT <= 1.5 * GiB
    assert p.cache_slots == int(1.5 * GiB) // EXPERT - p.pass_experts


def test_refusals_state_the_numbers():
    with pytest.raises(MemoryBudgetError, match=r"\(3.00 GiB\) plus the reserve \(307.2 MiB\) exceed the budget of "
                                              r"3.00 GiB"):
        plan(3)
    with pytest.raises(MemoryBudgetError, match=r"all routed experts need 54.00 GiB but budget 10.00 GiB"):
        plan(10, placement="resident")
    with pytest.raises(MemoryBudgetError, match=r"streamed placement needs 2 layers of experts \(2.25 GiB\)"):
        plan(5, placement="streamed")
    with pytest.raises(MemoryBudgetError, match=r"cached placement with 4 slots .* at least top-k = 8"):
        plan(5, placement="cached", cache_slots=4)
    with pytest.raises(MemoryBudgetError, match=r"at most 154 slots"):
        plan(5, placement="cached", cache_slots=1000)



def test_more_slots_than_routed_experts_give_every_expert_one():
    """Under a budget and without one alike (a GPU ran the cached placement of a 24-expert fixture with 64 slots
    asked and refused it, while the CPU, with no cap, took it)."""
    for budget in (None, 80):
        p = plan(budget, placement="cached", cache_slots=10 * E * L)
        assert p.cache_slots == E * L, budget
        assert f"{10 * E * L} slots asked, but the model has {E * L} routed experts" in p.reason

def test_load_plans_from_abstract_shapes_without_allocating():
    # the real Qwen3-30B-A3B shapes; nothing is materialized until the engine runs
    assert moejax.load("qwen3-30b-a3b", device_memory_gb=80).memory_budget.placement == "resident"
    assert moejax.load("qwen3-30b-a3b", device_memory_gb=16).memory_budget.placement == "streamed"
    cached = moejax.load("qwen3-30b-a3b", device_memory_gb=16, placement="cached").memory_budget
    assert cached.placement == "cached" and cached.cache_slots > 1000
    with pytest.raises(ValueError, match=r"moejax.load: cannot fit: the weights that always stay on the device"):
        moejax.load("qwen3-30b-a3b", device_memory_gb=2)


def test_a_streamed_prefill_keeps_three_layers_of_experts_beside_the_slots():
    cache, stream = plan(10, placement="cached"), plan(10, placement="cached", prefill_stream=True)
    assert stream.cache_slots == cache.cache_slots + cache.pass_experts - 3 * E  # the slots give way
    assert stream.device_bytes <= 10 * GiB * (1 - RESERVE_FRACTION)
    assert "prefill streams whole layers" in stream.describe()
    with pytest.raises(MemoryBudgetError, match=r"\+ 384 for a streamed prefill"):
        plan(10, placement="cached", prefill_stream=True, cache_slots=cache.cache_slots)
