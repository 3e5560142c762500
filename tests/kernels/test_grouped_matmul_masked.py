"""The Pallas grouped GEMM on rows as they are: its tiles mask their loads and stores at the groups' edges, so the op
pads, slices and zeroes nothing around the kernel. Interpreted against float64 at the shapes where the masks
decide (empty groups, groups that end inside a tile, rows of no group, zero rows, K and N off the tile), and the
CUDA lowering of the op and of the expert FFN, whose only passes over the routed rows are the kernels and the two
gathers. Also `ragged_dot_cudnn` (XLA's cuDNN ragged-dot fusion on a GPU, plain ragged_dot elsewhere)."""
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from test_expert_ffn import make as make_ffn
from test_expert_ffn import reference as ffn_reference
from test_grouped_matmul import reference

from moejax.kernels import expert_ffn, grouped_matmul
from moejax.kernels.backends import Kernels
from moejax.kernels.expert_ffn import parts
from moejax.kernels.grouped_matmul import pallas, ragged_cudnn
from moejax.kernels.grouped_matmul.tuning import PallasConfig
from moejax.kernels.lowering import TRITON, cuda_module
from moejax.kernels.platform import on_gpu

SMALL = PallasConfig(bm=16, bn=16, bk=16, warps=4, stages=2)  # tiles smaller than the groups: several per group


def glu_reference(x, w, b, sizes):
    """The fused gate/up step in float64: silu(gate) * up of each row's group, rows of no group 0."""
    group = np.repeat(np.arange(len(sizes) + 1), np.append(sizes, x.shape[0] - sum(sizes)))
    h = reference(x, w, sizes) + np.concatenate([b, np.zeros_like(b[:1])])[group]
    gate, up = np.split(h, 2, axis=1)
    out = gate / (1 + np.exp(-gate)) * up
    out[sum(sizes):] = 0
    return out


# (rows, K, N, group sizes): each names the edge it checks
EDGES = {
    "zero_rows": (0, 32, 32, [0, 0, 0]),
    "every_group_empty": (21, 32, 32, [0, 0, 0]),  # every row is of no group: all tiles store zeros
    "empty_groups_first_middle_last": (50, 32, 48, [0, 17, 0, 33, 0]),
    "groups_end_inside_tiles": (61, 32, 32, [5, 16, 1, 39]),
    "rows_of_no_group_after_the_last": (70, 32, 32, [3, 20, 0, 18]),  # 29 rows of no group, two tiles of zeros
    "fewer_rows_than_a_tile": (7, 32, 32, [4, 3]),
    "k_and_n_off_the_tile": (45, 20, 12, [10, 0, 30]),  # K 20 and N 12 against 16-wide tiles
    "k_and_n_below_the_tile": (9, 8, 8, [9]),
}


@pytest.mark.parametrize("edge", EDGES)
def test_masked_tiles_match_float64(edge):
    """Interpreted: the interpreter fills the output with NaN first, so a row no tile stores shows up."""
    M, K, N, sizes = EDGES[edge]
    rng = np.random.default_rng(len(edge))
    sizes = np.asarray(sizes, np.int32)
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = (rng.standard_normal((len(sizes), K, 2 * N)) / np.sqrt(K)).astype(np.float32)
    b = rng.standard_normal((len(sizes), 2 * N)).astype(np.float32)

    tokens = rng.standard_normal((max(M // 3, 1), K)).astype(np.float32)  # rows read by index, some several times
    rows = rng.integers(0, tokens.shape[0], M).astype(np.int32)

    @jax.jit
    def three(x, w, b, sizes, tokens, rows):
        plain = pallas.grouped_call(x, w, None, sizes, cfg=SMALL, out_dtype=x.dtype, interpret=True)
        fused = pallas.grouped_call(x, w, b, sizes, cfg=SMALL, out_dtype=x.dtype, act="silu", interpret=True)
        gathered = pallas.grouped_call(tokens, w, b, sizes, cfg=SMALL, out_dtype=x.dtype, act="silu", interpret=True,
                                       rows=rows)
        return plain, fused, gathered

    plain, fused, gathered = (np.asarray(a) for a in three(x, w, b, sizes, tokens, rows))
    assert plain.shape == (M, 2 * N) and fused.shape == (M, N) and gathered.shape == (M, N)
    for out in (plain, fused, gathered):
        np.testing.assert_array_equal(out[sizes.sum():], 0.0)
    np.testing.assert_allclose(plain, reference(x, w, sizes), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(fused, glu_reference(x, w, b, sizes), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gathered, glu_reference(tokens[rows], w, b, sizes), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gather_in_kernel", [False, True])
def test_expert_ffn_parts_match_float64(gather_in_kernel):
    """The Pallas FFN's parts in order, with the tokens copied into expert order or gathered by the kernel."""
    x, idx, w, wgu, wd, bgu, bd = make_ffn(6, 2, 37, 12, 6, "some_empty", 4, True)
    ref = ffn_reference(x, idx, w, wgu, wd, bgu, bd, "swiglu_clamp", 0.7, 1.702)

    @jax.jit
    def run(*a):
        state = parts.start(*a)
        return parts.run(parts.pallas_parts(state, "swiglu_clamp", 0.7, 1.702, True, gather_in_kernel), state)

    out = np.asarray(run(x, idx, w, wgu, wd, bgu, bd))
    assert np.linalg.norm(out - ref) <= 1e-5 * np.linalg.norm(ref)


def test_tile_schedule_covers_every_row_once():
    """Each row is in exactly one tile of its own group (or of no group, G), whatever the sizes; at most
    cdiv(M, bm) + G tiles hold rows."""
    rng = np.random.default_rng(0)
    for M, G, bm in [(0, 3, 16), (1, 1, 16), (100, 7, 16), (129, 4, 64), (64, 64, 16)]:
        for _ in range(5):
            total = int(rng.integers(0, M + 1))
            sizes = np.diff(np.concatenate([[0], np.sort(rng.integers(0, total + 1, G - 1)), [total]]))
            tiles = pallas.max_tiles(M, G, bm)
            group, first, end = np.asarray(pallas.tile_schedule(jnp.asarray(sizes, jnp.int32), M, bm, tiles))
            owner = np.full(M, -1)
            for g, a, e in zip(group, first, end, strict=True):
                rows = np.arange(a, min(a + bm, e))
                assert (owner[rows] == -1).all()
                owner[rows] = g
            expected = np.repeat(np.arange(G + 1), np.append(sizes, M - total))
            np.testing.assert_array_equal(owner, expected)


def _ops_on(module: str, rows: int) -> list[str]:
    """The ops of a StableHLO module that take or make a floating-point array of `rows` rows, one per op."""
    ops = []
    for line in module.splitlines():
        op = re.match(r'\s*(?:%[\w#:]+ = )?"?([\w.]+)', line)
        if op and re.search(rf"tensor<{rows}x\d+x(bf16|f16|f32)>", line) and op.group(1) not in ("func.func", "return"):
            ops.append(op.group(1))
    return ops


def test_the_op_is_the_kernel_and_the_ffn_passes_are_its_gathers():
    """At qwen3-30b-a3b's expert shapes (bf16, 8K tokens, top-8): `grouped_matmul` lowers to the kernel's call
    alone (before, a pad of the rows, a slice and a select of the output surrounded it); the expert FFN's only
    ops over the 65,536 routed rows are the two kernels, the gather of the tokens into expert order and combine's
    gather back, and the down product comes out in bfloat16 (before: float32, twice the bytes, then sliced)."""
    S, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    T, k, D, I, E = 8192, 8, 2048, 768, 128
    M = T * k
    gemm = cuda_module(lambda x, w, g: grouped_matmul(x, w, g, backend="pallas"),
                       S((M, D), bf), S((E, D, 2 * I), bf), S((E,), jnp.int32))
    assert gemm.count(TRITON) == 1 and "stablehlo.pad" not in gemm
    assert _ops_on(gemm, M) == ["stablehlo.custom_call"]
    ffn = cuda_module(lambda x, i, p, a, b: expert_ffn(x, i, p, a, b, backend="pallas"),
                      S((T, D), bf), S((T, k), jnp.int32), S((T, k), jnp.float32), S((E, D, 2 * I), bf),
                      S((E, I, D), bf))
    assert ffn.count(TRITON) == 2 and "stablehlo.pad" not in ffn
    assert sorted(_ops_on(ffn, M)) == ["stablehlo.custom_call"] * 2 + ["stablehlo.gather"] * 2 + [
        "stablehlo.reshape"]  # combine's [N, k, D] view: free
    assert f"tensor<{M}x{D}xf32>" not in ffn  # the down product's rows stay bfloat16 until combine sums them

    def gathered(x, i, p, a, b):
        state = parts.start(x, i, p, a, b, None, None)
        return parts.run(parts.pallas_parts(state, "silu", 7.0, 1.702, False, gather_in_kernel=True), state)
    ffn = cuda_module(gathered, S((T, D), bf), S((T, k), jnp.int32), S((T, k), jnp.float32), S((E, D, 2 * I), bf),
                      S((E, I, D), bf))
    assert ffn.count(TRITON) == 2  # and combine's gather is the only one over the rows: the kernel gathers the tokens
    assert sorted(_ops_on(ffn, M)) == ["stablehlo.custom_call"] * 2 + ["stablehlo.gather", "stablehlo.reshape"]


needs_flag = pytest.mark.skipif(on_gpu() and not ragged_cudnn.fusion_enabled(),
                                reason=f"on a GPU ragged_dot_cudnn needs XLA_FLAGS={ragged_cudnn.ON} at start-up")


@needs_flag
@pytest.mark.parametrize("edge", ["empty_groups_first_middle_last", "rows_of_no_group_after_the_last",
                                  "k_and_n_off_the_tile"])
def test_ragged_dot_cudnn_matches_float64(edge):
    M, K, N, sizes = EDGES[edge]
    rng = np.random.default_rng(1)
    sizes = np.asarray(sizes, np.int32)
    x = rng.standard_normal((M, K)).astype(ml_dtypes.bfloat16)
    w = (rng.standard_normal((len(sizes), K, N)) / np.sqrt(K)).astype(ml_dtypes.bfloat16)
    out = np.asarray(grouped_matmul(x, w, sizes, backend="ragged_dot_cudnn")).astype(np.float32)
    ref = reference(x.astype(np.float32), w.astype(np.float32), sizes)
    np.testing.assert_array_equal(out[sizes.sum():], 0.0)
    assert np.linalg.norm(out - ref) <= 1e-2 * np.linalg.norm(ref)


@needs_flag
def test_ragged_dot_cudnn_expert_ffn_matches_float64():
    x, idx, w, wgu, wd, bgu, bd = make_ffn(6, 2, 19, 16, 8, "some_empty", 2, True)
    ref = ffn_reference(x, idx, w, wgu, wd, bgu, bd, "silu", 7.0, 1.702)
    out = np.asarray(expert_ffn(x, idx, w, wgu, wd, bgu, bd, backend="ragged_dot_cudnn"))
    assert np.linalg.norm(out - ref) <= 1e-5 * np.linalg.norm(ref)


def test_ragged_dot_cudnn_flag_is_read_as_xla_reads_it(monkeypatch):
    assert ragged_cudnn.fusion_enabled(f"--xla_foo=1 {ragged_cudnn.ON}")
    assert ragged_cudnn.fusion_enabled(ragged_cudnn.FLAG)
    assert not ragged_cudnn.fusion_enabled("")
    assert not ragged_cudnn.fusion_enabled(f"{ragged_cudnn.ON} {ragged_cudnn.FLAG}=false")  # the last one wins
    assert ragged_cudnn.with_fusion("--xla_foo=1") == f"--xla_foo=1 {ragged_cudnn.ON}"
    assert ragged_cudnn.with_fusion(ragged_cudnn.ON) == ragged_cudnn.ON
    # On a GPU without the flag it is refused before anything loads, with the flag to set
    monkeypatch.setattr(ragged_cudnn, "on_gpu", lambda: True)
    monkeypatch.setenv("XLA_FLAGS", "")
    assert ragged_cudnn.ON in Kernels.parse("experts=ragged_dot_cudnn").unavailable()
    with pytest.raises(ValueError, match="needs XLA_FLAGS=--xla_gpu_experimental_use_ragged_dot_fusion=true"):
        grouped_matmul(np.zeros((4, 8), np.float32), np.zeros((2, 8, 8), np.float32), np.array([2, 2]),
                       backend="ragged_dot_cudnn")
    monkeypatch.setenv("XLA_FLAGS", ragged_cudnn.ON)
    assert Kernels.parse("experts=ragged_dot_cudnn").unavailable() is None


def test_the_gpu_check_sets_the_flag_the_backend_reads():
    from launch import gpu_check
    assert gpu_check.RAGGED_DOT_FUSION == ragged_cudnn.ON
