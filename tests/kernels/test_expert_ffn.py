"""Every CPU expert FFN backend against a float64 numpy loop over (token, expert) pairs. The Pallas interpreter
fills kernel outputs with NaN first, so a row the kernels never write shows up as NaN here."""
import jax
import numpy as np
import pytest
from conftest import fast_tier
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moejax.kernels import EXPERT_BACKENDS, expert_ffn
from moejax.kernels.platform import on_gpu

# Compiled Pallas: GPU only. Mosaic GPU takes 16-bit operands only: tests/kernels/test_grouped_matmul_mosaic.py.
# ragged_dot_cudnn on a GPU: a few fixed cases in tests/kernels/test_grouped_matmul_masked.py (each shape is a cuDNN
# graph to build), not the generated ones here.
BACKENDS = [b for b in EXPERT_BACKENDS if b != "mosaic" and (b != "pallas" or on_gpu())
            and (b != "ragged_dot_cudnn" or not on_gpu())]


def reference(x, idx, w, wgu, wd, bgu, bd, act, limit, alpha):
    x, wgu, wd = (a.astype(np.float64) for a in (x, wgu, wd))
    out = np.zeros_like(x)
    for n in range(x.shape[0]):
        for j, e in enumerate(idx[n]):
            h = x[n] @ wgu[e] + (0 if bgu is None else bgu[e])
            g, u = np.split(h, 2)
            if act == "silu":
                a = g / (1 + np.exp(-g)) * u
            else:
                g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
                a = g / (1 + np.exp(-alpha * g)) * (u + 1)
            out[n] += w[n, j] * (a @ wd[e] + (0 if bd is None else bd[e]))
    return out


@st.composite
def problems(draw):
    E = draw(st.integers(1, 9))
    k = draw(st.integers(1, min(E, 3)))
    N = draw(st.integers(1, 40))
    D, I = draw(st.sampled_from([4, 8, 12])), draw(st.sampled_from([4, 6, 16]))
    skew = draw(st.sampled_from(["uniform", "one_expert_gets_all", "some_empty"]))
    seed = draw(st.integers(0, 2**31 - 1))
    return E, k, N, D, I, skew, seed, draw(st.booleans()), draw(st.sampled_from(["silu", "swiglu_clamp"]))


def make(E, k, N, D, I, skew, seed, bias):
    rng = np.random.default_rng(seed)
    if skew == "uniform":
        idx = np.stack([rng.choice(E, k, replace=False) for _ in range(N)])
    else:
        allowed = [0] if skew == "one_expert_gets_all" else list(range(0, E, 2))
        pool = allowed + [e for e in range(E) if e not in allowed]
        idx = np.stack([pool[:k] if len(allowed) < k else rng.choice(allowed, k, replace=False) for _ in range(N)])
    w = rng.random((N, k)).astype(np.float32)
    x = rng.standard_normal((N, D)).astype(np.float32)
    wgu = (rng.standard_normal((E, D, 2 * I)) / np.sqrt(D)).astype(np.float32)
    wd = (rng.standard_normal((E, I, D)) / np.sqrt(I)).astype(np.float32)
    bgu = rng.standard_normal((E, 2 * I)).astype(np.float32) if bias else None
    bd = rng.standard_normal((E, D)).astype(np.float32) if bias else None
    return x, idx.astype(np.int32), w, wgu, wd, bgu, bd


@pytest.mark.parametrize("backend", fast_tier(BACKENDS, lambda b: b != "pallas_interpret"))  # interpreted: slow
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_float32_paths_match_float64_reference(backend, problem):
    E, k, N, D, I, skew, seed, bias, act = problem
    args = make(E, k, N, D, I, skew, seed, bias)
    ref = reference(*args, act, 0.7, 1.702)
    out = np.asarray(jax.jit(lambda *a: expert_ffn(*a, act=act, limit=0.7, backend=backend))(*args))
    assert np.linalg.norm(out - ref) <= 1e-5 * max(np.linalg.norm(ref), 1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bfloat16_inputs_accumulate_in_float32(backend):
    import ml_dtypes
    x, idx, w, wgu, wd, _, _ = make(8, 2, 33, 16, 8, "uniform", 0, False)
    ref = reference(x, idx, w, wgu, wd, None, None, "silu", 7.0, 1.702)
    bf = [a.astype(ml_dtypes.bfloat16) for a in (x, wgu, wd)]  # plain numpy inputs are accepted
    out = np.asarray(expert_ffn(bf[0], idx, w, bf[1], bf[2], backend=backend)).astype(np.float32)
    assert out.dtype == np.float32 and np.linalg.norm(out - ref) <= 2e-2 * np.linalg.norm(ref)


def test_unknown_backend_is_an_error():
    x, idx, w, wgu, wd, _, _ = make(2, 1, 3, 4, 4, "uniform", 0, False)
    with pytest.raises(ValueError, match="expert_ffn: backend 'fast'"):
        expert_ffn(x, idx, w, wgu, wd, backend="fast")


@pytest.mark.parametrize("E,k,N,skew,tier", [(8, 2, 32, "uniform", 0),  # the smallest slots
                                             (8, 2, 32, "some_empty", 1),  # the middle slots
                                             (8, 2, 32, "one_expert_gets_all", 2),  # the largest slots (N)
                                             (8, 2, 32, "repeated", 3),  # an expert named twice by a token: loop
                                             (2, 1, 3 * 32, "uniform", None)])  # over 32 rows per expert: the loop
def test_xla_slots_of_each_size_and_loop(E, k, N, skew, tier):
    from moejax.kernels.expert_ffn import grouped
    assert (N * k <= grouped.CAPACITY_MAX_MEAN_ROWS * E) == (tier is not None)
    args = make(E, k, N, 8, 6, "uniform" if skew == "repeated" else skew, 1, True)
    if skew == "repeated":  # the cached placement's stand-ins for absent experts: expert 0 with weight 0
        args[1][:, :] = 0
        args[2][:, 1] = 0.0
    if tier is not None:  # the case takes the path it is named for
        busiest = np.bincount(args[1].ravel(), minlength=E).max()
        assert sum(busiest > C for C in grouped.slot_sizes(N, k, E)) == tier
    ref = reference(*args, "silu", 7.0, 1.702)
    out = np.asarray(jax.jit(lambda *a: expert_ffn(*a, backend="xla"))(*args))
    assert np.linalg.norm(out - ref) <= 1e-5 * np.linalg.norm(ref)


@pytest.mark.parametrize("tile", [3])
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_tiled_with_experts_spanning_several_tiles(tile, problem):
    """Small tiles: an expert's rows fill several tiles, the last one padded; empty experts own no tile."""
    from moejax.kernels.expert_ffn.tiled import tiled
    E, k, N, D, I, skew, seed, bias, act = problem
    x, idx, w, wgu, wd, bgu, bd = make(E, k, N, D, I, skew, seed, bias)
    ref = reference(x, idx, w, wgu, wd, bgu, bd, act, 0.7, 1.702)
    out = np.asarray(jax.jit(lambda *a: tiled(*a, act, 0.7, 1.702, tile=tile))(x, idx, w, wgu, wd, bgu, bd))
    assert np.linalg.norm(out - ref) <= 1e-5 * max(np.linalg.norm(ref), 1e-6)


def test_tiled_gradients_equal_the_dense_backends():
    """Training differentiates the experts through `tiled`: its gradients for x, routing weights and expert
    weights are those of `dense`, which computes every expert and masks."""
    x, idx, w, wgu, wd, bgu, bd = make(6, 2, 29, 8, 6, "some_empty", 3, True)

    def grads(backend):
        loss = lambda *a: jax.numpy.sum(jax.numpy.sin(expert_ffn(a[0], idx, *a[1:], backend=backend)))  # noqa: E731
        return jax.jit(jax.grad(loss, argnums=range(6)))(x, w, wgu, wd, bgu, bd)

    for got, want in zip(grads("tiled"), grads("dense"), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(on_gpu(), reason="what auto means on a CPU")
def test_cpu_auto_runs_a_few_tokens_dense():
    """A decode-sized batch runs dense on a CPU (it compiles in half the time at equal run time), with the
    reference's result also where a token names an expert twice (the cached placement's stand-ins); larger
    batches, and experts far more than top-k, take the XLA path."""
    from moejax.kernels.grouped_matmul.auto import CPU_DENSE_MAX_RATIO, CPU_DENSE_MAX_TOKENS, expert_auto
    f32 = np.float32
    assert expert_auto(CPU_DENSE_MAX_TOKENS * 2, 16, f32, True, top_k=2) == "dense"
    assert expert_auto((CPU_DENSE_MAX_TOKENS + 1) * 2, 16, f32, True, top_k=2) == "xla"
    assert expert_auto(8 * 8, CPU_DENSE_MAX_RATIO * 8 + 1, f32, True, top_k=8) == "xla"
    assert expert_auto(64, 16, f32, False) == "xla"  # a grouped matmul: rows, not tokens
    x, idx, w, wgu, wd, bgu, bd = make(6, 2, 20, 8, 6, "uniform", 3, True)
    idx[:, 1], w[:, 1] = idx[:, 0], 0.25  # every token names its first expert twice
    ref = reference(x, idx, w, wgu, wd, bgu, bd, "silu", 7.0, 1.702)
    out = np.asarray(jax.jit(lambda *a: expert_ffn(*a))(x, idx, w, wgu, wd, bgu, bd))
    assert np.linalg.norm(out - ref) <= 1e-5 * np.linalg.norm(ref)
