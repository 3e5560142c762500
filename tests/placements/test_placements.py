"""One Placement interface: moejax.load picks one class per engine, a new placement is one class listed in
PLACEMENTS, and nothing outside the placements and the memory budgeting compares placement names."""
import ast
import os

import numpy as np
import pytest

import moejax
from moejax import placements
from moejax.placements import Cached, Placement, Resident, Streamed, StreamedInJit

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# where a placement's name may be compared: the classes themselves, and the memory budgeting that names the placement
# a budget allows (moejax.offload.memory_budget) and predicts its step time (moejax.plan.placement)
OWNERS = ("moejax/placements/", "moejax/offload/memory_budget.py", "moejax/offload/settings.py",
          "moejax/plan/placement.py")
NAMES = {"resident", "streamed", "cached", "dep", "async_ep+streamed"}


@pytest.mark.parametrize("options, cls", [
    (dict(), Resident),
    (dict(placement="streamed", window=1), Streamed),
    (dict(placement="streamed", stream="jit"), StreamedInJit),
    (dict(placement="cached", cache_slots=8), Cached),
])
def test_load_picks_one_placement_class(options, cls):
    engine = moejax.load("tiny-qwen3-moe", **options)
    assert type(engine.placement) is cls
    assert engine.layer_by_layer == cls.layer_by_layer
    assert engine.stats()["placement"] == cls.name


def _compares_a_placement_name(node) -> bool:
    if not isinstance(node, ast.Compare):
        return False
    sides = [node.left, *node.comparators]
    named = any(isinstance(s, ast.Constant) and s.value in NAMES for s in sides)
    return named and any(isinstance(s, ast.Attribute) and s.attr == "placement" for s in sides)


def test_no_placement_name_is_compared_outside_the_placements():
    found = []
    for package in ("moejax", "launch"):
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for f in files:
                path = os.path.relpath(os.path.join(folder, f), ROOT)
                if not f.endswith(".py") or path.startswith(OWNERS):
                    continue
                with open(os.path.join(ROOT, path)) as source:
                    tree = ast.parse(source.read())
                found += [f"{path}:{n.lineno}" for n in ast.walk(tree) if _compares_a_placement_name(n)]
    assert not found, f"placement names compared outside moejax.placements: {found}"


class CountingResident(Resident):
    """A new placement: resident on one device, counting the tensors it places."""
    name = "counting"

    @classmethod
    def applies(cls, memory_budget, settings, layout_setup) -> bool:
        return layout_setup is None and not memory_budget.offloads

    def __init__(self, memory_budget, layout_setup=None):
        super().__init__(memory_budget, layout_setup)
        self.placed = 0

    def place(self, path, array, store):
        self.placed += 1
        return super().place(path, array, store)


def test_a_new_placement_is_one_class_listed_in_placements(monkeypatch):
    monkeypatch.setattr(placements, "PLACEMENTS", (CountingResident,) + placements.PLACEMENTS)
    engine = moejax.load("tiny-qwen3-moe", dtype="float32")
    assert isinstance(engine.placement, CountingResident) and isinstance(engine.placement, Placement)
    monkeypatch.undo()
    reference = moejax.load("tiny-qwen3-moe", dtype="float32")
    ids = np.arange(1, 9, dtype=np.int32)[None]
    np.testing.assert_array_equal(engine.logits(ids), reference.logits(ids))
    assert engine.placement.placed == len(engine.param_shapes())  # every layer's every tensor, stacked or not
    assert engine.stats() == {"placement": "counting"}
