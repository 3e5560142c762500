"""MoE-Lightning's first building block: decode attention with the KV cache on the host (moejax.lightning). A greedy
decode driven layer by layer (tests/host_decode.py: the prefill on the accelerator, its KV copied to the host cache,
then each layer's query and new KV to the host, attention there, its output back) against the single-device float32
oracles: the same tokens as the resident model's `generate` and as transformers', each step's logits within 1e-5
relative of the full forward without a cache, and each layer's attention output and cache equal to the unsplit
module's. In process on one device (host and accelerator the same), and in a worker with 2 simulated devices where
the weights sit on cpu:1 and the cache and attention on cpu:0 (the host)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import fixture_dir
from flax import nnx
from host_decode import FAMILIES, run_family
from workers import run_workers

import moejax
from moejax.lightning import host_kv
from moejax.lightning.host_attention import HostAttention
from moejax.models.attention import AttentionCore
from moejax.models.decoder import MoEModel

TOL = 1e-5
HOST = "SingleDeviceSharding(device=CpuDevice(id=0), memory_kind=device)"
WORKERS = (FAMILIES[0::2], FAMILIES[1::2])  # two processes side by side, a GQA and an MLA family in each


def check_family(name: str, r: dict, accelerator: str) -> None:
    assert r["tokens"] == r["resident"] == r["transformers"], name
    assert r["logits_rel"] <= TOL, (name, r["logits_rel"])
    assert r["attention_rel"] <= TOL and r["kv_abs"] <= 1e-6, (name, r["attention_rel"], r["kv_abs"])
    assert r["cache_shardings"] == [HOST] and r["cache_committed"], name
    assert r["attention_devices"] == r["output_devices"] == [accelerator], name
    assert r["core_devices"] in ([], ["cpu:0"]), name  # GPT-OSS's sinks were copied to the host


@pytest.mark.slow  # the fast tier runs host attention through placement lightning (test_lightning_placement.py)
@pytest.mark.parametrize("name", ["gpt_oss", "deepseek_v3"])
def test_host_decode_on_one_device_matches_the_resident_model(name):
    host = jax.devices("cpu")[0]
    check_family(name, run_family(name, host, host), "cpu:0")


@pytest.fixture(scope="module")
def two_devices():
    out: dict = {"families": {}}
    for result in run_workers("lightning_worker.py", WORKERS, devices=2, timeout=900):
        out["families"].update(result.pop("families"))
        out.update(result)
    return out


@pytest.mark.slow
def test_host_decode_with_the_cache_on_the_host_device_matches_the_resident_model(two_devices):
    assert sorted(two_devices["families"]) == sorted(FAMILIES)
    for name, r in two_devices["families"].items():
        check_family(name, r, "cpu:1")


@pytest.mark.slow
def test_weights_on_two_devices_are_refused(two_devices):
    assert "on one device" in two_devices["split_weights"] and "cpu:1" in two_devices["split_weights"]


@pytest.fixture(scope="module")
def abstract_model():
    """The layer-by-layer model lightning runs (a resident engine's holds stacked runs of layers)."""
    config = moejax.load(fixture_dir("qwen3_moe"), dtype="float32").config
    return nnx.eval_shape(lambda: MoEModel(config, jnp.float32))


def test_host_cache_is_the_models_layout_on_the_host(abstract_model):
    host = jax.devices("cpu")[0]
    cache = host_kv.allocate(abstract_model, 2, 8)
    want = jax.eval_shape(lambda: abstract_model.init_cache(2, 8))
    assert jax.tree.map(lambda a: (a.shape, a.dtype), cache) == jax.tree.map(lambda a: (a.shape, a.dtype), want)
    assert all(a.devices() == {host} and a.committed for layer in cache for a in layer.values())
    assert host_kv.cache_bytes(cache) == sum(a.size * 4 for a in jax.tree.leaves(want))
    prefill = [{n: np.ones((2, 3) + a.shape[2:], np.float32) for n, a in c.items()} for c in cache]
    cache = host_kv.write_prefill(cache, prefill)  # the old arrays are donated
    assert all(np.asarray(a)[:, :3].all() and not np.asarray(a)[:, 3:].any() for c in cache for a in c.values())
    new = {name: np.full((2, 1) + a.shape[2:], 2.0 + r, np.float32) for r, (name, a) in enumerate(cache[0].items())}
    layer = host_kv.append(cache[0], np.array([[3], [5]], np.int32), new)
    for r, name in enumerate(layer):
        a = np.asarray(layer[name])
        assert (a[0, 3] == 2 + r).all() and (a[1, 5] == 2 + r).all() and (a[:, :3] == 1).all()
        assert np.count_nonzero(a[:, 3:]) == 2 * a[0, 3].size
    assert all(a.devices() == {host} and a.committed for a in layer.values())


def test_bad_host_cache_input_is_refused(abstract_model):
    with pytest.raises(ValueError, match="batch and max_len must be >= 1"):
        host_kv.allocate(abstract_model, 0, 8)
    cache = host_kv.allocate(abstract_model, 2, 8)
    with pytest.raises(ValueError, match="the prefill has 1 layers, the host cache 3"):
        host_kv.write_prefill(cache, cache[:1])
    too_long = [{n: np.zeros((2, 9) + a.shape[2:], np.float32) for n, a in c.items()} for c in cache]
    with pytest.raises(ValueError, match="layer 0 'k' has shape \\(2, 9, 2, 16\\)"):
        host_kv.write_prefill(cache, too_long)
    new = {n: np.zeros((2, 1) + a.shape[2:], np.float32) for n, a in cache[0].items()}
    with pytest.raises(ValueError, match="positions 5..8 outside the cache's \\[0, 8\\)"):
        host_kv.append(cache[0], np.array([[5], [8]]), new)
    with pytest.raises(ValueError, match="new KV names \\['k'\\] are not the cache's \\['k', 'v'\\]"):
        host_kv.append(cache[0], np.array([[5], [6]]), {"k": new["k"]})
    with pytest.raises(ValueError, match="new KV 'v' has shape \\(2, 1, 2\\)"):
        host_kv.append(cache[0], np.array([[5], [6]]), {"k": new["k"], "v": new["v"][..., 0]})
    with pytest.raises(ValueError, match="kind must be 'gqa' or 'mla'"):
        AttentionCore("mha", 1.0)
    with pytest.raises(ValueError, match="backend 'pallas' does not run on the host"):
        HostAttention(abstract_model.layers[0].attn, backend="pallas")
