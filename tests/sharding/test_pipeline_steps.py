"""Pipeline parallelism for prefill (layout attn=pp,experts=pp, MoE-Prefill Table 1's PP+PP): layers split over the
stages, micro-batches through them in one jit. Logits, token log-probabilities and packed-tree scoring equal the
one-device float32 model (1e-5 relative) on 2, 3 and 4 stages in a process with 8 simulated CPU devices, with even
and uneven splits and layer kinds spread unevenly; generation and a prefix pool are refused; the split and the
communication figures. The collectives of the compiled step against moejax.costs.layout_comm:
tests/sharding/test_comm_accounting.py."""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from workers import run_workers

import moejax
from moejax.config import ModelConfig
from moejax.costs import layout_comm
from moejax.layout import Layout
from moejax.sharding.stages import slots, stage_bytes, stage_layers

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = 1e-5


def config(name) -> ModelConfig:
    with open(os.path.join(HERE, "fixtures", name, "config.json")) as f:
        return ModelConfig.from_hf(json.load(f))


# -- the split ----------------------------------------------------------------------------------------------------

def test_layers_split_contiguously_the_first_stages_taking_the_extra_ones():
    assert stage_layers(4, 4) == (range(0, 1), range(1, 2), range(2, 3), range(3, 4))
    assert stage_layers(7, 3) == (range(0, 3), range(3, 5), range(5, 7))
    with pytest.raises(ValueError, match="3 decoder layers cannot be split over 4 stages"):
        stage_layers(3, 4)


def test_layer_kinds_stack_into_slots_padded_to_the_fullest_stage():
    """A dense first layer, then MoE layers, over 2 stages: stage 0 holds the dense layer and two MoE layers, stage 1
    three MoE layers; the dense kind's slot on stage 1 is padding."""
    counts, where = slots(["dense", "moe", "moe", "moe", "moe", "moe"], 2)
    assert counts == {"dense": 1, "moe": 3}
    assert where == [("dense", 0), ("moe", 0), ("moe", 1), ("moe", 0), ("moe", 1), ("moe", 2)]


def test_a_stage_holds_its_layers_and_the_rest_once():
    class A:
        def __init__(self, *shape):
            self.shape, self.dtype = shape, np.float32
    shapes = {("embed",): A(10, 4), **{("layers", i, "attn", "wq"): A(4, 4) for i in range(5)},
              **{("layers", i, "mlp", "we_down"): A(2, 3, 4) for i in range(5)}}
    outside, stacked, experts = stage_bytes(shapes, 2)  # 5 layers: 3 + 2, so three slots per stage
    assert (outside, stacked, experts) == (40 * 4, 3 * (16 + 24) * 4, 3 * 24 * 4)


# -- the spec -----------------------------------------------------------------------------------------------------

def test_spec_defaults_one_micro_batch_per_stage_and_names_bad_numbers():
    lay = Layout.parse("attn=pp,experts=pp").resolve(8, 4, layers=6)
    assert (lay.devices, lay.microbatches, lay.row_multiple) == (4, 4, 4)
    assert str(lay) == "attn=pp,experts=pp,devices=4,microbatches=4"
    assert Layout.parse("attn=pp,experts=pp,microbatches=3").resolve(8, 2).row_multiple == 3
    with pytest.raises(ValueError, match="splits the 3 decoder layers over 4 stages.*devices must be <= 3"):
        Layout.parse("attn=pp,experts=pp").resolve(8, 4, layers=3)
    with pytest.raises(ValueError, match="attn=pp,experts=ep is not implemented"):
        Layout.parse("attn=pp,experts=ep").resolve(8, 4)
    with pytest.raises(ValueError, match="microbatches applies to experts=pp, not ep"):
        Layout.parse("attn=dp,experts=ep,microbatches=2")


# -- the communication figures ------------------------------------------------------------------------------------

def test_pipeline_sends_a_micro_batch_per_tick_but_the_last():
    """M+P-1 ticks, a collective-permute of one micro-batch's hidden states [B/M, T, D] after each but the last;
    Table 1: each of the P-1 stage boundaries carries the N tokens' hidden states once."""
    cfg = config("qwen3_moe_nonorm")
    D, L, b, B, T = cfg.hidden_size, cfg.num_layers, 2, 8, 16
    comm = layout_comm(cfg, Layout.parse("attn=pp,experts=pp,microbatches=2").resolve(8, 4, layers=L), B, T, b)
    assert comm.step_by_kind("attention") == pytest.approx({"collective-permute": (2 + 4 - 2) * (B // 2) * T * D * b})
    assert comm.experts == comm.first_experts == () and comm.step_by_kind("experts") == {}
    assert comm.ideal_attention == pytest.approx(3 / 4 * B * T * D * b / L) and comm.ideal_experts == 0
    one_stage = layout_comm(cfg, Layout.parse("attn=pp,experts=pp").resolve(8, 1, layers=L), B, T, b)
    assert one_stage.attention == () and one_stage.ideal_attention == 0
    with pytest.raises(ValueError, match="batch \\(6\\) to be a multiple of its 4 micro-batches"):
        layout_comm(cfg, Layout.parse("attn=pp,experts=pp").resolve(8, 4, layers=L), 6, T, b)


# -- one stage, in this process -----------------------------------------------------------------------------------

def test_one_stage_pipeline_equals_one_device_and_refuses_generation():
    path = os.path.join(HERE, "fixtures", "qwen3_moe")
    ids = np.random.default_rng(1).integers(0, 100, (3, 9))
    engine = moejax.load(path, dtype="float32", layout="attn=pp,experts=pp")
    ref = moejax.load(path, dtype="float32").logits(ids)
    out = engine.logits(ids)
    assert float(np.max(np.abs(out - ref)) / np.max(np.abs(ref))) < TOL
    with pytest.raises(ValueError, match="prefill-only scoring.*generation's prefill"):
        engine.generate([[1, 2, 3]], 2)


# -- 2, 3 and 4 stages --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def results():
    (out,) = run_workers("pipeline_worker.py", [[]], devices=8, timeout=900)
    return out


@pytest.mark.slow
def test_pipelined_logits_equal_one_device(results):
    cases = results["cases"]
    assert sorted(c["stages"] for c in cases.values()) == [2, 2, 3, 4]
    for case, got in cases.items():
        assert got["rel"] < TOL, (case, got["rel"])
        assert got["blocks_on_their_stage"], case  # each stage's layers on its own device
        assert got["layer_params_in_state"] == 1, case  # the params hold 0-d stand-ins for the layers
    even = cases["qwen3_moe_nonorm|attn=pp,experts=pp,devices=4"]
    # one layer per stage, MoE and dense layers alternating: each stage holds a slot of each kind, one of them padding
    assert even["layout"].endswith("microbatches=4") and even["slots"] == [[4, 1], [4, 1]]
    assert even["logprobs_rel"] < TOL and even["same_top_ids"]
    attention = next(line for line in even["explain"].splitlines() if line.strip().startswith("attention (x4)"))
    analytic = re.search(r"analytic collective-permute ([\d.]+ \w+)", attention).group(1)
    assert re.search(r"measured collective-permute ([\d.]+ \w+)", attention).group(1) == analytic, attention
    scored = cases["gpt_oss|attn=pp,experts=pp,devices=3,microbatches=2"]
    assert scored["score_rel"] < TOL and scored["score_pool"] is None
    assert "with a prefix KV pool" in scored["score_with_pool"] and "--prefix-cache-mb 0" in scored["score_with_pool"]
    # 3 layers over 2 stages (2 + 1): the MoE kind and the dense middle layer's, one slot each on each stage
    assert cases["qwen3_moe|attn=pp,experts=pp,devices=2"]["slots"] == [[2, 1], [2, 1]]


@pytest.mark.slow
def test_generation_and_too_few_layers_are_refused(results):
    for case, got in results["cases"].items():
        assert "prefill-only scoring" in got["generate"], case
    assert "splits the 3 decoder layers over 4 stages" in results["too_few_layers"]


@pytest.mark.slow
def test_serve_scores_with_a_pipeline_as_on_one_device(tmp_path):
    """launch.serve's scoring requests on 3 stages (no prefix cache) give the one-device log-probabilities."""
    lines = [json.dumps({"custom_id": f"s{i}", "url": "/v1/score",
                         "body": {"prompt_token_ids": prompt, "candidate_token_ids": [[8], [9, 10]]}})
             for i, prompt in enumerate([[5, 6, 7], [15, 16, 17, 18, 19]])]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    outs = {}
    for tag, extra in (("one", []), ("pp", ["--layout", "attn=pp,experts=pp,devices=3", "--prefix-cache-mb", "0"])):
        model = os.path.join(HERE, "fixtures", "gpt_oss")
        run = subprocess.run([sys.executable, "-m", "launch.serve", "--model", model, "--dtype", "float32",
                              "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / f"{tag}.jsonl"),
                              *extra], cwd=os.path.dirname(HERE), env=env,
                             capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-2000:]
        outs[tag] = {json.loads(line)["custom_id"]: json.loads(line)["response"]["body"]["results"][0]["candidates"]
                     for line in (tmp_path / f"{tag}.jsonl").read_text().splitlines()}
    assert sorted(outs["pp"]) == ["s0", "s1"]
    for key, want in outs["one"].items():
        for got, expected in zip(outs["pp"][key], want, strict=True):
            assert got["logprob"] == pytest.approx(expected["logprob"], rel=1e-5, abs=1e-5), key
