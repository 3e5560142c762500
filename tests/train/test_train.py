"""Training the embedded model on a micro config: the loss falls, a run stopped by SIGTERM or killed
with SIGKILL resumes to the very parameters of an uninterrupted run, and the export loads back into moejax with
the training forward's logits."""
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import kill_when_journal_has

import moejax
from moejax.train.checkpoints import RunCheckpoints
from moejax.train.export import export
from moejax.train.loop import Run, Settings, train
from moejax.train.model import TrainModel

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MICRO = Settings(config="micro", steps=40, batch=4, seq_len=64, max_files=40, warmup_steps=4, peak_lr=3e-3,
                 eval_every=20, eval_windows=8, checkpoint_every=5)


def flags(s: Settings) -> list[str]:
    return [a for name, v in dataclasses.asdict(s).items() if v is not None
            for a in ("--" + name.replace("_", "-"), str(v))]


def metrics(out) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def same_params(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(np.asarray(a[k]), np.asarray(b[k])) for k in a)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted micro run: (Run, train()'s result)."""
    run = Run(str(tmp_path_factory.mktemp("train") / "run"), MICRO, log=lambda *a: None)
    return run, train(run, progress=False)


def test_a_micro_run_lowers_the_held_out_loss(reference):
    run, result = reference
    assert result["step"] == MICRO.steps and result["stopped_by"] is None
    rows = metrics(run.out)
    assert [r["step"] for r in rows] == list(range(1, MICRO.steps + 1))
    first, last = rows[0], rows[-1]
    assert last["held_out_ce"] < first["ce"] - 0.5  # from ln(512) = 6.24 at init
    assert all(np.isfinite(r["loss"]) and r["balance"] >= 0.99 for r in rows)  # 1 = perfectly balanced
    assert rows[MICRO.warmup_steps]["lr"] == pytest.approx(MICRO.peak_lr) and last["lr"] < MICRO.peak_lr / 2
    assert last["tokens_seen"] == MICRO.steps * MICRO.batch * MICRO.seq_len


@pytest.mark.slow  # three training runs (about 14 s)
def test_sigterm_saves_and_resume_reaches_the_uninterrupted_parameters(reference, tmp_path):
    run = Run(str(tmp_path / "run"), MICRO, log=lambda *a: None)
    journal = os.path.join(run.out, "metrics.jsonl")

    def stop_soon():  # SIGTERM once a few steps are in (the handler only sets a flag the loop reads)
        while not os.path.exists(journal) or open(journal).read().count("\n") < 7:
            threading.Event().wait(0.01)
        os.kill(os.getpid(), signal.SIGTERM)
    threading.Thread(target=stop_soon, daemon=True).start()
    stopped = train(run, progress=False)
    assert stopped["stopped_by"] == "SIGTERM" and 7 <= stopped["step"] < MICRO.steps
    assert RunCheckpoints(os.path.join(run.out, "checkpoints")).latest_step() == stopped["step"]
    resumed = train(Run(run.out, resume=True), progress=False)
    assert resumed["step"] == MICRO.steps and same_params(resumed["params"], reference[1]["params"])


@pytest.mark.slow
def test_sigkill_then_resume_reaches_the_uninterrupted_parameters(reference, tmp_path):
    out = str(tmp_path / "run")
    command = [sys.executable, "-m", "launch.train", "--out", out, "--no-progress", *flags(MICRO)]
    child = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    kill_when_journal_has(child, os.path.join(out, "metrics.jsonl"), 8, timeout=240)  # step 5 saved
    assert child.returncode == -signal.SIGKILL
    killed_at = len(metrics(out))
    assert killed_at < MICRO.steps
    r = subprocess.run(command[:5] + ["--resume", "--no-progress", "--no-export"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "resumed from the checkpoint at step" in r.stdout
    params, position = RunCheckpoints(os.path.join(out, "checkpoints")).params_at()
    assert position["step"] == MICRO.steps and same_params(params, reference[1]["params"])
    # the steps after the checkpoint ran again and their first lines were dropped: one line per step, and the
    # same numbers as the uninterrupted run's
    timing = ("tokens_per_s", "wall_s")
    assert [{k: v for k, v in row.items() if k not in timing} for row in metrics(out)] == \
        [{k: v for k, v in row.items() if k not in timing} for row in metrics(reference[0].out)]


def test_resume_refuses_other_settings(reference):
    run = reference[0]
    with pytest.raises(SystemExit, match="steps"):
        from launch.train import main
        main(["--out", run.out, "--resume", "--steps", "41"])


@pytest.fixture(scope="module")
def exported(reference, tmp_path_factory):
    target = str(tmp_path_factory.mktemp("export") / "micro")
    export(reference[0], reference[1], target, dtype="float32")
    return target


def test_export_loads_into_moejax_with_the_training_logits(reference, exported):
    run, result = reference
    target = exported
    assert sorted(os.listdir(target)) == ["README.md", "config.json", "generation_config.json",
                                          "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    ids = run.held_out_tokens[:48][None]
    want, _ = TrainModel(run.cfg).apply(result["params"], jnp.asarray(ids))
    engine = moejax.load(target)  # dtype auto: the export's float32
    assert engine.dtype == jnp.float32 and engine.config.eos_token_ids == (run.eos_id,)
    np.testing.assert_allclose(engine.logits(ids), np.asarray(want), atol=2e-5, rtol=0)
    text = "def f(x):\n    return x + 1\n"
    assert engine.tokenizer.decode(engine.tokenizer.encode(text).ids) == text
    card = open(os.path.join(target, "README.md")).read()
    assert f"{MICRO.steps} steps" in card and "perplexity" in card and "| 1 |" in card  # both layers' load


@pytest.mark.slow  # the quality bench end to end (about 10 s)
def test_quality_bench_measures_what_the_logits_say(reference, exported, tmp_path):
    from launch.bench.cli import main
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "a.py").write_text("import os\n\ndef main():\n    print(os.getcwd())\n" * 6)
    (texts / "b.txt").write_text("for i in range(10):\n    total += i\n" * 8)
    out = tmp_path / "quality.json"
    main(["quality", "--model", exported, "--text", str(texts), "--bigram-text", str(texts), "--window", "32",
          "--out", str(out)])
    q = json.loads(out.read_text())["runs"][0]
    engine = moejax.load(exported)
    ids = []
    for name in ("a.py", "b.txt"):  # sorted files, each followed by the end-of-text token
        ids += engine.tokenizer.encode((texts / name).read_text()).ids + [reference[0].eos_id]
    n = (len(ids) - 1) // 32
    rows = np.array([ids[i * 32:i * 32 + 33] for i in range(n)])
    logp = engine.logits(rows[:, :-1])
    logp = logp - np.log(np.exp(logp - logp.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logp.max(
        -1, keepdims=True)
    nll = -np.take_along_axis(logp, rows[:, 1:, None], axis=-1).mean()
    assert q["tokens"] == n * 32 and q["perplexity"] == pytest.approx(np.exp(nll), rel=1e-4)
    assert q["top1_accuracy"] == pytest.approx(np.mean(logp.argmax(-1) == rows[:, 1:]))
    shares = np.asarray(q["expert_share"])
    assert shares.shape == (2, 4) and np.allclose(shares.sum(1), 1)
    # the bigram fit on the very text it scores, which repeats: nearly every next token is certain
    assert q["bigram_perplexity"] < 1.5 and q["bigram_top1_accuracy"] > 0.8
    assert q["device"]["kind"] and q["versions"]["jax"]
