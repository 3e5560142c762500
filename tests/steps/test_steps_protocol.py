"""One steps interface (moejax.steps.protocol.Steps): mypy checks each implementation against it (they subclass it,
tests/test_types.py); here every placement's steps object is a Steps at run time and runs its logits step as the
one-device float32 engine does, and the Engine reaches the steps only through the protocol."""
import ast
import inspect
import os

import pytest
from workers import run_workers

from moejax import placements
from moejax.lightning.cgopipe_steps import LightningSteps
from moejax.offload.layered_steps import LayeredSteps
from moejax.sharding.dep import DisaggregatedSteps
from moejax.sharding.pipeline_steps import PipelineSteps
from moejax.steps import Steps
from moejax.steps.whole_model import WholeModelSteps

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
IMPLEMENTATIONS = [WholeModelSteps, LayeredSteps, DisaggregatedSteps, LightningSteps, PipelineSteps]


@pytest.mark.parametrize("cls", IMPLEMENTATIONS, ids=lambda c: c.__name__)
def test_each_implementation_defines_every_protocol_method(cls):
    protocol = {name for name, member in vars(Steps).items() if inspect.isfunction(member)}
    assert protocol >= {"logits", "score", "greedy_score", "prefill", "decode", "chunk", "paged_decode"}
    assert issubclass(cls, Steps)  # mypy checks each method's signature against the protocol's
    # a method, or (the jitted or stage-program steps) an attribute set in __init__: never the protocol's empty body
    inherited = [n for n in protocol if getattr(cls, n, None) is vars(Steps)[n]
                 and n not in getattr(cls, "__annotations__", {})]
    assert not inherited, f"{cls.__name__} does not implement {inherited}"


def test_the_engine_calls_the_steps_only_through_the_protocol():
    """No isinstance / hasattr / getattr on the steps in the Engine or the schedulers: what differs is a method."""
    found = []
    for path in ["moejax/engine.py", *(os.path.join("moejax/sched", f) for f in os.listdir(os.path.join(ROOT,
                                                                                                      "moejax/sched")))]:
        if not path.endswith(".py"):
            continue
        with open(os.path.join(ROOT, path)) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                    node.func.id in ("isinstance", "hasattr", "getattr") and node.args and \
                    "steps" in ast.unparse(node.args[0]):
                found.append(f"{path}:{node.lineno} {ast.unparse(node)}")
    assert not found, found


@pytest.mark.slow  # a process with 8 simulated devices loads the fixture once per placement (about 60 s)
def test_every_placements_steps_are_steps_at_run_time():
    (out,) = run_workers("steps_protocol_worker.py", [[]], devices=8, timeout=900)
    assert set(out) == {cls.__name__ for cls in placements.PLACEMENTS}  # the worker loads every placement
    for name, result in out.items():
        assert result["is_steps"], (name, result)
        assert result["rel"] < 1e-5, (name, result)
