"""placement lightning through moejax.eval: its decode batch is `decode_batch` in --model_args, which does not collide
with the batch_size lm-eval passes every model (its --batch_size); scoring and greedy generation equal the
one-device float32 engine."""
import pytest

pytest.importorskip("lm_eval")

from conftest import fixture_dir  # noqa: E402

from moejax.eval.generation import Completion, generate  # noqa: E402
from moejax.eval.scoring import Scorer  # noqa: E402
from moejax.sampling import SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow  # compiles the lightning placement's steps (about 30 s)

POLICY = "decode_batch=4,micro_batch=2,resident_share=0.5,kv_device_share=0.0,attention_on=host"
PAIRS = [([1, 2, 3, 4, 5], [6, 7]), ([1, 2, 3, 9], [10])]
JOBS = [Completion((1, 2, 3, 4), 5, (), SamplingParams(seed=0)),
        Completion((5, 6, 7), 5, (), SamplingParams(seed=1))]


def test_lightning_model_args_beside_lm_evals_batch_size(qwen3_engine):
    from moejax.eval.lm_eval_model import MoejaxLM
    # as lm-eval's CLI builds the model: --model_args parsed, then its own batch_size, max_batch_size and device
    lm = MoejaxLM.create_from_arg_string(f"pretrained={fixture_dir('qwen3_moe')},dtype=float32,placement=lightning,"
                                         f"{POLICY}", {"batch_size": 8, "max_batch_size": None, "device": None})
    plan = lm.engine.memory_budget.lightning
    assert (plan.N, plan.mu) == (4, 2)
    for (lp, greedy), (lp_ref, greedy_ref) in zip(lm.scorer.score(PAIRS), Scorer(qwen3_engine).score(PAIRS),
                                                  strict=True):
        assert lp == pytest.approx(lp_ref, rel=1e-5, abs=1e-5) and greedy == greedy_ref
    assert generate(lm.engine, JOBS, str) == generate(qwen3_engine, JOBS, str)
