"""The host store keeps routed expert weights in pinned host memory and brings them back unchanged."""
import numpy as np
import pytest

import moejax
from moejax.offload import HOST_LIMIT_ENV, HostStore, is_routed_expert, pinned_host_limit_bytes


@pytest.fixture(scope="module")
def expert_arrays():
    engine = moejax.load("tiny-qwen3-moe", dtype="float32")  # its layers stacked: each layer's experts by its path
    layers = sorted({p[1] for p in engine.param_shapes() if is_routed_expert(p)})
    return {("layers", layer, "mlp", name): a for layer in layers for name, a in engine.layer_experts(layer).items()}


def test_arrays_live_in_pinned_host_and_fetch_returns_them_on_device(expert_arrays):
    store = HostStore.from_arrays(expert_arrays.items())
    assert store.layers == sorted({p[1] for p in expert_arrays})
    for layer in store.layers:
        for host in store.arrays(layer).values():
            assert host.sharding.memory_kind == "pinned_host"
        fetched = store.fetch(layer)
        assert set(fetched) == {p[3] for p in expert_arrays if p[1] == layer}
        for name, dev in fetched.items():
            assert dev.sharding.memory_kind == "device"
            np.testing.assert_array_equal(np.asarray(dev), np.asarray(expert_arrays[("layers", layer, "mlp", name)]))
    assert store.total_bytes() == sum(a.nbytes for a in expert_arrays.values())


def test_numpy_arrays_from_a_checkpoint_go_straight_to_host(expert_arrays):
    path, array = next(iter(expert_arrays.items()))
    store = HostStore.from_arrays([(path, np.asarray(array))])
    assert store.arrays(path[1])[path[3]].sharding.memory_kind == "pinned_host"
    assert store.layer_bytes(path[1]) == array.nbytes


def test_only_routed_expert_arrays_are_accepted():
    with pytest.raises(ValueError, match=r"\('layers', 0, 'attn', 'wq'\) is not a routed expert array"):
        HostStore.from_arrays([(("layers", 0, "attn", "wq"), np.zeros(2, np.float32))])


def test_gpu_pinned_host_pool_follows_the_xla_setting(monkeypatch):
    assert pinned_host_limit_bytes("cpu") is None
    monkeypatch.delenv(HOST_LIMIT_ENV, raising=False)
    assert pinned_host_limit_bytes("gpu") == 64 * 2**30
    monkeypatch.setenv(HOST_LIMIT_ENV, "200")
    assert pinned_host_limit_bytes("gpu") == 200 * 2**30


def test_a_store_over_the_pool_is_refused_with_the_numbers(expert_arrays):
    total = sum(a.nbytes for a in expert_arrays.values())
    HostStore.from_arrays(expert_arrays.items(), limit_bytes=total)  # exactly fits
    with pytest.raises(ValueError, match=rf"more than .* GiB of pinned host memory, over XLA's pool of .* GiB; "
                                         rf"set {HOST_LIMIT_ENV} higher"):
        HostStore.from_arrays(expert_arrays.items(), limit_bytes=total - 1)


@pytest.mark.parametrize("placement", ["streamed", "cached"])
def test_experts_beyond_pinned_memory_stage_through_a_bounded_buffer(placement):
    """MoE-Lightning §4.1: with pinned_staging_mb the experts stay in pageable host memory (numpy) and every copy
    goes CPU -> pinned -> device through a buffer far smaller than the experts (one layer's or four experts'
    worth here); the pinned bytes held never exceed it, and the logits are the resident model's. Before, there
    was no such setting: every expert lived in pinned memory."""
    resident = moejax.load("tiny-qwen3-moe", dtype="float32")
    shapes = resident.param_shapes()
    moe_layers = sorted({p[1] for p in shapes if is_routed_expert(p)})
    layer_bytes = sum(int(np.prod(a.shape)) * 4 for p, a in shapes.items() if is_routed_expert(p) and p[1] == 0)
    E = resident.config.num_experts
    bound = layer_bytes if placement == "streamed" else 4 * layer_bytes // E
    options = dict(window=1) if placement == "streamed" else dict(cache_slots=E)
    engine = moejax.load("tiny-qwen3-moe", dtype="float32", placement=placement, pinned_staging_mb=bound / 2**20,
                         **options)
    store = engine.layered_steps.placement.store
    assert store.total_bytes() == len(moe_layers) * layer_bytes > 2 * bound
    assert all(isinstance(a, np.ndarray) or isinstance(a[0], np.ndarray) for a in store.arrays(moe_layers[0]).values())
    ids = np.random.default_rng(0).integers(0, resident.config.vocab_size, (2, 12))
    np.testing.assert_allclose(engine.logits(ids), resident.logits(ids), rtol=1e-5, atol=1e-5)
    assert 0 < store.peak_staged_bytes <= bound
    with pytest.raises(ValueError, match="pinned_staging_mb applies to placement"):
        moejax.load("tiny-qwen3-moe", placement="resident", pinned_staging_mb=1.0)
