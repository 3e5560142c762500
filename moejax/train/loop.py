"""The training run: tokenizer and token streams prepared once in the run directory, then an optax loop
(AdamW, linear warm-up then cosine decay, global-norm clipping) over the flat parameters of TrainModel, with
orbax checkpoints every few minutes and on SIGTERM/SIGINT, a progress bar, and metrics as JSON lines.

Run directory: run.json (settings, corpus description), tokenizer/, tokens-{train,held_out}.npy, checkpoints/,
metrics.jsonl. `resume` continues from the newest checkpoint with the saved settings and reaches the same
parameters as an uninterrupted run (batches depend only on (seed, step); CPU float32 programs are deterministic).
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tokenizers import Tokenizer
from tqdm import tqdm

from moejax.config import ModelConfig
from moejax.train import corpus
from moejax.train.checkpoints import RunCheckpoints
from moejax.train.configs import train_config
from moejax.train.data import batch_at, eval_windows, tokenize_files
from moejax.train.model import LOAD_BALANCE_COEF, Z_LOSS_COEF, TrainModel, loss_fn
from moejax.train.tokenizer import END_OF_TEXT, save_tokenizer, train_tokenizer


@dataclasses.dataclass(frozen=True)
class Settings:
    config: str = "pycode-moe"
    steps: int = 1400
    batch: int = 8
    seq_len: int = 512
    peak_lr: float = 2e-3
    warmup_steps: int = 70
    final_lr_ratio: float = 0.1  # cosine decays to peak_lr * this at the last step
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    seed: int = 0
    max_files: int | None = None  # use only the first N train files (tests)
    checkpoint_minutes: float = 5.0
    checkpoint_every: int | None = None  # also every N steps (tests)
    eval_every: int = 100
    eval_windows: int = 16  # held-out windows per evaluation

    def validate(self) -> None:
        for name in ("steps", "batch", "seq_len", "eval_every", "eval_windows"):
            if getattr(self, name) < 1:
                raise ValueError(f"train: {name} must be >= 1; got {getattr(self, name)}")
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"train: warmup_steps must be in [0, steps); got {self.warmup_steps}")
        if self.peak_lr <= 0 or self.clip_norm <= 0:
            raise ValueError("train: peak_lr and clip_norm must be > 0")


def optimizer(s: Settings) -> tuple[optax.GradientTransformation, Callable[[int], Any]]:
    schedule = optax.warmup_cosine_decay_schedule(0.0, s.peak_lr, max(s.warmup_steps, 1), s.steps,
                                                  end_value=s.peak_lr * s.final_lr_ratio)
    # no weight decay on norm scales (1-D)
    decay_mask = lambda params: {n: p.ndim > 1 for n, p in params.items()}  # noqa: E731
    return optax.chain(optax.clip_by_global_norm(s.clip_norm),
                       optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=s.weight_decay, mask=decay_mask)), \
        schedule


class Run:
    """A run directory, prepared (tokenizer, tokens, run.json) or reopened."""

    def __init__(self, out: str, settings: Settings | None = None, *, resume: bool = False,
                 log: Callable[[str], None] = print) -> None:
        self.out, self.log = out, log
        run_json = os.path.join(out, "run.json")
        if resume:
            if not os.path.isfile(run_json):
                raise FileNotFoundError(f"train --resume: {out} holds no run.json (not a run directory)")
            with open(run_json) as f:
                saved = json.load(f)
            self.settings = Settings(**saved["settings"])
            if settings is not None and settings != self.settings:
                diff = {k: (v, getattr(settings, k)) for k, v in dataclasses.asdict(self.settings).items()
                        if getattr(settings, k) != v}
                raise ValueError(f"train --resume: settings differ from the run's run.json (saved, given): {diff}")
            self.corpus = saved["corpus"]
        else:
            if os.path.exists(os.path.join(out, "checkpoints")):
                raise FileExistsError(f"train: {out} already holds a run; pass --resume or another --out")
            self.settings = settings or Settings()
            self.settings.validate()
            self._prepare()
        self.tokenizer = Tokenizer.from_file(os.path.join(out, "tokenizer", "tokenizer.json"))
        eos_id = self.tokenizer.token_to_id(END_OF_TEXT)
        assert eos_id is not None, f"{END_OF_TEXT} is not in the run's tokenizer"  # _prepare trains it in
        self.eos_id = eos_id
        self.hf_config = train_config(self.settings.config, eos_token_id=self.eos_id)
        self.cfg = ModelConfig.from_hf(self.hf_config)
        self.train_tokens = np.load(os.path.join(out, "tokens-train.npy"))
        self.held_out_tokens = np.load(os.path.join(out, "tokens-held_out.npy"))

    def _prepare(self) -> None:
        s = self.settings
        os.makedirs(self.out, exist_ok=True)
        root = corpus.stdlib_dir()
        train_files, held_out_files = corpus.split(corpus.source_files(root))
        if s.max_files is not None:
            train_files, held_out_files = train_files[:s.max_files], held_out_files[:max(1, s.max_files // 10)]
        vocab = train_config(s.config, eos_token_id=0)["vocab_size"]
        t0 = time.time()
        tok = train_tokenizer((corpus.read_source(os.path.join(root, f)) for f in train_files), vocab)
        save_tokenizer(tok, os.path.join(self.out, "tokenizer"),
                       max_length=train_config(s.config, eos_token_id=0)["max_position_embeddings"])
        eos = tok.token_to_id(END_OF_TEXT)
        assert eos is not None  # train_tokenizer makes it a special token
        train = tokenize_files(tok, root, train_files, eos)
        held_out = tokenize_files(tok, root, held_out_files, eos)
        np.save(os.path.join(self.out, "tokens-train.npy"), train)
        np.save(os.path.join(self.out, "tokens-held_out.npy"), held_out)
        described = corpus.describe(root)
        described.update(used_train_files=len(train_files), used_held_out_files=len(held_out_files),
                         train_tokens=int(len(train)), held_out_tokens=int(len(held_out)))
        self.corpus = described
        self.log(f"tokenizer (vocab {vocab}) and {len(train)} train / {len(held_out)} held-out tokens "
                 f"in {time.time() - t0:.1f} s")
        with open(os.path.join(self.out, "run.json"), "w") as f:
            json.dump(dict(settings=dataclasses.asdict(s), corpus=described,
                           model=train_config(s.config, eos_token_id=eos),
                           loss=dict(load_balance_coef=LOAD_BALANCE_COEF, z_loss_coef=Z_LOSS_COEF)), f, indent=1)


class _StopRequest:
    """SIGTERM/SIGINT set a flag; the loop saves a checkpoint after the step in flight and stops."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._old: dict = {}  # signal -> the handler it had

    def __enter__(self) -> _StopRequest:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signal = signum

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


def _drop_metrics_after(path: str, step: int) -> None:
    if not os.path.exists(path):
        return
    with open(path) as f:
        keep = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
    with open(path + ".tmp", "w") as f:
        f.writelines(keep)
    os.replace(path + ".tmp", path)


def train(run: Run, *, progress: bool | None = None) -> dict:
    """Train until settings.steps (from the newest checkpoint if any). -> {"params", "step", "stopped_by",
    "wall_s", "tokens_seen"}; stopped_by is None when the run completed."""
    s = run.settings
    model = TrainModel(run.cfg)
    tx, schedule = optimizer(s)
    params = model.init(s.seed)
    state = dict(params=params, opt_state=tx.init(params))
    ckpts = RunCheckpoints(os.path.join(run.out, "checkpoints"))
    step, wall_before, tokens_seen = 0, 0.0, 0
    latest = ckpts.latest_step()
    if latest is not None:
        state, restored = ckpts.restore(latest, state)
        step, wall_before, tokens_seen = restored["step"], restored["wall_s"], restored["tokens_seen"]
        run.log(f"resumed from the checkpoint at step {step} ({tokens_seen} tokens seen)")
        _drop_metrics_after(os.path.join(run.out, "metrics.jsonl"), step)  # those steps run again

    @jax.jit
    def train_step(state: dict, window: jax.Array) -> tuple[dict, dict]:
        (_, metrics), grads = jax.value_and_grad(lambda p: loss_fn(model, p, window), has_aux=True)(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        metrics["grad_norm"] = optax.tree.norm(grads)
        return dict(params=optax.apply_updates(state["params"], updates), opt_state=opt_state), metrics

    @jax.jit
    def eval_step(params: dict, window: jax.Array) -> dict:
        return loss_fn(model, params, window)[1]

    held_out = eval_windows(run.held_out_tokens, s.seq_len, s.eval_windows)

    def evaluate(params: dict) -> dict:
        metrics = [eval_step(params, jnp.asarray(held_out[i:i + s.batch])) for i in range(0, len(held_out), s.batch)]
        return {f"held_out_{k}": float(np.mean([m[k] for m in metrics])) for k in ("ce", "top1")}

    def position() -> dict:
        return dict(step=step, data_position=step, tokens_seen=tokens_seen,
                    wall_s=wall_before + time.time() - t_start)

    metrics_file = open(os.path.join(run.out, "metrics.jsonl"), "a")
    bar = tqdm(total=s.steps, initial=step, disable=None if progress is None else not progress, unit="step",
               dynamic_ncols=True)
    t_start = last_save = time.time()
    window_tokens = s.batch * s.seq_len
    stopped_by = None
    try:
        with _StopRequest() as stop:
            while step < s.steps:
                t0 = time.time()
                window = jnp.asarray(batch_at(run.train_tokens, step, s.batch, s.seq_len, s.seed))
                state, metrics = train_step(state, window)
                metrics = {k: float(v) for k, v in metrics.items()}
                step += 1
                tokens_seen += window_tokens
                record = dict(step=step, lr=float(schedule(step - 1)), tokens_seen=tokens_seen,
                              tokens_per_s=window_tokens / (time.time() - t0), **metrics)
                if step % s.eval_every == 0 or step == s.steps:
                    record.update(evaluate(state["params"]))
                record["wall_s"] = position()["wall_s"]
                metrics_file.write(json.dumps(record) + "\n")
                metrics_file.flush()
                bar.set_postfix(loss=f"{metrics['ce']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}", refresh=False)
                bar.update(1)
                due = time.time() - last_save >= 60 * s.checkpoint_minutes or (
                    s.checkpoint_every and step % s.checkpoint_every == 0)
                if stop.signal is not None or due or step == s.steps:
                    ckpts.save(step, state, position())
                    last_save = time.time()
                if stop.signal is not None:
                    stopped_by = signal.Signals(stop.signal).name
                    run.log(f"\n{stopped_by}: saved the checkpoint at step {step}; continue with --resume")
                    break
    finally:
        bar.close()
        metrics_file.close()
        ckpts.close()
    return dict(params=state["params"], step=step, stopped_by=stopped_by, wall_s=position()["wall_s"],
                tokens_seen=tokens_seen)
