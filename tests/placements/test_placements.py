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
OWNER = "moejax/placements/"  # the only code that compares placement names
# the registry's names (a new placement's name is covered as soon as it is listed) and what users type
NAMES = {cls.name for cls in placements.PLACEMENTS} | {"resident", "streamed", "cached", "lightning", "dep",
                                                        "pipeline", "ep+cached", "async_ep+streamed"}
NAME_LISTS = {"OFFLOADED"}  # a list of placement names a membership test could read
OPS = (ast.Eq, ast.NotEq, ast.In, ast.NotIn)


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


def _names_a_placement(node: ast.expr) -> bool:
    """A placement's name, a literal collection holding one, or a list of them (OFFLOADED)."""
    if isinstance(node, ast.Constant):
        return node.value in NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_a_placement(e) for e in node.elts)
    return isinstance(node, ast.Name) and node.id in NAME_LISTS or \
        isinstance(node, ast.Attribute) and node.attr in NAME_LISTS


def _holds_a_placement(node: ast.expr) -> bool:
    """`x.placement` or `placement`: a placement's name (a budget's, the settings')."""
    return isinstance(node, ast.Attribute) and node.attr == "placement" or \
        isinstance(node, ast.Name) and node.id == "placement"


def _compares_a_placement_name(node: ast.AST) -> bool:
    """`budget.placement == "cached"`, `placement in ("streamed", "cached")`, `x in OFFLOADED`, `p.name ==
    "lightning"`, or `p != budget.placement` (a placement name compared with anything but a constant that names
    none, such as the option's "auto")."""
    if not isinstance(node, ast.Compare) or not all(isinstance(op, OPS) for op in node.ops):
        return False
    sides = [node.left, *node.comparators]
    if any(isinstance(s, (ast.Name, ast.Attribute)) and _names_a_placement(s) for s in node.comparators):
        return True  # x in OFFLOADED
    named = any(_names_a_placement(s) for s in sides)
    asked = any(_holds_a_placement(s) or isinstance(s, ast.Attribute) and s.attr == "name" for s in sides)
    constant = lambda s: isinstance(s, ast.Constant) or isinstance(s, ast.Name) and s.id.isupper()  # noqa: E731
    against_any = any(_holds_a_placement(s) for s in sides) and not all(
        constant(s) for s in sides if not _holds_a_placement(s))
    return (named and asked) or against_any


def placement_name_comparisons(root: str) -> list[str]:
    found = []
    for package in ("moejax", "launch"):
        for folder, _, files in os.walk(os.path.join(root, package)):
            for f in files:
                path = os.path.relpath(os.path.join(folder, f), root)
                if not f.endswith(".py") or path.startswith(OWNER):
                    continue
                with open(os.path.join(root, path)) as source:
                    tree = ast.parse(source.read())
                found += [f"{path}:{n.lineno}" for n in ast.walk(tree) if _compares_a_placement_name(n)]
    return found


def test_no_placement_name_is_compared_outside_the_placements():
    found = placement_name_comparisons(ROOT)
    assert not found, f"placement names compared outside moejax.placements: {found}"


@pytest.mark.parametrize("line", [
    'budget.placement == "cached"', '"streamed" != settings.placement', 'placement in ("streamed", "cached")',
    "memory_budget.placement in OFFLOADED", "p in OFFLOADED", 'engine.placement.name == "lightning"',
    "p != memory_budget.placement", 'x.placement not in ("auto", "cached")', "settings.placement == OFFLOADED"])
def test_the_check_sees_every_form_of_comparison(line):
    assert _compares_a_placement_name(ast.parse(line).body[0].value)


@pytest.mark.parametrize("line", ['settings.placement == "auto"', "settings.placement == AUTO",
                                  'layout.experts == "dep"', "engine.placement is None",
                                  'f.name == "window"', 'args.planner == "lightning"'])
def test_the_check_passes_what_names_no_placement(line):
    assert not _compares_a_placement_name(ast.parse(line).body[0].value)


def test_the_placement_option_names_the_placements_that_size_budgets():
    """The option is checked where the settings are built (below the placements), so it lists the names itself."""
    from moejax.offload.settings import AUTO
    from moejax.offload.settings import PLACEMENTS as CHOICES
    from moejax.placements.budget import budget_sizers
    assert sorted(CHOICES) == sorted([AUTO] + [cls.name for cls in budget_sizers()])


def test_the_registry_is_the_only_place_that_names_a_placement_class():
    """Gathered has the shape every placement may take: its file and its line in the registry, no other mention."""
    from moejax.placements.registry import REGISTRY
    assert "moejax.placements.gathered:Gathered" in REGISTRY
    mentions = []
    for folder, _, files in os.walk(os.path.join(ROOT, "moejax")):
        for f in files:
            path = os.path.join(folder, f)
            if f.endswith(".py") and not path.endswith(("placements/gathered.py", "placements/registry.py")):
                with open(path) as source:
                    tree = ast.parse(source.read())
                mentions += [f"{path}:{n.lineno}" for n in ast.walk(tree)
                             if isinstance(n, (ast.Name, ast.alias)) and getattr(n, "id", getattr(n, "name", None))
                             == "Gathered"]
    assert not mentions


def test_no_class_name_is_defined_in_two_modules():
    """One name, one class: a runtime and the placement that builds it are told apart by their names."""
    where: dict[str, list[str]] = {}
    for folder, _, files in os.walk(os.path.join(ROOT, "moejax")):
        for f in files:
            if f.endswith(".py"):
                path = os.path.relpath(os.path.join(folder, f), ROOT)
                with open(os.path.join(ROOT, path)) as source:
                    tree = ast.parse(source.read())
                for node in ast.walk(tree):
                    if isinstance(node, ast.ClassDef):
                        where.setdefault(node.name, []).append(path)
    repeated = {name: paths for name, paths in where.items() if len(set(paths)) > 1}
    assert not repeated, f"class names defined in more than one module: {repeated}"


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
