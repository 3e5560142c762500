"""Deep fixtures (tests/fixtures_deep, written by `tests/make_fixtures.py --deep` with transformers): one per family,
with runs of unlike layers. A resident model runs each run of like layers as one scan over stacked weights
(moejax.models.layer_runs); here against transformers, and the programs against depth."""
import os

import jax
import numpy as np
import pytest
from conftest import fast_tier
from flax import nnx
from scheduling import run_scheduler

import moejax
from moejax import compiles

DEEP_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures_deep")
DEEP = sorted(d for d in os.listdir(DEEP_DIR) if os.path.isfile(os.path.join(DEEP_DIR, d, "config.json")))
# what each deep fixture's layers are (tests/make_fixtures.py DEEP): (first, period, count) per run
RUNS = {"qwen3_moe": [(0, 1, 1), (1, 1, 3), (4, 1, 1), (5, 1, 4)],
        "qwen2_moe": [(0, 1, 3), (3, 1, 1), (4, 1, 3)],
        "mixtral": [(0, 1, 6)],
        "deepseek_v2_lite": [(0, 1, 2), (2, 1, 4)],
        "deepseek_v3": [(0, 1, 2), (2, 1, 4)],
        "gpt_oss": [(0, 2, 3), (6, 1, 1)]}


def deep_reference(name: str) -> dict:
    with np.load(os.path.join(DEEP_DIR, name, "reference.npz")) as z:
        return {k: z[k] for k in z.files}


def test_every_family_has_a_deep_fixture():
    assert set(DEEP) == set(RUNS)


@pytest.mark.parametrize("name", fast_tier(DEEP, lambda n: n in ("qwen3_moe", "gpt_oss")))
def test_deep_model_runs_its_runs_and_matches_transformers(name):
    ref = deep_reference(name)
    engine = moejax.load(os.path.join(DEEP_DIR, name), dtype="float32")
    model = nnx.merge(engine.graphdef, engine.abstract_params)
    assert [(r.first, r.period, r.count) for r in model.layer_runs] == RUNS[name]
    out = engine.logits(ref["input_ids"])
    assert float(np.max(np.abs(out - ref["logits"])) / np.max(np.abs(ref["logits"]))) <= 1e-4
    prompts = [ref[f"prompt_{i}"].tolist() for i in range(3)]
    expected = [ref[f"greedy_{i}"].tolist() for i in range(3)]
    assert engine.generate(prompts, len(expected[0])) == expected
    got, sched = run_scheduler(engine, prompts, len(expected[0]), num_blocks=2, chunk_tokens=4, decode_steps=3)
    assert got == expected and sched.stats.preemptions > 0


def _dots(engine, ids) -> int:
    """Matrix products in the logits step's program."""
    return engine.steps.logits.lower(engine.params, ids).as_text().count("dot_general")


def test_a_steps_program_does_not_grow_with_depth():
    """tiny-qwen3-moe's layers are all alike: its logits program at full depth holds as many products as at 2."""
    ids = np.zeros((1, 8), np.int32)
    deep = moejax.load("tiny-qwen3-moe", dtype="float32")
    shallow = moejax.load("tiny-qwen3-moe", dtype="float32", num_layers=2)
    assert deep.config.num_layers > 2
    assert _dots(deep, ids) == _dots(shallow, ids)


def test_layer_by_layer_compiles_one_program_per_kind_of_layer():
    """The streamed placement runs each layer from Python: like layers share their programs (the deep qwen3 fixture
    has 2 dense and 7 MoE layers: two kinds)."""
    ref = deep_reference("qwen3_moe")
    engine = moejax.load(os.path.join(DEEP_DIR, "qwen3_moe"), dtype="float32", placement="streamed")
    jax.clear_caches()
    with compiles.counting() as counted:
        out = engine.logits(ref["input_ids"])
    assert float(np.max(np.abs(out - ref["logits"])) / np.max(np.abs(ref["logits"]))) <= 1e-4
    per_layer = {name: n for name, n in counted.programs.items() if "attend" in name or "layer" in name.lower()}
    assert per_layer and max(per_layer.values()) <= 2, counted.programs
