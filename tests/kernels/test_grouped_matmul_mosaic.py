"""The Mosaic GPU grouped GEMM: its group-aligned layout and tuning table on any machine, its CUDA lowering on
CPU, and on a GPU its bfloat16 results against float64 (`test_compiled_*`: what the GPU check runs, first)."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_expert_ffn import make as make_ffn
from test_expert_ffn import reference as ffn_reference
from test_grouped_matmul import lowered_for_gpu, make, reference

from moejax.kernels import expert_ffn, grouped_matmul, platform
from moejax.kernels.backends import Kernels
from moejax.kernels.grouped_matmul import tuning
from moejax.kernels.grouped_matmul.aligned import aligned_layout, from_aligned, max_tiles, to_aligned
from moejax.kernels.grouped_matmul.auto import expert_auto
from moejax.kernels.grouped_matmul.mosaic_plan import MosaicConfig
from moejax.kernels.lowering import MOSAIC_GPU, cuda_module
from moejax.kernels.platform import on_gpu

gpu = pytest.mark.skipif(not on_gpu(), reason="Mosaic GPU kernels run on an NVIDIA Hopper GPU only")


@pytest.mark.slow  # 25 generated layouts (about 20 s)
@settings(max_examples=25, deadline=None)
@given(st.integers(1, 7), st.integers(1, 90), st.sampled_from([8, 16, 64]), st.integers(0, 2**31 - 1),
       st.sampled_from(["random", "one_group_has_all", "some_empty", "sum_below_m"]))
def test_aligned_layout_puts_each_tile_in_one_group_and_round_trips(G, M, bm, seed, shape):
    x, _, sizes = make(G, M, 3, 4, shape, seed)
    layout = aligned_layout(jnp.asarray(sizes), M, bm)
    assert layout.tiles == max_tiles(M, G, bm) and layout.source.shape == (layout.tiles * bm,)
    tile_group, source = np.asarray(layout.tile_group), np.asarray(layout.source)
    group_of_row = np.repeat(np.arange(G), sizes)
    used = int(np.sum(-(-sizes // bm)))
    assert (tile_group[:used] >= 0).all() and (tile_group[used:] == -1).all()
    for t in range(used):  # every real row of a tile belongs to the tile's group
        rows = source[t * bm:(t + 1) * bm]
        assert (group_of_row[rows[rows < len(group_of_row)]] == tile_group[t]).all()
    xa = np.asarray(to_aligned(jnp.asarray(x), layout))
    assert (xa[source == M] == 0).all()  # padding rows are zeros
    total = int(sizes.sum())
    np.testing.assert_array_equal(np.asarray(from_aligned(jnp.asarray(xa), layout))[:total], x[:total])


@pytest.mark.parametrize("cfg", [MosaicConfig(128, 128, 64, 4, True), MosaicConfig(64, 128, 64, 4, False, 2)])
def test_both_kernel_bodies_lower_for_gpu(cfg):
    """One warpgroup, and the warp-specialized body (a copy warpgroup and two MMA warpgroups), float32 output
    too (the expert FFN's down product: its ring gets shallower to fit shared memory)."""
    from moejax.kernels.grouped_matmul import mosaic
    S, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    for out in (bf, jnp.float32):
        module = cuda_module(lambda x, w, g, out=out: mosaic.grouped_matmul(x, w, g, cfg, out_dtype=out),
                             S((4096, 512), bf), S((16, 512, 768), bf), S((16,), jnp.int32))
        assert module.count(MOSAIC_GPU) == 1


@pytest.mark.parametrize("rows,hidden,width,experts", [(8192 * 8, 2048, 768, 128), (1000, 200, 300, 7)])
def test_mosaic_kernels_lower_for_gpu(rows, hidden, width, experts):
    """Lowering runs without a GPU: TMA block shapes, the pipeline and the MMA shapes must be legal for Mosaic GPU
    (at a model's shapes and at odd ones that need K and N padding)."""
    gemm, ffn = lowered_for_gpu("mosaic", rows, hidden, width, experts, 8 if rows > 8000 else 2)
    assert gemm.count(MOSAIC_GPU) == 1
    assert ffn.count(MOSAIC_GPU) == 2  # gate/up, then down


def test_float32_operands_are_refused_with_the_reason():
    x, w, sizes = make(3, 20, 16, 16, "random", 0)
    with pytest.raises(ValueError, match="x is float32; the Mosaic GPU kernel takes bfloat16 or float16"):
        grouped_matmul(x, w, sizes, backend="mosaic")


@pytest.mark.skipif(on_gpu(), reason="off a GPU only")
def test_mosaic_off_a_gpu_is_refused_before_loading():
    assert "experts=mosaic needs an NVIDIA GPU" in Kernels.parse("experts=mosaic").unavailable()
    assert expert_auto(4096, 8, jnp.bfloat16, fused=True) == "xla"


ENTRY = {"pallas": {"glu/64": dict(bm=64, bn=128, bk=64, warps=4, stages=4, cols_minor=True)},
         "mosaic": {"gemm/512": dict(bm=128, bn=256, bk=64, stages=3, cols_minor=False)},
         "fastest": {"glu/512": "mosaic", "glu/64": "pallas"}}


def test_tuning_table_classes_lookups_and_fallbacks():
    assert tuning.class_key("glu", 8192, 128) == "glu/64" and tuning.class_key("gemm", 10**7, 8) == "gemm/2048"
    cfg = tuning.pallas_config(8192, 128, 2048, 768, fused=True, entry=ENTRY)
    assert (cfg.bm, cfg.bn, cfg.warps, cfg.stages, cfg.cols_minor) == (64, 128, 4, 4, True)
    small = tuning.pallas_config(40, 8, 48, 96, fused=True, entry=ENTRY)  # an untuned class: today's choice
    assert small == tuning.default_pallas(40, 8, 48, 96, True) and (small.bm, small.bn, small.bk) == (16, 32, 16)
    tiny = tuning.pallas_config(60, 1, 48, 48, fused=True, entry=ENTRY)  # the tuned 64-row class with 60 rows:
    assert (tiny.bm, tiny.bn, tiny.bk, tiny.warps) == (16, 16, 16, 4)  # tiles shrink to what the operands hold
    assert tuning.mosaic_config(65536, 128, 768, entry=ENTRY) == MosaicConfig(128, 256, 64, 3, False)
    assert tuning.fastest_backend(65536, 128, fused=True, entry=ENTRY) == "mosaic"
    assert tuning.fastest_backend(65536, 128, fused=False, entry=ENTRY) is None
    table = {"devices": {"NVIDIA H200": ENTRY}}
    assert tuning.device_entry("NVIDIA H100 80GB HBM3", table) is ENTRY  # same family
    assert tuning.device_entry("NVIDIA A100-SXM4-80GB", table) == {} and tuning.device_entry("", table) == {}



def test_tiles_fit_shared_memory_in_every_dtype():
    """An H200 refused the tuned 64-row glu tiles of a float32 model (240 KiB of shared memory asked, 227 KiB
    there): the table is tuned in bfloat16, so a float32 model gets fewer stages (then a shallower bk)."""
    hopper = platform.SHARED_MEMORY[(9, 0)]
    bf16 = tuning.pallas_config(8192, 128, 2048, 768, fused=True, entry=ENTRY, itemsize=2, shared_bytes=hopper)
    f32 = tuning.pallas_config(8192, 128, 2048, 768, fused=True, entry=ENTRY, itemsize=4, shared_bytes=hopper)
    assert bf16.stages == 4 and (f32.stages, f32.bk) == (2, 64)
    small = platform.SHARED_MEMORY_OTHER  # 99 KiB: two stages of 80 KiB do not fit either
    assert tuning.pallas_config(8192, 128, 2048, 768, fused=True, entry=ENTRY, itemsize=4, shared_bytes=small).bk == 32
    for kind, entry in tuning._table().get("devices", {}).items():
        for key, tuned in entry.get("pallas", {}).items():
            op, rows_per_group = key.split("/")
            for itemsize in (2, 4):
                cfg = tuning.pallas_config(int(rows_per_group) * 128, 128, 2048, 768, fused=op == "glu",
                                           entry=entry, itemsize=itemsize, shared_bytes=hopper)
                halves = 2 if op == "glu" else 1
                assert cfg.stages * (cfg.bm * cfg.bk + halves * cfg.bk * cfg.bn) * itemsize <= hopper, (kind, key)
                assert itemsize == 4 or cfg == tuning.PallasConfig(**tuned), (kind, key)  # bf16: as tuned

def test_the_committed_table_holds_only_known_configurations():
    table = tuning._table()
    for kind, entry in table.get("devices", {}).items():
        for cfg in entry.get("pallas", {}).values():
            tuning.PallasConfig(**cfg)
        for cfg in entry.get("mosaic", {}).values():
            MosaicConfig(**cfg)
        assert set(entry.get("fastest", {}).values()) <= {"pallas", "mosaic"}, kind


@st.composite
def bf16_problems(draw):
    G = draw(st.sampled_from([1, 4, 9]))
    M = draw(st.sampled_from([1, 70, 300]))
    K, N = draw(st.sampled_from([(64, 128), (200, 300)]))
    shape = draw(st.sampled_from(["random", "one_group_has_all", "some_empty", "sum_below_m"]))
    return G, M, K, N, shape, draw(st.integers(0, 2**31 - 1))


@gpu
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bf16_problems())
def test_compiled_bfloat16_matches_float64(problem):
    x, w, sizes = make(*problem, dtype=ml_dtypes.bfloat16)
    ref = reference(x, w, sizes)
    out = np.asarray(grouped_matmul(x, w, sizes, backend="mosaic")).astype(np.float64)
    assert not np.isnan(out).any()
    np.testing.assert_array_equal(out[int(sizes.sum()):], 0)  # rows of no group
    assert np.linalg.norm(out - ref) <= 1e-2 * max(np.linalg.norm(ref), 1e-6)


@gpu
@pytest.mark.parametrize("cfg", [MosaicConfig(64, 128, 64, 2, True), MosaicConfig(128, 128, 64, 4, False),
                                 MosaicConfig(128, 128, 64, 3, True, 2), MosaicConfig(64, 128, 64, 4, False, 2)])
def test_compiled_every_tile_configuration_computes_the_same_product(cfg):
    x, w, sizes = make(5, 700, 256, 384, "some_empty", 1, dtype=ml_dtypes.bfloat16)
    from moejax.kernels.grouped_matmul import mosaic
    out = np.asarray(mosaic.grouped_matmul(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes), cfg))
    ref = reference(x, w, sizes)
    assert np.linalg.norm(out.astype(np.float64) - ref) <= 1e-2 * np.linalg.norm(ref)


@gpu
@pytest.mark.parametrize("act,bias,compute_wgs", [("silu", False, 1), ("swiglu_clamp", True, 1), ("silu", True, 2)])
def test_compiled_expert_ffn_bfloat16_matches_float64(act, bias, compute_wgs):
    x, idx, w, wgu, wd, bgu, bd = make_ffn(9, 2, 150, 128, 192, "some_empty", 3, bias)
    ref = ffn_reference(x, idx, w, wgu, wd, bgu, bd, act, 7.0, 1.702)
    bf = [None if a is None else a.astype(ml_dtypes.bfloat16) for a in (x, wgu, wd, bgu, bd)]
    entry = {"mosaic": {tuning.class_key("gemm", 300, 9): dict(bm=64, bn=64, bk=64, stages=4,
                                                                  compute_wgs=compute_wgs)}}
    with tuning.using(entry):
        out = np.asarray(jax.jit(lambda *a: expert_ffn(*a, act=act, backend="mosaic"))(
            bf[0], idx, w, bf[1], bf[2], bf[3], bf[4])).astype(np.float64)
    assert np.linalg.norm(out - ref) <= 2e-2 * np.linalg.norm(ref)
