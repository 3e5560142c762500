"""The shipped model (moejax/assets/pycode-moe): loaded by name, it gives transformers' logits and
its tokenizer gives AutoTokenizer's ids (references made by tests/make_fixtures.py --embedded)."""
import os

import numpy as np
import pytest

import moejax
from moejax.presets import DEFAULT_MODEL, embedded_dir

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REFERENCE = os.path.join(TESTS, "fixtures", "pycode_moe_reference.npz")
MAX_BYTES = 32 * 2 ** 20


@pytest.fixture(scope="module")
def reference():
    return np.load(REFERENCE)


@pytest.fixture(scope="module")
def engine():
    return moejax.load("pycode-moe", dtype="float32")  # bfloat16 weights, computed in float32 as the reference


def test_is_the_default_shipped_in_the_package_within_its_size():
    path = embedded_dir("pycode-moe")
    assert DEFAULT_MODEL == "pycode-moe" and "pycode-moe" in moejax.presets()
    names = sorted(os.listdir(path))
    assert names == ["README.md", "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json"]
    assert sum(os.path.getsize(os.path.join(path, n)) for n in names) <= MAX_BYTES
    assert moejax.load("pycode-moe").dtype.name == "bfloat16"  # the checkpoint's own dtype
    card = open(os.path.join(path, "README.md")).read()
    assert "perplexity" in card and "bigram" in card and "Expert load" in card


def test_logits_match_transformers(engine, reference):
    for i, prompt in enumerate(reference["prompts"]):
        ids = engine.tokenizer.encode(str(prompt)).ids
        assert ids == reference[f"ids_{i}"].tolist(), prompt
        want = reference[f"logits_{i}"]
        got = engine.logits([ids])[0, -len(want):]
        np.testing.assert_allclose(got, want, atol=2e-4, rtol=0)
        assert (got.argmax(-1) == want.argmax(-1)).all()


def test_tokenizer_matches_autotokenizer_and_round_trips(engine, reference):
    for j, text in enumerate(reference["tokenizer_strings"]):
        text = str(text)
        ids = engine.tokenizer.encode(text).ids
        assert ids == reference[f"tokenizer_ids_{j}"].tolist(), repr(text)
        assert engine.tokenizer.decode(ids, skip_special_tokens=False) == text
