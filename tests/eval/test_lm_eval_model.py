"""`--model moejax` in lm-evaluation-harness against lm-eval's own `hf` model.

tests/data/lm_eval/ holds four local YAML tasks over JSONL (2-shot multiple choice whose prompts share a prefix,
0-shot multiple choice with greedy choices, completions to a newline, rolling log-likelihood over several windows)
and hf_reference.json: every request lm-eval built and the hf model's answer, with the task metrics, made once with
torch and transformers by tests/make_lm_eval_reference.py. Here lm-eval builds the same requests for moejax, run
in-process on the Engine; each answer must equal hf's (log-likelihoods within 1e-4, is_greedy and generated text
exactly) and so must the metrics."""
import json
import math
import os
import sys

import pytest

pytest.importorskip("lm_eval")  # the eval extra (also in the test extra: it does not pull torch)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = os.path.join(ROOT, "tests", "data", "lm_eval")
sys.path.insert(0, os.path.join(ROOT, "tests"))
from conftest import fast_tier  # noqa: E402
from make_lm_eval_reference import MODELS, TASKS, run_lm_eval  # noqa: E402

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def reference():
    with open(os.path.join(DATA, "hf_reference.json"), encoding="utf-8") as f:
        return json.load(f)


@pytest.fixture(scope="module", params=fast_tier(list(MODELS), lambda m: m == "qwen3_moe"))
def moejax_run(request, reference):
    """lm-eval's evaluator over the four tasks with --model moejax and the reference's model_args."""
    import moejax.eval.lm_eval_model  # noqa: F401  (registers --model moejax)
    name = request.param
    here = os.getcwd()
    os.chdir(ROOT)  # the task YAMLs name their data relative to the repository root
    try:
        return name, run_lm_eval("moejax", reference["models"][name]["model_args"])
    finally:
        os.chdir(here)


def _close(a: float, b: float, rel: float = 0.0) -> bool:
    return abs(a - b) <= max(TOLERANCE, rel * abs(b))


@pytest.mark.slow  # lm-eval's evaluator over four tasks (about 30 s)
def test_every_answer_equals_hf(moejax_run, reference):
    name, ours = moejax_run
    hf = reference["models"][name]
    for task in TASKS:
        assert ours["requests"][task] == hf["requests"][task], (
            f"{task}: lm-eval {reference['versions']['lm_eval']} built other requests for the reference; rerun "
            "tests/make_lm_eval_reference.py with this lm-eval")
        for k, (mine, theirs) in enumerate(zip(ours["answers"][task], hf["answers"][task], strict=True)):
            where = f"{name} {task} request {k} {hf['requests'][task][k]!r}"
            for (m,), (t,) in zip(mine, theirs, strict=True):  # per instance (a choice): its one answer
                if task == "moejax_gen":
                    assert m == t, where
                elif task == "moejax_rolling":  # a sum over hundreds of tokens: float32 rounding grows with it
                    assert _close(m, t, rel=1e-6), f"{where}: {m} vs hf {t}"
                else:
                    assert _close(m[0], t[0]) and m[1] == t[1], f"{where}: {m} vs hf {t}"


@pytest.mark.slow  # shares test_every_answer_equals_hf's evaluator run (about 30 s)
def test_metrics_equal_hf(moejax_run, reference):
    name, ours = moejax_run
    for task in TASKS:
        theirs = reference["models"][name]["metrics"][task]
        mine = ours["metrics"][task]
        assert set(mine) == set(theirs), task
        for key, value in theirs.items():
            if isinstance(value, float) and not math.isnan(value):
                assert mine[key] == pytest.approx(value, rel=1e-5, abs=1e-9), f"{name} {task} {key}"
            else:
                assert mine[key] == value, f"{name} {task} {key}"


def test_is_greedy_true_for_some(reference):
    """The data exercises both flags (the 0-shot task carries each model's greedy continuation)."""
    for model in reference["models"].values():
        flags = [a[1] for s in model["answers"]["moejax_mc_greedy"] for (a,) in s]
        assert any(flags) and not all(flags)


@pytest.mark.slow  # a CLI run end to end (about 20 s); the evaluator's answers are checked in the fast tier
def test_cli_runs_the_model(tmp_path, monkeypatch):
    """`python -m moejax.eval` is lm-eval's CLI with --model moejax registered: it writes lm-eval's results file."""
    from moejax.eval.__main__ import main
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", ["lm_eval", "--model", "moejax", "--model_args",
                                      "pretrained=tests/fixtures/qwen3_moe,dtype=float32", "--tasks",
                                      "moejax_mc_greedy", "--include_path", DATA, "--limit", "2", "--output_path",
                                      str(tmp_path)])
    main()
    found = [os.path.join(d, f) for d, _, files in os.walk(tmp_path) for f in files if f.startswith("results")]
    assert len(found) == 1
    with open(found[0], encoding="utf-8") as f:
        results = json.load(f)
    assert results["results"]["moejax_mc_greedy"]["sample_len"] == 2
    assert results["config"]["model"] == "moejax"


def test_bad_model_args_are_named():
    from moejax.eval.lm_eval_model import MoejaxLM
    with pytest.raises(TypeError, match="unknown colour"):
        MoejaxLM(pretrained="tiny-qwen3-moe", colour="red")
    with pytest.raises(ValueError, match="no tokenizer.json"):
        MoejaxLM(pretrained="tiny-qwen3-moe")


def test_scorer_shares_contexts_across_batches(qwen3_engine):
    """Contexts sharing a 48-token prefix, in batches of 64 tokens: later batches read the prefix's KV from the
    prefix cache, and every answer equals a plain forward over the pair (Engine.token_logprobs: log-probabilities
    and the top token at each position)."""
    import numpy as np

    from moejax.eval.scoring import Scorer
    rng = np.random.default_rng(3)
    prefix = rng.integers(1, 256, 48).tolist()
    pairs = []
    for _ in range(6):
        ctx = prefix + rng.integers(1, 256, int(rng.integers(2, 9))).tolist()
        pairs += [(ctx, rng.integers(1, 256, int(rng.integers(1, 4))).tolist()) for _ in range(3)]
    forward = qwen3_engine.token_logprobs([c + t for c, t in pairs], 1)
    top = [int(ids[len(c) - 1, 0]) for (c, _), (_, _, ids) in zip(pairs, forward, strict=True)]
    pairs += [(c, [t]) for (c, _), t in zip(pairs[::3], top[::3], strict=True)]  # greedy continuations: is_greedy true
    forward += qwen3_engine.token_logprobs([c + t for c, t in pairs[-6:]], 1)
    scorer = Scorer(qwen3_engine, max_batch_tokens=64)
    got = scorer.score(pairs)
    assert scorer.stats.batches > 1 and scorer.stats.cached_tokens > 0
    for (ctx, cont), (logprob, greedy), (chosen, _, ids) in zip(pairs, got, forward, strict=True):
        span = slice(len(ctx) - 1, len(ctx) - 1 + len(cont))
        assert logprob == pytest.approx(float(chosen[span].sum()), abs=TOLERANCE)
        assert greedy == bool((ids[span, 0] == np.asarray(cont)).all())
    assert sum(g for _, g in got) >= 6
