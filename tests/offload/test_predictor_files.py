"""Predictor files are checked at load against the model and against the kind their option takes: default vectors,
expert maps or an estimator made for another model's shape, or one kind given where another is expected, are one
line naming the option and the mismatch before any request (they used to fail each request, or raise KeyError)."""
import numpy as np
import pytest
from conftest import fixture_dir

import moejax
from launch.serve import main
from moejax.offload.predict import DefaultVectors
from moejax.offload.predict.expert_maps import ExpertMapStore

MODEL = fixture_dir("qwen3_moe")  # 3 layers (the middle one dense), 8 routed experts, hidden size 32
LAYERS, EXPERTS, HIDDEN, MOE_LAYERS = 3, 8, 32, 2


def vectors(path, layers=LAYERS, experts=EXPERTS, hidden=HIDDEN) -> str:
    rng = np.random.default_rng(0)
    return DefaultVectors(rng.normal(size=(layers, experts, hidden)).astype(np.float32),
                          np.ones((layers, experts), np.int64)).save(str(path))


def maps(path, moe_layers=MOE_LAYERS, experts=EXPERTS, hidden=HIDDEN) -> str:
    store = ExpertMapStore.empty(16, 1, moe_layers, experts, hidden)
    rng = np.random.default_rng(1)
    store.add_batch(rng.normal(size=(3, hidden)).astype(np.float32),
                    rng.dirichlet(np.ones(experts), (3, moe_layers)).astype(np.float32))
    return store.save(str(path))


def load(**options):
    return moejax.load(MODEL, dtype="float32", placement="cached", cache_slots=2 * EXPERTS, **options)


def test_files_made_for_this_model_load(tmp_path):
    assert load(predictor="router", default_vectors=vectors(tmp_path / "v")).placement.name == "cached"
    assert load(predictor="expert_map", maps=maps(tmp_path / "m")).placement.name == "cached"


@pytest.mark.parametrize("made, message", [
    (dict(layers=4), r"default_vectors \(--default-vectors\): made for another model: layers 4 \(the model has 3\)"),
    (dict(experts=6, hidden=16), r"routed experts 6 \(the model has 8\), hidden size 16 \(the model has 32\)"),
])
def test_default_vectors_of_another_model_are_refused_at_load(tmp_path, made, message):
    with pytest.raises(ValueError, match=message):
        load(predictor="router", default_vectors=vectors(tmp_path / "v", **made))


def test_expert_maps_of_another_model_are_refused_at_load(tmp_path):
    with pytest.raises(ValueError, match=r"maps \(--maps\): made for another model: MoE layers 3 \(the model has 2\)"):
        load(predictor="expert_map", maps=maps(tmp_path / "m", moe_layers=3))


def test_swapped_files_name_what_they_hold(tmp_path):
    v, m = vectors(tmp_path / "v"), maps(tmp_path / "m")
    with pytest.raises(ValueError, match=r"default_vectors \(--default-vectors\) .*: holds expert maps \(the "
                                         r"directory maps \(--maps\) takes\), not default vectors"):
        load(predictor="router", default_vectors=m)
    with pytest.raises(ValueError, match=r"maps \(--maps\) .*: holds default vectors .*, not expert maps"):
        load(predictor="expert_map", maps=v)
    with pytest.raises(ValueError, match=r"estimator \(--estimator\) .*: holds default vectors .*, not an estimator"):
        load(predictor="estimator", estimator=v)


def test_serve_refuses_them_in_one_line_before_any_request(tmp_path):
    (tmp_path / "in.jsonl").write_text('{"custom_id": "c", "url": "/v1/completions", "body": {"prompt": [1, 2], '
                                       '"max_tokens": 2}}\n')
    with pytest.raises(SystemExit, match=r"^[^\n]*made for another model: layers 4 \(the model has 3\)[^\n]*$"):
        main(["--model", MODEL, "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl"),
              "--placement", "cached", "--cache-slots", "16", "--predictor", "router",
              "--default-vectors", vectors(tmp_path / "v", layers=4)])
    assert not (tmp_path / "out.jsonl").exists()
