"""grouped_matmul and dispatch/combine on every CPU backend against float64 numpy, plus the Pallas GPU lowering.

The Pallas interpreter fills kernel outputs with NaN before the run, so an element the kernel never writes
fails the comparison; rows past sum(group_sizes) must come back as exact zeros on every backend."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import fast_tier
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moejax.kernels import GROUPED_MATMUL_BACKENDS, combine, dispatch, expert_ffn, gather_rows, grouped_matmul
from moejax.kernels.lowering import TRITON, cuda_module
from moejax.kernels.platform import on_gpu

# Compiled Pallas: GPU only. Mosaic GPU takes 16-bit operands only: tests/kernels/test_grouped_matmul_mosaic.py.
# ragged_dot_cudnn on a GPU: a few fixed cases in tests/kernels/test_grouped_matmul_masked.py (each shape is a cuDNN
# graph to build), not the generated ones here.
BACKENDS = [b for b in GROUPED_MATMUL_BACKENDS if b != "mosaic" and (b != "pallas" or on_gpu())
            and (b != "ragged_dot_cudnn" or not on_gpu())]


def reference(x, w, sizes):
    out, start = np.zeros((x.shape[0], w.shape[2])), 0
    for g, n in enumerate(sizes):
        out[start:start + n] = x[start:start + n].astype(np.float64) @ w[g].astype(np.float64)
        start += n
    return out


@st.composite
def problems(draw):
    G = draw(st.integers(1, 6))
    M = draw(st.integers(1, 150))
    K, N = draw(st.sampled_from([8, 20, 32, 48])), draw(st.sampled_from([8, 12, 16, 40]))
    shape = draw(st.sampled_from(["random", "one_group_has_all", "some_empty", "sum_below_m"]))
    return G, M, K, N, shape, draw(st.integers(0, 2**31 - 1))


def make(G, M, K, N, shape, seed, dtype=np.float32):
    rng = np.random.default_rng(seed)
    total = rng.integers(0, M + 1) if shape == "sum_below_m" else M
    if shape == "one_group_has_all":
        sizes = np.zeros(G, np.int32)
        sizes[rng.integers(G)] = total
    else:
        cuts = np.sort(rng.integers(0, total + 1, G - 1))
        sizes = np.diff(np.concatenate([[0], cuts, [total]])).astype(np.int32)
        if shape == "some_empty" and G > 1:
            sizes[rng.integers(G)] += sizes[0]
            sizes[0] = 0
    x = rng.standard_normal((M, K)).astype(dtype)
    w = (rng.standard_normal((G, K, N)) / np.sqrt(K)).astype(dtype)
    return x, w, sizes


@pytest.mark.parametrize("backend", fast_tier(BACKENDS, lambda b: b != "pallas_interpret"))  # interpreted: slow
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_float32_matches_float64(backend, problem):
    x, w, sizes = make(*problem)
    out = np.asarray(grouped_matmul(x, w, sizes, backend=backend))
    ref = reference(x, w, sizes)
    assert out.shape == ref.shape and out.dtype == np.float32
    np.testing.assert_array_equal(out[sizes.sum():], 0.0)  # rows of no group
    assert np.linalg.norm(out - ref) <= 1e-5 * max(np.linalg.norm(ref), 1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bfloat16_accumulates_in_float32(backend):
    x, w, sizes = make(5, 300, 64, 48, "some_empty", 3)
    bf = [a.astype(ml_dtypes.bfloat16) for a in (x, w)]
    out = np.asarray(grouped_matmul(bf[0], bf[1], sizes, backend=backend))
    ref = reference(bf[0].astype(np.float32), bf[1].astype(np.float32), sizes)
    assert out.dtype == ml_dtypes.bfloat16
    assert np.linalg.norm(out.astype(np.float32) - ref) <= 1e-2 * np.linalg.norm(ref)


def test_bad_shapes_and_backend_are_errors():
    x, w, sizes = make(2, 4, 8, 8, "random", 0)
    with pytest.raises(ValueError, match=r"need x \[M, K\].*x \(4, 8\), w \(2, 9, 8\)"):
        grouped_matmul(x, np.zeros((2, 9, 8), np.float32), sizes)
    with pytest.raises(ValueError, match="grouped_matmul: backend 'cuda'"):
        grouped_matmul(x, w, sizes, backend="cuda")


@settings(max_examples=10, deadline=None)
@given(st.integers(1, 40), st.integers(1, 9), st.data())
def test_dispatch_then_combine_is_the_weighted_sum(N, E, data):
    k = data.draw(st.integers(1, min(E, 4)))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1)))
    idx = np.stack([rng.choice(E, k, replace=False) for _ in range(N)]).astype(np.int32)
    x, w = rng.standard_normal((N, 6)).astype(np.float32), rng.random((N, k)).astype(np.float32)
    r = dispatch(idx, E)
    rows = np.asarray(gather_rows(x, r, k))
    experts = np.asarray(r.expert_of_row)
    np.testing.assert_array_equal(np.asarray(r.group_sizes), np.bincount(idx.ravel(), minlength=E))
    assert (np.diff(experts) >= 0).all()  # sorted by expert
    scaled = rows * (experts[:, None] + 1.0)  # a per-expert function of each row
    expected = sum(w[:, j, None] * x * (idx[:, j, None] + 1.0) for j in range(k))
    np.testing.assert_allclose(np.asarray(combine(scaled, r, w)), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows,hidden,width,experts", [(8192 * 8, 2048, 768, 128), (8, 2880, 2880, 32)])
def test_pallas_kernels_lower_for_gpu(rows, hidden, width, experts):
    """The Triton lowering runs on CPU: block shapes, loads/stores and dots must be legal for it (compiling
    the Triton IR to PTX needs a GPU)."""
    gemm, ffn = lowered_for_gpu("pallas", rows, hidden, width, experts, 8 if rows > 8 else 4)
    assert gemm.count(TRITON) == 1
    assert ffn.count(TRITON) == 2  # gate/up with the activation fused, then down


def lowered_for_gpu(backend: str, rows: int, hidden: int, width: int, experts: int, k: int) -> tuple[str, str]:
    """The CUDA modules (bfloat16) of grouped_matmul over `rows` rows and of the expert FFN (GPT-OSS's clamped
    SwiGLU, biases) over rows // k tokens routed to k experts, on `backend`."""
    S, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    gemm = cuda_module(lambda x, w, g: grouped_matmul(x, w, g, backend=backend),
                       S((rows, hidden), bf), S((experts, hidden, width), bf), S((experts,), jnp.int32))
    N = rows // k
    ffn = cuda_module(
        lambda x, i, wt, a, b, ba, bb: expert_ffn(x, i, wt, a, b, ba, bb, act="swiglu_clamp", backend=backend),
        S((N, hidden), bf), S((N, k), jnp.int32), S((N, k), jnp.float32), S((experts, hidden, 2 * width), bf),
        S((experts, width, hidden), bf), S((experts, 2 * width), bf), S((experts, hidden), bf))
    return gemm, ffn
