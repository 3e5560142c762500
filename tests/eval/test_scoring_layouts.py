"""moejax.eval's scoring (log-likelihood and is_greedy, lm-eval's loglikelihood) on the pipeline layout
(attn=pp,experts=pp; one stage here, in-process) equals the one-device float32 engine, its prefix cache's `auto`
running off there (the pipeline keeps no prefix KV) and `on` refused up front."""
import numpy as np
import pytest
from conftest import fixture_dir

import moejax
from moejax.eval.scoring import Scorer

# two contexts of 40 tokens sharing their first 32 (two 16-token blocks), each with two continuations; batches of
# 48 tokens put them in different batches, so `auto` would keep the shared blocks across batches on one device
RNG = np.random.default_rng(7)
SHARED = RNG.integers(1, 100, 32).tolist()
PAIRS = [(SHARED + RNG.integers(1, 100, 8).tolist(), RNG.integers(1, 100, n).tolist()) for n in (1, 3) for _ in (0, 1)]


@pytest.fixture(scope="module")
def pipeline_engine():
    return moejax.load(fixture_dir("qwen3_moe"), dtype="float32", layout="attn=pp,experts=pp")


def test_pipeline_scores_as_one_device(qwen3_engine, pipeline_engine):
    reference = Scorer(qwen3_engine, max_batch_tokens=48)
    want = reference.score(PAIRS)
    assert reference.stats.cached_tokens > 0  # one device keeps the shared blocks: the pipeline must not try to
    scorer = Scorer(pipeline_engine, max_batch_tokens=48)
    got = scorer.score(PAIRS)
    assert scorer.stats.batches > 1 and scorer.stats.cached_tokens == 0
    for (lp, greedy), (lp_ref, greedy_ref) in zip(got, want, strict=True):
        assert lp == pytest.approx(lp_ref, rel=1e-5, abs=1e-5)
        assert greedy == greedy_ref


def test_pipeline_refuses_kv_cache_on(pipeline_engine):
    with pytest.raises(ValueError, match="kv_cache on: layout attn=pp,experts=pp keeps no prefix KV cache"):
        Scorer(pipeline_engine, kv_cache="on")
