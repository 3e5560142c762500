"""Engine behaviour beyond parity: bucketing, batching, stopping, sampling, presets, input errors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import moejax
from moejax.sampling import sample


@pytest.fixture(scope="module")
def tiny():
    return moejax.load("tiny-qwen3-moe", dtype="float32")


def test_presets_listed():
    assert {"tiny-qwen3-moe", "micro-qwen3-moe", "qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v2-lite",
            "gpt-oss-20b"} <= set(moejax.presets())


@pytest.mark.parametrize("name, billions", [("qwen3-30b-a3b", 30.5), ("mixtral-8x7b", 46.7),
                                            ("deepseek-v2-lite", 15.7), ("gpt-oss-20b", 20.9)])
def test_full_presets_are_abstract_until_used(name, billions):
    engine = moejax.load(name)
    assert engine._state is None  # nothing allocated
    params = engine.param_bytes() / 2  # bfloat16
    assert params == pytest.approx(billions * 1e9, rel=0.02)


@pytest.mark.slow  # a real-shaped preset's layers: over a minute on 2 cores
def test_real_shaped_preset_slice_runs():
    engine = moejax.load("deepseek-v2-lite", num_layers=1)  # real widths, one layer (~1 GB in bfloat16)
    assert engine.config.num_layers == 1 and engine.config.vocab_size == 102400
    out = engine.logits(np.array([[1, 2, 3]]))
    assert out.shape == (1, 3, 102400) and np.isfinite(out).all()


def test_preset_weights_are_deterministic(tiny):
    ids = np.array([[5, 6, 7]])
    np.testing.assert_array_equal(tiny.logits(ids), moejax.load("tiny-qwen3-moe", dtype="float32").logits(ids))


def test_routers_stay_float32_in_bfloat16_models():
    engine = moejax.load("tiny-qwen3-moe")
    shapes = engine.param_shapes()
    assert shapes[("layers", 0, "mlp", "router")].dtype == jnp.float32
    assert shapes[("layers", 0, "mlp", "we_gate_up")].dtype == jnp.bfloat16
    stacked = {path[-1]: a.get_value().dtype for path, a in nnx.to_flat_state(engine.abstract_params)
               if path[-1] in ("router", "we_gate_up")}  # what the model holds: the runs' stacks
    assert stacked == {"router": jnp.float32, "we_gate_up": jnp.bfloat16}


def test_seed_changes_preset_weights(tiny):
    ids = np.array([[5, 6, 7]])
    other = moejax.load("tiny-qwen3-moe", dtype="float32", seed=1)
    assert not np.allclose(tiny.logits(ids), other.logits(ids))


def test_logits_do_not_recompile_within_a_bucket(tiny):
    tiny.logits(np.ones((1, 5), np.int32))
    before = tiny.steps.logits._cache_size()
    tiny.logits(np.ones((1, 9), np.int32))
    tiny.logits(np.ones((1, 16), np.int32))
    assert tiny.steps.logits._cache_size() == before


def test_padding_does_not_change_logits(tiny):
    ids = np.random.default_rng(0).integers(0, 1024, (3, 11))
    full = tiny.logits(ids)
    np.testing.assert_allclose(tiny.logits(ids[:1, :7]), full[:1, :7], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernels", ["experts=ragged_dot,attention=reference", "experts=dense", "pallas_interpret"])
def test_kernel_backends_agree(tiny, kernels):
    ids = np.random.default_rng(1).integers(0, 1024, (2, 24))
    other = moejax.load("tiny-qwen3-moe", dtype="float32", kernels=kernels)
    np.testing.assert_allclose(other.logits(ids), tiny.logits(ids), rtol=1e-5, atol=1e-5)


def test_batched_generate_equals_one_by_one(tiny):
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 1024, n).tolist() for n in (3, 17, 8)]
    batched = tiny.generate(prompts, 6)
    assert [len(x) for x in batched] == [6, 6, 6]
    assert batched == [tiny.generate([p], 6)[0] for p in prompts]


def test_generate_matches_argmax_of_logits(tiny):
    prompt = [4, 8, 15, 16, 23, 42]
    out = tiny.generate([prompt], 4)[0]
    seq = list(prompt)
    for _ in range(4):
        seq.append(int(tiny.logits(np.array([seq]))[0, -1].argmax()))
    assert out == seq[len(prompt):]


def test_stop_tokens_end_a_sequence_inclusively(tiny):
    prompts = [[1, 2, 3], [9, 9]]
    free = tiny.generate(prompts, 8)
    stop = free[0][2]
    cut = free[0].index(stop) + 1
    out = tiny.generate(prompts, 8, stop_token_ids=[stop])
    assert out[0] == free[0][:cut]
    expect_1 = free[1][: free[1].index(stop) + 1] if stop in free[1] else free[1]
    assert out[1] == expect_1


def test_sampling_is_seeded(tiny):
    prompts = [[1, 2, 3], [7]]
    a = tiny.generate(prompts, 8, temperature=1.0, seed=11)
    assert a == tiny.generate(prompts, 8, temperature=1.0, seed=11)
    assert a != tiny.generate(prompts, 8, temperature=1.0, seed=12)


def test_tiny_top_p_is_greedy(tiny):
    prompts = [[1, 2, 3]]
    assert tiny.generate(prompts, 5, temperature=0.7, top_p=1e-6, seed=5) == tiny.generate(prompts, 5)


def test_top_p_keeps_only_the_nucleus():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.2]] * 400))
    keys = jax.random.split(jax.random.key(0), 400)
    draws = np.asarray(sample(logits, jnp.ones(400), jnp.full(400, 0.6), keys))
    assert set(draws.tolist()) == {0, 1}
    draws = np.asarray(sample(logits, jnp.ones(400), jnp.ones(400), keys))
    assert set(draws.tolist()) == {0, 1, 2}
    assert abs((draws == 0).mean() - 0.5) < 0.1


def test_bad_inputs_are_clear_errors(tiny):
    with pytest.raises(ValueError, match="shape \\(B, T\\)"):
        tiny.logits(np.ones(4, np.int32))
    with pytest.raises(ValueError, match="token id 5000 is outside the vocabulary \\[0, 1024\\)"):
        tiny.logits(np.array([[1, 5000]]))
    with pytest.raises(ValueError, match="prompts\\[1\\] is empty"):
        tiny.generate([[1], []], 2)
    with pytest.raises(ValueError, match="prompts\\[0\\]: token id -1"):
        tiny.generate([[-1]], 2)
    with pytest.raises(ValueError, match="exceed the model's context of 2048"):
        tiny.generate([[1] * 2000], 100)
    with pytest.raises(ValueError, match="max_new_tokens"):
        tiny.generate([[1]], -1)
    assert tiny.generate([[1]], 0) == [[]]


@pytest.mark.parametrize("spec,message", [
    ("experts=fast", "experts backend 'fast' is not one of auto, pallas"),
    ("dense", "attention backend 'dense' is not one of"),  # an experts-only name for every op
    ("experts=xla,mlp=xla", "unknown op\\(s\\) \\['mlp'\\]"),
])
def test_bad_kernels_spec_is_a_clear_error(spec, message):
    with pytest.raises(ValueError, match="moejax.load: kernels: " + message):
        moejax.load("tiny-qwen3-moe", kernels=spec)


def test_persistent_compilation_cache_is_enabled(tiny):
    assert jax.config.jax_compilation_cache_dir
