"""Weights per device under each layout (moejax.sharding.memory), from the abstract shapes of Qwen3-30B-A3B in
bfloat16 (nothing allocated, no devices needed: layouts are resolved against 8 hypothetical devices), and the
load-time refusal with the numbers when a device cannot hold its share."""
import numpy as np
import pytest

import moejax
from moejax.models.moe import is_routed_expert
from moejax.offload.memory_budget import size
from moejax.sharding import Layout
from moejax.sharding.memory import check_fits, device_weights

GiB = 2**30


@pytest.fixture(scope="module")
def model():
    engine = moejax.load("qwen3-30b-a3b")  # lazy: weights are never created
    shapes = engine.param_shapes()
    nbytes = lambda a: int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize  # noqa: E731
    experts = {path: nbytes(a) for path, a in shapes.items() if is_routed_expert(path)}
    return engine.config, shapes, sum(map(nbytes, shapes.values())) - sum(experts.values()), experts


def resolved(spec, cfg):
    return Layout.parse(spec).resolve(cfg.num_experts, 8, expert_width=cfg.moe_intermediate_size, heads=cfg.num_heads)


def test_each_layout_holds_its_share(model):
    cfg, shapes, rest, experts = model
    total = sum(experts.values())
    first = sum(v for path, v in experts.items() if path[1] == 0)  # every Qwen3-30B layer is MoE
    per = lambda spec, heads=set(): device_weights(shapes, resolved(spec, cfg), 0, heads)  # noqa: E731
    assert (per("attn=dp,experts=replicated").rest, per("attn=dp,experts=replicated").experts) == (rest, total)
    assert per("attn=dp,experts=ep").experts == per("attn=dp,experts=tp").experts == total // 8
    assert per("attn=dp,experts=async_ep").experts == (total - first) // 8 + 2 * first  # + one gathered layer
    dep = per("attn=dp,experts=dep,attn_devices=4,expert_devices=4")
    assert (dep.rest, dep.experts, dep.expert_device_experts) == (rest, 0, total // 4)
    # attn=tp: q and o split by heads (32 of them; the 4 kv heads do not divide 8, so k and v stay whole)
    split = [int(np.prod(a.shape)) * 2 for path, a in shapes.items()
             if len(path) == 4 and path[2] == "attn" and path[3] in ("wq", "wo")]
    assert len(split) == 2 * cfg.num_layers
    heads = per("attn=tp,experts=ep", {"wq", "wo"})
    assert (heads.rest, heads.experts) == (rest - sum(split) + sum(b // 8 for b in split), total // 8)


def test_a_device_that_cannot_hold_its_share_is_refused_with_the_numbers(model):
    cfg, shapes, rest, experts = model
    ep = device_weights(shapes, resolved("attn=dp,experts=ep", cfg), 0, set())
    check_fits(ep, 16 * GiB)  # ~2.9 GiB + 54 GiB / 8 fits in 16 GB less the reserve
    replicated = device_weights(shapes, resolved("attn=dp,experts=replicated", cfg), 0, set())
    with pytest.raises(ValueError, match=f"per device: {size(rest + sum(experts.values()))} of weights .* over the "
                                         "14.40 GiB a device has for weights \\(budget 16.00 GiB"):
        check_fits(replicated, 16 * GiB)
    with pytest.raises(ValueError, match="cannot fit: per device: 56.89 GiB of weights"):  # through the loader
        moejax.load("qwen3-30b-a3b", device_memory_gb=16, layout="attn=dp,experts=replicated")
