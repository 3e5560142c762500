"""Communication accounting: the analytic bytes each device sends per layer (moejax.costs.layout_comm, as
implemented and MoE-Prefill Table 1's figure) against the collectives of the compiled full-logits step
(moejax.sharding.hlo_comm), for every implemented layout on fixtures in a process with 8 simulated CPU devices
(tests/comm_worker.py lists the cases); and the HLO reader on hand-written lines."""
import json
import os
import re
import subprocess
import sys

import pytest

from moejax.config import ModelConfig
from moejax.costs import TABLE_1, layout_comm, table_1
from moejax.layout import Layout
from moejax.offload.memory_budget import size
from moejax.sharding import hlo_comm

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def config(name) -> ModelConfig:
    with open(os.path.join(HERE, "fixtures", name, "config.json")) as f:
        return ModelConfig.from_hf(json.load(f))


def resolved(spec, cfg, available=8) -> Layout:
    return Layout.parse(spec).resolve(cfg.num_experts, available, expert_width=cfg.moe_intermediate_size,
                                      heads=cfg.num_heads)


def approx(d: dict):
    return pytest.approx(d, rel=1e-12)


# -- the HLO reader ---------------------------------------------------------------------------------------------

def one(line: str, header: str = "") -> hlo_comm.Collective:
    (found,) = hlo_comm.collectives(header + "\nENTRY %main (p: f32[8]) -> f32[8] {\n" + line + "\n}\n")
    return found


def test_tuple_all_to_all_sums_its_elements():
    c = one("  %all-to-all.1 = (f32[1,32,32]{2,1,0}, f32[1,32,32]{2,1,0}, /*index=2*/f32[1,32,32]{2,1,0}, "
            "f32[1,32,32]{2,1,0}) all-to-all(%a, %b, %c, %d), channel_id=1, replica_groups={{0,1,2,3}}, "
            'metadata={op_name="jit(step)/shard_map/all_to_all"}')
    assert (c.kind, c.group, c.in_shard_map) == ("all-to-all", 4, True)
    assert c.bytes_sent == 3 / 4 * (4 * 32 * 32 * 4)


def test_mixed_dtype_tuple_and_iota_groups():
    c = one("  %ata = (f32[8,16]{1,0}, s32[8]{0}) all-to-all(%x, %y), replica_groups=[2,4]<=[8]")
    assert c.result == (("f32", (8, 16)), ("s32", (8,)))
    assert c.group == 4 and c.bytes_sent == 3 / 4 * (8 * 16 * 4 + 8 * 4)


def test_mesh_axis_groups_and_reduce_scatter_operand():
    c = one("  %rs = f32[16,32]{1,0} reduce-scatter(%p), replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, "
            "dimensions={0}, to_apply=%add")
    assert c.group == 4
    assert c.bytes_sent == 3 / 4 * (4 * 16 * 32 * 4)  # the operand holds the 4 devices' results


def test_async_starts_count_once_with_their_result():
    text = """HloModule m, num_partitions=8
ENTRY %main (p: bf16[4,8]) -> bf16[16,8] {
  %ags = (bf16[4,8]{1,0}, bf16[16,8]{1,0}) all-gather-start(bf16[4,8] %p), replica_groups={{0,1,2,3}}, dimensions={0}
  %agd = bf16[16,8]{1,0} all-gather-done(%ags)
  %ars = f16[16,8]{1,0} all-reduce-start(%q), replica_groups={}, to_apply=%add
  %ard = f16[16,8]{1,0} all-reduce-done(%ars)
  %rss = ((f32[8,4]{1,0}), f32[2,4]{1,0}) reduce-scatter-start(%r), replica_groups={{0,1,2,3}}, dimensions={0}
  %rsd = f32[2,4]{1,0} reduce-scatter-done(%rss)
  %cps = (f8e4m3fn[64]{0}, f8e4m3fn[64]{0}, u32[], u32[]) collective-permute-start(%s), source_target_pairs={{0,1}}
  %cpd = f8e4m3fn[64]{0} collective-permute-done(%cps)
}
"""
    found = hlo_comm.collectives(text)
    assert [c.kind for c in found] == ["all-gather", "all-reduce", "reduce-scatter", "collective-permute"]
    ag, ar, rs, cp = found
    assert ag.bytes_sent == 3 / 4 * 16 * 8 * 2  # the gathered result, bf16
    assert ar.group == 8 and ar.bytes_sent == 2 * 7 / 8 * 16 * 8 * 2  # replica_groups={}: num_partitions
    assert rs.bytes_sent == 3 / 4 * 8 * 4 * 4
    assert cp.bytes_sent == 64  # one byte per f8 element


def test_wrapped_async_collective_counts_once_inside_its_computation():
    text = """HloModule m, num_partitions=4
%async_computation (p: bf16[4,2]) -> bf16[4,2] {
  ROOT %all-to-all = bf16[4,2]{1,0} all-to-all(%p), replica_groups=[1,4]<=[4], dimensions={0}
}
ENTRY %main (x: bf16[4,2]) -> bf16[4,2] {
  %all-to-all-start = ((bf16[4,2]{1,0}), bf16[4,2]{1,0}) async-start(%x), calls=%async_computation
  ROOT %all-to-all-done = bf16[4,2]{1,0} async-done(%all-to-all-start)
}
"""
    (c,) = hlo_comm.collectives(text)
    assert (c.kind, c.group, c.computation, c.bytes_sent) == ("all-to-all", 4, "async_computation", 3 / 4 * 16)


def test_element_sizes():
    types = ("pred", "s8", "u8", "f8e4m3fn", "bf16", "f16", "u32", "s32", "f64", "s4")
    assert [hlo_comm.dtype_bits(t) for t in types] == [8, 8, 8, 8, 16, 16, 32, 32, 64, 4]
    with pytest.raises(ValueError, match="not understood"):
        hlo_comm.dtype_bits("opaque")


def test_collectives_in_loops_are_flagged_and_refused_in_totals():
    text = """HloModule m, num_partitions=2
%body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %ar = f32[4]{0} all-reduce(%x), replica_groups={{0,1}}, to_apply=%add
}
%cond (t: (s32[], f32[4])) -> pred[] {
  %lt = pred[] compare(%a, %b), direction=LT
}
ENTRY %main (p: f32[4]) -> f32[4] {
  %w = (s32[], f32[4]{0}) while(%t), condition=%cond, body=%body
  %ag = f32[8]{0} all-gather(%p), replica_groups={{0,1}}, dimensions={0}
}
"""
    found = hlo_comm.collectives(text)
    assert [(c.kind, c.in_loop) for c in found] == [("all-reduce", True), ("all-gather", False)]
    with pytest.raises(ValueError, match="once per iteration"):
        hlo_comm.bytes_by_kind(found)


def test_collectives_in_loops_of_known_trip_count_count_that_often():
    """A collective-permute in a loop of 3 iterations, and an all-reduce in a loop of 2 nested in a loop of 5 (as
    XLA prints `known_trip_count`); the loops' conditions run one more time, but hold no collectives here."""
    text = """HloModule m, num_partitions=2
%inner (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %ar = f32[4]{0} all-reduce(%x), replica_groups={{0,1}}, to_apply=%add
}
%cond (t: (s32[], f32[4])) -> pred[] {
  %lt = pred[] compare(%a, %b), direction=LT
}
%outer (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %w2 = (s32[], f32[4]{0}) while(%t), condition=%cond, body=%inner, backend_config={"known_trip_count":{"n":"2"}}
}
%body (t: (s32[], f32[8])) -> (s32[], f32[8]) {
  %cp = f32[8]{0} collective-permute(%y), channel_id=1, source_target_pairs={{0,1}}
}
ENTRY %main (p: f32[4]) -> f32[4] {
  %w = (s32[], f32[8]{0}) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %w1 = (s32[], f32[4]{0}) while(%u), condition=%cond, body=%outer, backend_config={"known_trip_count":{"n":"5"}}
}
"""
    found = hlo_comm.collectives(text)
    assert [(c.kind, c.in_loop, c.runs) for c in found] == [("all-reduce", True, 10), ("collective-permute", True, 3)]
    assert hlo_comm.bytes_by_kind(found) == {"all-reduce": 10 * 2 * 1 / 2 * 16, "collective-permute": 3 * 32}


def test_unreadable_replica_groups_are_an_error():
    with pytest.raises(ValueError, match="replica_groups"):
        one("  %ar = f32[4]{0} all-reduce(%x), to_apply=%add")


# -- the analytic figures ---------------------------------------------------------------------------------------

def test_table_1_figures():
    cfg = config("qwen3_moe")
    D, k, b, B, T = cfg.hidden_size, cfg.num_experts_per_tok, 2, 8, 64
    N, P = B * T, 8
    W = cfg.num_experts * 3 * D * cfg.moe_intermediate_size * b  # one layer's experts (no biases)

    def ideal(spec, devices=P):
        c = layout_comm(cfg, resolved(spec, cfg), B, T, b) if devices == 8 else \
            layout_comm(cfg, resolved(spec, cfg, devices), B, T, b)
        return c.ideal_attention, c.ideal_experts
    assert ideal("attn=dp,experts=replicated") == (0, 0)
    assert ideal("attn=dp,experts=tp") == approx((0, 7 / 8 * N * D * b * 2))  # all-gather + reduce-scatter
    assert ideal("attn=dp,experts=ep") == approx((0, 2 * 7 / 8 * N / 8 * k * D * b))  # two all-to-alls
    assert ideal("attn=dp,experts=async_ep") == approx((0, 7 / 8 * W))  # one all-gather of weights
    assert ideal("attn=tp,experts=tp,devices=4", 4) == approx((2 * 3 / 4 * N * D * b,) * 2)  # two all-reduces
    assert ideal("attn=tp,experts=ep,devices=4", 4) == approx((2 * 3 / 4 * N * D * b, 2 * 3 / 4 * N / 4 * k * D * b))


def test_table_1_rows_with_pipeline_and_sequence_parallelism():
    """Every row of Table 1: the implemented ones are layout_comm's ideal figures; PP+PP sends the hidden states
    over each of the P-1 stage boundaries once (per device, per layer); SP all-gathers the other devices' keys and
    values (MLA: its latent and rope key) and then moves tokens to the experts as DP does."""
    cfg, mla = config("qwen3_moe"), config("deepseek_v2_lite")
    D, b, B, T, P = cfg.hidden_size, 2, 8, 64, 4
    N = B * T
    rows = {(a, e): table_1(cfg, a, e, P, B, T, b) for a, e in TABLE_1}
    assert len(rows) == 9
    for attn, experts in TABLE_1:
        if attn not in ("sp", "pp"):
            comm = layout_comm(cfg, resolved(f"attn={attn},experts={experts},devices={P}", cfg), B, T, b)
            assert rows[attn, experts] == (comm.ideal_attention, comm.ideal_experts)
    assert rows["pp", "pp"] == approx((3 / 4 * N * D * b / cfg.num_layers, 0.0))
    kv = 3 / 4 * N * 2 * cfg.num_kv_heads * cfg.head_dim * b
    assert rows["sp", "tp"] == approx((kv, rows["dp", "tp"][1]))
    assert rows["sp", "ep"] == approx((kv, rows["dp", "ep"][1]))
    latent = 3 / 4 * N * (mla.kv_lora_rank + mla.qk_rope_head_dim) * b
    assert table_1(mla, "sp", "ep", P, B, T, b)[0] == approx(latent)
    with pytest.raises(ValueError, match="attn=sp,experts=replicated is not one of Table 1's rows"):
        table_1(cfg, "sp", "replicated", P, B, T, b)


def test_all_to_all_padding_overhead_is_visible():
    """The dropless buffers hold P x n*k rows of which a device really needs n*k: P times Table 1's rows."""
    cfg = config("qwen3_moe")
    c = layout_comm(cfg, resolved("attn=dp,experts=ep", cfg), 8, 64, 2)
    rows = [t.bytes_sent for t in c.experts if t.what.startswith(("token rows", "outputs back"))]
    assert sum(rows) == pytest.approx(8 * c.ideal_experts)
    assert c.step_by_kind("experts") == approx({"all-to-all": c.experts_bytes * sum(cfg.moe_layers)})


def test_async_ep_gathers_every_moe_layer_but_the_first():
    cfg = config("deepseek_v2_lite")  # a dense first layer, then MoE layers
    c = layout_comm(cfg, resolved("attn=dp,experts=async_ep", cfg), 8, 16, 4)
    assert c.first_experts == ()  # whole on every device
    assert c.step_by_kind("experts") == approx({"all-gather": c.experts_bytes * (sum(cfg.moe_layers) - 1)})


def test_layout_comm_refuses_what_it_does_not_model():
    cfg = config("qwen3_moe")
    with pytest.raises(ValueError, match="resolve it first"):
        layout_comm(cfg, Layout.parse("attn=dp,experts=ep"), 8, 16, 4)
    with pytest.raises(ValueError, match="multiple of the 8 devices"):
        layout_comm(cfg, resolved("attn=dp,experts=ep", cfg), 4, 16, 4)


# -- analytic against the compiled HLO --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def measured():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, os.path.join(HERE, "comm_worker.py")], capture_output=True, text=True,
                         timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_hlo_bytes_equal_the_analytic_figures(measured):
    """Per collective kind, over the whole step (a collective in a loop counted by its trip count: the scans over runs
    of like layers, a pipeline's ticks): the expert programs' collectives (shard_map, by op metadata)
    equal the analytic experts x the MoE layers that communicate, the rest the analytic attention x layers
    (float32: XLA:CPU would widen 16-bit collectives). A pipeline's stage program is one shard_map: its
    collective-permutes are the analytic attention x layers (moejax.costs)."""
    cases = measured["cases"]
    specs = {case.split("|")[1] for case in cases}
    assert len(specs) == 10 and {"qwen3_moe", "deepseek_v2_lite", "gpt_oss"} == {c.split("|")[0] for c in cases}
    for case, got in cases.items():
        name, spec, shape = case.split("|")
        cfg = config(name)
        B, T = map(int, shape.split("x"))
        comm = layout_comm(cfg, resolved(spec, cfg), B, T, 4)
        assert got["unknown_runs"] == 0, case  # every collective of the full-logits step runs a known number of times
        if spec.startswith("attn=pp"):  # the ticks but the last are a loop: one collective-permute, M+P-2 runs
            assert got["in_loop"] == 1, case
            assert got["other"] == {} and got["experts"] == approx(comm.step_by_kind("attention")), case
            assert set(got["experts"]) == {"collective-permute"} and comm.step_by_kind("experts") == {}, case
            continue
        # a run of like layers is one scan: its collectives sit in a loop and count once per repeat (its trip count)
        assert got["experts"] == approx(comm.step_by_kind("experts")), case
        assert got["other"] == approx(comm.step_by_kind("attention")), case


@pytest.mark.slow
def test_explain_prints_analytic_and_measured(measured):
    """attn=tp,experts=tp at the default shape, one row of 128 tokens per device: both parts are modelled."""
    cfg = config("qwen3_moe")
    comm = layout_comm(cfg, resolved("attn=tp,experts=tp,devices=4", cfg), 4, 128, 4)
    lines = {ln.split(" (x")[0].strip(): ln for ln in measured["explain"].splitlines() if " (x" in ln}
    for part, per_layer, ideal in (("attention", comm.attention_bytes, comm.ideal_attention),
                                   ("experts", comm.experts_bytes, comm.ideal_experts)):
        line = lines[part]
        analytic = re.search(r"analytic all-reduce ([\d.]+ \w+)", line).group(1)
        assert analytic == size(per_layer), line
        assert re.search(r"measured all-reduce ([\d.]+ \w+)", line).group(1) == analytic, line
        assert f"Table 1 {size(ideal)}" in line
