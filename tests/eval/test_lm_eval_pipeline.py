"""lm-eval's loglikelihood tasks with `--model moejax` under the pipeline layout (attn=pp,experts=pp; one stage
in-process): the scoring goes through the Engine's steps (Steps.greedy_score, the pipeline's stage program), so every
answer equals lm-eval's own `hf` model's, as on one device (tests/eval/test_lm_eval_model.py). The pipeline runs
prefill only: a generation task is refused in one line."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("lm_eval")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = os.path.join(ROOT, "tests", "data", "lm_eval")
sys.path.insert(0, os.path.join(ROOT, "tests"))
from make_lm_eval_reference import run_lm_eval  # noqa: E402

SCORING_TASKS = ["moejax_mc", "moejax_mc_greedy", "moejax_rolling"]  # loglikelihood and loglikelihood_rolling
TOLERANCE = 1e-4


@pytest.mark.slow  # lm-eval's evaluator over three tasks (about 20 s)
def test_lm_eval_scores_under_the_pipeline_layout_as_hf(monkeypatch):
    import moejax.eval.lm_eval_model  # noqa: F401  (registers --model moejax)
    with open(os.path.join(DATA, "hf_reference.json"), encoding="utf-8") as f:
        hf = json.load(f)["models"]["qwen3_moe"]
    monkeypatch.chdir(ROOT)  # the task YAMLs name their data relative to the repository root
    ours = run_lm_eval("moejax", {**hf["model_args"], "layout": "attn=pp,experts=pp"}, tasks=SCORING_TASKS)
    for task in SCORING_TASKS:
        assert ours["requests"][task] == hf["requests"][task], task
        for k, (mine, theirs) in enumerate(zip(ours["answers"][task], hf["answers"][task], strict=True)):
            for (m,), (t,) in zip(mine, theirs, strict=True):
                if task == "moejax_rolling":  # a sum over hundreds of tokens: float32 rounding grows with it
                    assert abs(m - t) <= max(TOLERANCE, 1e-6 * abs(t)), f"{task} request {k}: {m} vs hf {t}"
                else:
                    assert abs(m[0] - t[0]) <= TOLERANCE and m[1] == t[1], f"{task} request {k}: {m} vs hf {t}"


@pytest.mark.slow  # python -m moejax.eval as a subprocess (about 15 s)
def test_a_generation_task_under_the_pipeline_layout_is_one_line(tmp_path):
    """generate_until cannot run on the pipeline (prefill only): one line naming the layout, exit status 2, no
    traceback and no results file, instead of every request failing in the continuous scheduler."""
    args = json.dumps({"pretrained": "tests/fixtures/qwen3_moe", "dtype": "float32", "layout": "attn=pp,experts=pp"})
    r = subprocess.run([sys.executable, "-m", "moejax.eval", "--model", "moejax", "--model_args", args, "--tasks",
                        "moejax_gen", "--include_path", DATA, "--limit", "1", "--output_path", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("python -m moejax.eval: --model_args: layout attn=pp,experts=pp") and \
        "generate_until" in last, last
    assert os.listdir(tmp_path) == []
