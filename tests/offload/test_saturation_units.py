"""Θ and the batches admitted at Θ are counted in one unit, true FLOPs (moejax.costs.true_prefill_flops): Eq. 3's
reference row is counted as the scheduler counts a batch, so a long-context batch admitted at Θ holds the compute
that Θ stands for. Pure functions over the tiny config: no engine, no compile."""
import numpy as np
import pytest

from moejax.config import ModelConfig
from moejax.offload.saturation import saturation_from_times
from moejax.presets import preset_config
from moejax.sched.batch_schedule import pack_score_batches, tree_flops
from moejax.sched.packing import ScoreSeq

TINY = ModelConfig.from_hf(preset_config("tiny-qwen3-moe"))
REF_TOKENS = 512
SLOWDOWN = 4.0  # the slowest streamed layer takes 4x the first MoE layer's compute-only time


def _row(rng, n):
    tokens = tuple(int(t) for t in rng.integers(0, TINY.vocab_size, n))
    return [ScoreSeq(tokens, n, 0, ())]


def _timings():
    moe = [i for i, is_moe in enumerate(TINY.moe_layers) if is_moe]
    compute = {layer: 1e-3 for layer in moe}
    streamed = {layer: 1e-3 for layer in moe}
    streamed[moe[-1]] = SLOWDOWN * 1e-3
    return compute, streamed


def test_a_long_context_batch_admitted_at_eq3_theta_holds_the_compute_it_stands_for():
    """Θ = (1+ε)·4·F_ref stands for 4.4 reference rows of compute. Rows of 1024 tokens attend far more per token
    than the 512-token reference row; counted in one unit, the batch admitted at Θ still holds 4.4 reference rows
    (with matmul-only F_ref it was admitted with one row, 0.63 of that)."""
    rng = np.random.default_rng(0)
    flops_of = tree_flops(TINY)
    ref_row = _row(rng, REF_TOKENS)
    sat = saturation_from_times(TINY, REF_TOKENS, *_timings())
    assert sat.ref_flops == pytest.approx(flops_of(ref_row))  # the reference row counted as a batch is
    stands_for = (1 + sat.epsilon) * SLOWDOWN * flops_of(ref_row)
    assert sat.theta_flops == pytest.approx(stands_for)
    trees = [_row(rng, 1024) for _ in range(8)]
    batches = pack_score_batches(trees, 1024, sat.theta_flops, flops_of)
    held = [sum(flops_of([s]) for row in b.rows for s in row) for b in batches]
    assert all(h >= stands_for for h in held[:-1]), (held, stands_for)
    # Θ in tokens is the no-context bound: the long rows reach Θ with fewer tokens, never more
    first = sum(len(s.tokens) for row in batches[0].rows for s in row)
    assert first <= sat.theta_tokens


def test_eq3_timings_of_different_layers_are_a_clear_error():
    compute, streamed = _timings()
    streamed.pop(max(streamed))
    with pytest.raises(ValueError, match="same MoE layers"):
        saturation_from_times(TINY, REF_TOKENS, compute, streamed)
