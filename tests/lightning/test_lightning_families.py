"""placement='lightning' for every family fixture, in two worker processes with 2 simulated CPU devices each
(tests/lightning_placement_worker.py): the weights on cpu:0, the KV cache of the layers past the r_c share on cpu:1
(the host) with their attention there; each family under a different policy (r_w 0 to 1, r_c 0 to 1, μ 1 to 4, two
with attention on the device, one of them over KV swapped in from the host, one with the FFN on the host). The
greedy tokens equal the resident single-device float32 model's and transformers'."""
import pytest
from host_decode import FAMILIES
from lightning_placement_worker import POLICIES
from workers import run_workers

WORKERS = (FAMILIES[0::2], FAMILIES[1::2])
ON = "cpu:0:device"  # the accelerator's memory
HOST = "cpu:1:device"  # the host's: the CPU backend's memory is host memory


@pytest.fixture(scope="module")
def families():
    out: dict = {}
    for result in run_workers("lightning_placement_worker.py", WORKERS, devices=2, timeout=1200):
        out.update(result["families"])
    return out


@pytest.mark.slow
def test_every_family_generates_the_resident_models_tokens(families):
    assert sorted(families) == sorted(FAMILIES)
    for name, r in families.items():
        assert r["tokens"] == r["resident"] == r["transformers"], name


@pytest.mark.slow
def test_the_kv_cache_lives_on_the_host_past_the_device_share(families):
    for name, r in families.items():
        mu, r_w, r_c, attention_on, ffn_on = POLICIES[name]
        layers = len(r["pool"])
        on_device = round(r_c * layers)
        assert (r["host"], r["device"], r["device_kv_layers"]) == ("cpu:1", "cpu:0", on_device), name
        assert r["pool"] == [[ON]] * on_device + [[HOST]] * (layers - on_device), name
        assert (r["host_tasks"] > 0) == (on_device < layers), name
        assert r["weights"] == [ON], name
        assert r["pages"] == ([] if r_w == 1 or ffn_on == "host" else ["cpu:0:pinned_host"]), name
        assert r["host_experts"] == ([HOST] if ffn_on == "host" and r_w < 1 else []), name
        assert r["resident_experts"] == ([] if r_w == 0 else [ON]), name
