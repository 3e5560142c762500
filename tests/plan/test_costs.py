"""Analytic FLOPs and parameter counts (moejax.costs) against hand counts and the model's own params."""
import jax
import numpy as np
import pytest

import moejax
from moejax import costs
from moejax.config import ModelConfig
from moejax.presets import preset_config


def test_causal_pairs():
    assert costs.causal_pairs(4) == 10
    assert costs.causal_pairs(6, window=2) == 1 + 2 * 5
    assert costs.causal_pairs(3, window=10) == 6


@pytest.mark.parametrize("name", moejax.presets())
def test_param_count_matches_the_model_parameters(name):
    engine = moejax.load(name)
    n = sum(int(np.prod(v.shape)) for v in jax.tree.leaves(engine.abstract_params))
    assert costs.param_count(engine.config) == n


def test_qwen3_30b_prefill_flops_by_hand():
    cfg = ModelConfig.from_hf(preset_config("qwen3-30b-a3b")).replace(num_layers=1)
    f = costs.prefill_flops(cfg, 1, 8)
    assert f.experts == 6 * 8 * 8 * 2048 * 768
    assert f.router == 2 * 8 * 2048 * 128
    assert f.attn_proj == 2 * 8 * (2048 * (32 + 8) * 128 + 32 * 128 * 2048)
    assert f.attn_scores == 32 * 36 * 2 * 256
    assert f.lm_head == 2 * 8 * 2048 * 151936
    assert f.total == sum(v for k, v in f.as_dict().items() if k != "total")
    assert 3.0e9 < costs.active_param_count(ModelConfig.from_hf(preset_config("qwen3-30b-a3b"))) < 3.6e9
