"""Parallel layouts: attn in {dp, tp} with experts replicated, tp, ep (all-to-all or all-gather/reduce-scatter)
or async_ep, and DEP (attention and expert groups, r1 micro-batches, r2 token chunks, ASAS/AASS). Each is
compared with the single-device float32 model: logits within 1e-5 relative (the partitioned attention and norms
may reorder float sums) and the same greedy tokens, in a process with 8 simulated CPU devices; also with every
token routed to the same experts, and at the expert level with uneven token counts and skewed routing."""
import json
import os
import subprocess
import sys

import pytest
from workers import run_workers

import moejax
from moejax.costs import layout_comm
from moejax.sharding import Layout

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = 1e-5


# Three worker processes side by side (compiling is mostly one thread each): one family's layouts and some checks.
WORKERS = (["models:qwen3_moe", "skewed", "async_ep", "two_channel:qwen3_moe"],
           ["models:deepseek_v2_lite", "dep", "collectives", "two_channel:deepseek_v2_lite", "planned"],
           ["models:gpt_oss", "experts", "two_channel:gpt_oss", "padded_rows"])


@pytest.fixture(scope="module")
def results():
    out: dict = {"models": {}, "two_channel": {}}
    for result in run_workers("sharding_worker.py", WORKERS, devices=8, timeout=1500):
        for per_family in ("models", "two_channel"):
            out[per_family].update(result.pop(per_family))
        out.update(result)
    return out


@pytest.mark.slow
def test_every_layout_equals_one_device(results):
    assert len(results["models"]) == 19  # 11 layouts on qwen3_moe, 4 on each of two other families
    for case, r in results["models"].items():
        assert r["rel"] <= TOL, case
        assert r["same_tokens"], case


@pytest.mark.slow
def test_expert_exchanges_with_uneven_and_skewed_routing(results):
    assert len(results["experts"]) == 12
    for case, err in results["experts"].items():
        assert err <= TOL, case


@pytest.mark.slow
def test_every_layout_with_all_tokens_on_the_same_experts(results):
    assert len(results["skewed"]) == 7
    for spec, err in results["skewed"].items():
        assert err <= TOL, spec


def _expected_schedule(order, moe_layers, r1, r2):
    """FinDEP's dispatch order on the attention group: ASAS puts each micro-batch's shared expert right after its
    attention (and expert chunks), AASS all shared experts after all attentions, PPPipe between attention and the
    sends; a micro-batch's outputs combine just before its next attention (so that attention waits only for its own
    experts), the last layer's at the end."""
    out = []
    for t, layer in enumerate(moe_layers):
        for m in range(r1):
            out += [["combine", moe_layers[t - 1], m]] if t else []
            out += [["attn", layer, m]] + ([["shared", layer, m]] if order == "pppipe" else [])
            out += [["experts", layer, m, j] for j in range(r2)]
            out += [["shared", layer, m]] if order == "asas" else []
        out += [["shared", layer, m] for m in range(r1)] if order == "aass" else []
    return out + [["combine", moe_layers[-1], m] for m in range(r1)]


@pytest.mark.slow
def test_dep_groups_hold_their_parts_and_dispatch_in_order(results):
    """attn_devices=3, expert_devices=4, r1=2, r2=2 (PPPipe: 1) on deepseek_v2_lite (dense first layer, shared
    experts; D=32, k=2, 8 experts) for 4 rows of 16 tokens, padded to 6 rows (a multiple of A·r1): micro-batches of
    48 tokens, chunks of 24 rows (a multiple of lcm(3, 4); PPPipe: one chunk of 48). Each order gives the one-device
    logits."""
    for order, r in results["dep"].items():
        assert r["rel"] <= TOL, order
        assert r["params"] == [0, 1, 2], order  # attention, norms, routers, shared experts, stand-ins
        assert r["experts"] == [3, 4, 5, 6] and r["experts_per_device"] == [2], order  # EP inside the group
        r2, rows = (1, 48) if order == "pppipe" else (2, 24)
        assert r["schedule"] == _expected_schedule(order, [1, 2], 2, r2), order
        chunks = 2 * 2 * r2  # MoE layers x micro-batches x chunks
        assert r["stats"] == {"a2e_bytes": chunks * rows * (32 * 4 + 2 * 4 + 2 * 4),  # hidden f32, ids, weights
                              "e2a_bytes": chunks * rows * 32 * 4, "chunks": chunks}, order
        # the cost module's per-device figures, x the devices that send them and the MoE layers
        cfg = moejax.load(os.path.join(HERE, "fixtures", "deepseek_v2_lite")).config
        layout = Layout.parse(f"experts=dep,attn_devices=3,expert_devices=4,r1=2,r2={r2},order={order}").resolve(8, 8)
        a2e, e2a = layout_comm(cfg, layout, 4, 16, 4).experts[:2]
        assert (a2e.bytes_sent * 3 * 2, e2a.bytes_sent * 4 * 2) == (r["stats"]["a2e_bytes"], r["stats"]["e2a_bytes"])


@pytest.mark.slow
def test_planned_layouts_equal_one_device_and_say_why(results):
    """layout="auto" runs the layout the planner predicts fastest (h100 datasheet, steps of 128 tokens) and
    r1/r2/order=auto under DEP what FinDEP's solver picks; each gives the one-device logits and explains itself."""
    auto, dep = results["planned"]["auto"], results["planned"]["attn=dp,experts=dep,r1=auto,r2=auto,order=auto"]
    assert auto["rel"] <= TOL and dep["rel"] <= TOL
    assert auto["decisions"][0].startswith("layout auto: " + auto["layout"].split(",exchange")[0].split(",devices")[0])
    assert "what would change it" in auto["decisions"][0] and "alternatives" in auto["decisions"][0]
    assert dep["layout"].startswith("attn=dp,experts=dep") and "DEP r1, r2, order=auto" in dep["decisions"][0]
    assert "runner-ups" in dep["decisions"][0]


@pytest.mark.slow
def test_async_ep_gathers_depend_only_on_weights(results):
    """Every device holds the first MoE layer's experts whole and a shard of the others'; each later layer's
    gathers read only parameters, so none waits on any layer's compute and XLA may start them early."""
    gathers = results["async_ep"]
    assert {int(i): whole for i, whole in gathers["whole"].items()} == {
        i: i == gathers["first"] for i in map(int, gathers["whole"])}
    assert len(gathers["operands"]) == 2 * (gathers["moe_layers"] - 1)  # gate/up and down of each later MoE layer
    assert all(op.startswith("%param") for op in gathers["operands"]), gathers["operands"]


@pytest.mark.slow
def test_async_ep_streamed_from_host_equals_one_device_and_gathers_only_inputs(results):
    """AsyncEP's two channels (MoE-Prefill §6.3), window 1: each MoE layer's program all-gathers the next layer's
    experts from shards that came from pinned host memory; the gathers read only the program's inputs (one per
    expert array), so they need not wait for the layer's compute. The first pass moves every layer's shards once,
    plus the next pass's first layer (gathered by the last layer) and the one after it (the window), unless that
    one is the last layer itself, still in use (a model of 2 MoE layers). Θ's profile runs on it (as launch.serve
    does) and leaves it giving the same results."""
    assert len(results["two_channel"]) == 3
    for name, r in results["two_channel"].items():
        assert r["rel"] <= TOL and r["same_tokens"], name
        assert r["theta_flops"] > 0 and len(r["theta_layers"]) == r["moe_layers"], name
        assert r["rel_after_profile"] <= TOL, name
        assert len(r["operands"]) == r["arrays"] and all(op.startswith("%param") for op in r["operands"]), name
        assert r["misses"] == 1, name  # only the first layer of the first pass waits for its gather
        ahead = min(2, r["moe_layers"] - 1)
        assert r["bytes_h2d"] == (r["moe_layers"] + ahead) * r["layer_bytes"], name


@pytest.mark.slow
def test_batches_pad_to_a_multiple_of_the_devices_that_split_rows(results):
    """3 rows: 8 under DP on 8 devices (and then nothing moves outside the expert program), 6 on 6 devices, the
    plain bucket (4) under attn=tp, and 2 micro-batches x 2 attention devices under DEP."""
    r = results["padded_rows"]
    assert {spec: v["rows"] for spec, v in r.items()} == {
        "attn=dp,experts=ep": 8, "attn=dp,experts=replicated,devices=6": 6, "attn=tp,experts=tp,devices=4": 4,
        "attn=dp,experts=dep,attn_devices=2,expert_devices=4,r1=2": 4}
    assert r["attn=dp,experts=ep"]["outside"] == {} and r["attn=dp,experts=replicated,devices=6"]["outside"] == {}


@pytest.mark.slow
def test_data_parallel_layouts_communicate_only_for_their_experts(results):
    """Hidden states are split by batch rows under attn=dp and routing runs inside each layout's program on each
    device's own tokens (no top-k gather of router logits): only the expert exchange itself communicates."""
    assert results["collectives"] == {
        "attn=dp,experts=replicated": [],
        "attn=dp,experts=ep": ["all-to-all"],
        "attn=dp,experts=ep,exchange=gather": ["all-gather", "reduce-scatter"],
        "attn=dp,experts=tp": ["all-gather", "reduce-scatter"],  # tokens to every width slice, outputs summed back
    }


@pytest.mark.parametrize("spec, message", [
    ("attn=dp,experts=everywhere", "experts must be one of"),
    ("attn=dp,nodes=2", "unknown key 'nodes'"),
    ("attn=dp,attn=tp", "given twice"),
    ("attn", "is not key=value"),
    ("attn=dp,devices=0", "devices must be an int >= 1"),
    ("attn=dp,experts=ep,exchange=carrier_pigeon", "exchange must be one of"),
    ("attn=dp,experts=ep,r1=2", "r1 applies to experts=dep, not ep"),
    ("attn=dp,experts=tp,exchange=gather", "exchange applies to experts=ep or dep"),
    ("attn=dp,experts=dep,order=sasa", "order must be one of asas, aass, pppipe"),
])
def test_bad_specs_name_what_is_wrong(spec, message):
    with pytest.raises(ValueError, match=message):
        Layout.parse(spec)


@pytest.mark.parametrize("spec, message", [
    ("experts=dep,attn_devices=3,expert_devices=3,devices=8", "devices=8 but attn_devices=3 \\+ expert_devices=3 = 6"),
    ("experts=dep,expert_devices=3", "8 experts to divide evenly over the 3 expert devices"),
    ("experts=dep,attn_devices=8", "leaves no device of the 8 for the other group"),
    ("experts=dep,attn_devices=4,expert_devices=8", "12 devices but only 8 are present"),
    ("experts=dep,order=pppipe,r2=2", "order=pppipe sends each micro-batch whole \\(r2=1\\), got r2=2"),
])
def test_bad_dep_groups_name_the_numbers(spec, message):
    with pytest.raises(ValueError, match=message):
        Layout.parse(spec).resolve(8, 8)


def test_dep_groups_default_to_halves():
    assert str(Layout.parse("experts=dep,r1=2").resolve(8, 8)) == (
        "attn=dp,experts=dep,devices=8,attn_devices=4,expert_devices=4,r1=2,r2=1,order=asas,exchange=all_to_all")
    assert Layout.parse("experts=dep,expert_devices=2").resolve(8, 6).attn_devices == 4


def test_specs_checked_against_the_model_and_devices():
    with pytest.raises(ValueError, match="devices=4 but only 1 are present"):
        moejax.load("tiny-qwen3-moe", layout="attn=dp,experts=ep,devices=4")
    with pytest.raises(ValueError, match="runs attention data-parallel"):
        moejax.load("tiny-qwen3-moe", layout="attn=tp,experts=dep")
    with pytest.raises(ValueError, match="needs 2 or more devices"):
        moejax.load("tiny-qwen3-moe", layout="attn=dp,experts=dep")
    with pytest.raises(ValueError, match="only as experts=async_ep with placement='streamed'"):
        moejax.load("tiny-qwen3-moe", layout="attn=dp,experts=replicated", placement="streamed")
    with pytest.raises(ValueError, match="stream=jit"):
        moejax.load("tiny-qwen3-moe", layout="attn=dp,experts=async_ep", placement="streamed", stream="jit")
    with pytest.raises(ValueError, match="placement 'cached'"):
        moejax.load("tiny-qwen3-moe", layout="attn=dp,experts=async_ep", placement="cached")
    assert str(Layout.parse("experts=ep,devices=2").resolve(8, 2)) == "attn=dp,experts=ep,devices=2,exchange=all_to_all"
    # a layout spreads the weights, so the one-device memory budgeting does not push them to the host
    spread = moejax.load("qwen3-30b-a3b", device_memory_gb=80, layout="attn=dp,experts=replicated").memory_budget
    assert spread.placement == "resident" and "a layout spreads the weights" in spread.reason


@pytest.mark.slow
def test_serve_with_a_layout_gives_the_one_device_results(tmp_path):
    lines = [json.dumps({"custom_id": "c", "url": "/v1/completions", "body": {"prompt_token_ids": [1, 2, 3, 4],
                                                                               "max_tokens": 5}}),
             json.dumps({"custom_id": "s", "url": "/v1/score", "body": {"prompt_token_ids": [5, 6, 7],
                                                                         "candidate_token_ids": [[8], [9, 10]]}})]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    outs = {}
    for tag, extra in (("one", []), ("ep", ["--layout", "attn=dp,experts=ep"]),
                       ("dep", ["--layout", "attn=dp,experts=dep,r1=2,r2=2,order=aass"])):
        run = subprocess.run([sys.executable, "-m", "launch.serve", "--model",
                              os.path.join(HERE, "fixtures", "gpt_oss"), "--dtype", "float32",
                              "--input", str(tmp_path / "in.jsonl"), "--output",
                              str(tmp_path / f"{tag}.jsonl"), *extra], cwd=os.path.dirname(HERE), env=env,
                             capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-2000:]
        outs[tag] = [json.loads(line)["response"]["body"]
                     for line in (tmp_path / f"{tag}.jsonl").read_text().splitlines()]
    for tag in ("ep", "dep"):
        assert outs[tag][0]["choices"][0]["token_ids"] == outs["one"][0]["choices"][0]["token_ids"], tag
        for got, want in zip(outs[tag][1]["results"][0]["candidates"], outs["one"][1]["results"][0]["candidates"],
                             strict=True):
            assert got["logprob"] == pytest.approx(want["logprob"], rel=1e-5, abs=1e-5), tag
