"""Prefill loads, decode predicts (Speculating Experts' setting): the cached placement with prefill="stream"
streams every expert of each layer into prefill passes and keeps its cache and predictor for decode."""
import numpy as np
import pytest
from conftest import fixture_dir

import moejax

NAME = "gpt_oss"  # 8 experts, top-2, three MoE layers
PROMPTS = [[5, 9, 2, 7, 11, 3], [4, 8]]


@pytest.fixture(scope="module")
def resident():
    return moejax.load(fixture_dir(NAME), dtype="float32")


@pytest.fixture(scope="module")
def streamed():
    # 4 slots: too few for a prefill's experts through the cache, enough for decode
    return moejax.load(fixture_dir(NAME), dtype="float32", placement="cached", cache_slots=4,
                       prefill_experts="stream")


def test_a_prefill_streams_every_expert_and_leaves_the_cache_alone(resident, streamed):
    ids = np.array([p[:2] * 4 for p in PROMPTS])
    streamed.reset_stats()
    np.testing.assert_allclose(streamed.logits(ids), resident.logits(ids), rtol=1e-6, atol=1e-6)
    cfg, stats = streamed.config, streamed.stats()
    moe_layers = [i for i in range(cfg.num_layers) if cfg.is_moe(i)]
    assert [stats["layers"][i]["streamed_experts"] for i in moe_layers] == [cfg.num_experts] * len(moe_layers)
    assert stats["total"]["hits"] == stats["total"]["misses"] == stats["total"]["prefetches"] == 0
    assert "prefill passes stream every expert" in streamed.explain()


def test_decode_goes_through_the_cache_after_a_streamed_prefill(resident, streamed):
    streamed.reset_stats()
    assert streamed.generate(PROMPTS, 5) == resident.generate(PROMPTS, 5)
    cfg, total = streamed.config, streamed.stats()["total"]
    moe_layers = sum(cfg.is_moe(i) for i in range(cfg.num_layers))
    assert total["streamed_experts"] == cfg.num_experts * moe_layers  # the one prefill pass
    assert total["hits"] + total["misses"] > 0  # the decode steps used the cache


def test_prefill_experts_is_checked():
    with pytest.raises(ValueError, match="prefill_experts must be one of cache, stream"):
        moejax.load(fixture_dir(NAME), placement="cached", prefill_experts="resident")
