"""Every family fixture (written by tests/make_fixtures.py with transformers) against its reference."""
import numpy as np
import pytest
from conftest import FIXTURE_NAMES, fast_tier, fixture_dir, reference
from scheduling import run_scheduler

import moejax

EXPECTED = {"qwen3_moe", "qwen3_moe_nonorm", "mixtral", "qwen2_moe", "deepseek_v2_lite", "deepseek_v2_group",
            "deepseek_v3", "deepseek_v3_nonorm", "gpt_oss"}


def test_every_variant_has_a_fixture():
    assert EXPECTED <= set(FIXTURE_NAMES)


def rel_max(out, ref):
    return float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_float32_logits_match_transformers(name):
    ref = reference(name)
    engine = moejax.load(fixture_dir(name), dtype="float32")
    out = engine.logits(ref["input_ids"])
    assert out.dtype == np.float32 and out.shape == ref["logits"].shape
    assert rel_max(out, ref["logits"]) <= 1e-4


@pytest.mark.parametrize("name", fast_tier(FIXTURE_NAMES, lambda n: n == "qwen3_moe"))
def test_float32_greedy_generate_matches_transformers(name):
    ref = reference(name)
    engine = moejax.load(fixture_dir(name), dtype="float32")
    prompts = [ref[f"prompt_{i}"].tolist() for i in range(3)]
    expected = [ref[f"greedy_{i}"].tolist() for i in range(3)]
    assert engine.generate(prompts, len(expected[0])) == expected
    # Continuous batching over a pool of two blocks in 4-token chunks: sequences wait, are preempted and resume.
    out, sched = run_scheduler(engine, prompts, len(expected[0]), num_blocks=2, chunk_tokens=4, decode_steps=3)
    assert out == expected and sched.stats.preemptions > 0 and sched.stats.chunk_steps > 3


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_bfloat16_logits_within_tolerance(name):
    """bf16 tolerance, per position (error = max |out - ref| over the vocabulary / max |ref|): median <= 2% and
    at least 90% of positions <= 5%. A token whose top-k routing flips under bf16 rounding moves that one
    position much further (seen: 47% at one of 32 positions of deepseek_v3, while its neighbours stay under
    1.5%); that is inherent to MoE in bf16, also in transformers, so no single position is held to the bound."""
    ref = reference(name)
    out = moejax.load(fixture_dir(name), dtype="bfloat16").logits(ref["input_ids"])
    r = ref["logits"]
    err = np.max(np.abs(out - r), axis=-1) / np.max(np.abs(r))
    assert np.median(err) <= 0.02
    assert np.mean(err <= 0.05) >= 0.9, np.round(err, 3)


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_float16_logits_close(name):
    ref = reference(name)
    out = moejax.load(fixture_dir(name), dtype="float16").logits(ref["input_ids"])
    assert rel_max(out, ref["logits"]) <= 1e-2


@pytest.mark.parametrize("kernels", fast_tier(["pallas_interpret", "experts=ragged_dot,attention=reference"],
                                             lambda k: k != "pallas_interpret"))  # interpreted: slow
@pytest.mark.parametrize("name", fast_tier(["qwen3_moe", "deepseek_v2_lite", "deepseek_v3", "gpt_oss", "mixtral"]))
def test_kernel_backends_match_transformers(name, kernels):
    """Switching `kernels=` changes no logits beyond float32 rounding, in prefill (logits) and in cached decode
    (greedy generate reads the KV cache through the attention kernel: MLA's absorbed form, GPT-OSS's sinks and
    sliding window)."""
    ref = reference(name)
    engine = moejax.load(fixture_dir(name), dtype="float32", kernels=kernels)
    assert rel_max(engine.logits(ref["input_ids"]), ref["logits"]) <= 1e-4
    prompts = [ref[f"prompt_{i}"].tolist() for i in range(3)]
    assert engine.generate(prompts, len(ref["greedy_0"])) == [ref[f"greedy_{i}"].tolist() for i in range(3)]
