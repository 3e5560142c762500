"""The cached placement over several devices (fMoE §5: experts round robin over a node's devices), layout
attn=dp,experts=ep with placement 'cached', on 8 simulated devices (tests/cached_ep_worker.py) against the one-device
float32 resident model; and the combinations it refuses."""
import json
import os
import subprocess
import sys

import pytest
from workers import run_workers

import moejax

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOL = 1e-5
CASES = ["exact", "evicting", "predicted", "speculative"]  # the oracle's speculation runs the true experts


@pytest.fixture(scope="module")
def results():
    [out] = run_workers("cached_ep_worker.py", [[*CASES, "errors"]], devices=8, timeout=900)
    return out


@pytest.mark.parametrize("case", CASES)
def test_cached_over_devices_equals_one_device(results, case):
    r = results[case]
    assert r["placement"] == "ep+cached"
    assert r["rel"] <= TOL and r["same_tokens"], r["rel"]
    assert "expert slots on each of" in r["describe"] and "each device has its own cache" in r["describe"]
    assert "exchange=gather" in r["describe"]  # what its step does, whatever the spec said


@pytest.mark.parametrize("case", CASES)
def test_each_device_caches_only_its_round_robin_share_of_the_experts(results, case):
    r = results[case]
    devices = r["devices"]
    assert len(r["held"]) == devices and all(r["held"]), "every device caches some experts"
    for d, experts in enumerate(r["held"]):
        assert len(experts) <= 2  # cache_slots=2 on each device
        for h in experts:
            assert h["expert"] % devices == d, (d, h)
            assert h["on"] == [d], (d, h)  # a miss or prefetch is copied to the expert's owner only
            assert h["equal"], (d, h)  # and holds that expert's weights


def test_misses_evictions_and_prefetches_are_counted_on_every_device(results):
    # 8 devices x 1 expert of each of the 2 MoE layers: every expert fits its device's 2 slots, nothing evicted
    assert results["exact"]["stats"]["misses"] == 16 and results["exact"]["stats"]["cache"]["evictions"] == 0
    assert results["evicting"]["stats"]["cache"]["evictions"] > 0  # 4 devices x 2 experts x 2 layers in 2 slots
    assert results["predicted"]["stats"]["prefetches"] > 0
    assert results["speculative"]["stats"]["speculated_tokens"] > 0
    for case in ("exact", "evicting"):  # a reset reaches the devices' counters: one pass's lookups, then two
        (mine, cache), (mine2, cache2) = results[case]["lookups_after_reset"], results[case]["lookups_twice"]
        assert mine == cache > 0 and (mine2, cache2) == (2 * mine, 2 * cache)


def test_experts_that_do_not_divide_over_the_devices_are_refused(results):
    assert "needs the 8 experts to divide evenly over 3 devices" in results["errors"]["uneven"]


def test_cached_combines_only_with_data_parallel_expert_parallel_layouts():
    with pytest.raises(ValueError, match="or as attn=dp,experts=ep with placement='cached'"):
        moejax.load("tiny-qwen3-moe", layout="attn=tp,experts=ep", placement="cached")
    with pytest.raises(ValueError, match="prefill_experts='stream' runs on one device"):
        moejax.load("tiny-qwen3-moe", layout="attn=dp,experts=ep", placement="cached", prefill_experts="stream")


@pytest.mark.slow
def test_serve_with_layout_and_cached_gives_the_one_device_tokens(tmp_path):
    line = {"custom_id": "c", "url": "/v1/completions", "body": {"prompt_token_ids": [1, 2, 3, 4], "max_tokens": 5}}
    (tmp_path / "in.jsonl").write_text(json.dumps(line) + "\n")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    tokens = {}
    for tag, extra in (("one", []), ("ep", ["--layout", "attn=dp,experts=ep", "--placement", "cached",
                                            "--cache-slots", "2"])):
        run = subprocess.run([sys.executable, "-m", "launch.serve", "--model", os.path.join(ROOT, "tests", "fixtures",
                              "gpt_oss"), "--dtype", "float32", "--input", str(tmp_path / "in.jsonl"), "--output",
                              str(tmp_path / f"{tag}.jsonl"), *extra], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-2000:]
        tokens[tag] = json.loads((tmp_path / f"{tag}.jsonl").read_text())["response"]["body"]["choices"][0]["token_ids"]
    assert tokens["ep"] == tokens["one"]
