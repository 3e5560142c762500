"""python -m launch.distill: distil the expert estimator (Speculating Experts §6, App. A) for a model.

Records routing traces of the given text or requests (moejax.offload.predict.traces), calibrates default vectors
on the same tokens, trains the estimator with optax on KL to each target layer's router (a progress bar; the
validation recall printed as it trains) and picks the Hybrid-PF layers; writes an orbax directory to serve with
`--placement cached --predictor estimator|hybrid --estimator DIR`.

  python -m launch.distill --model pycode-moe --stdlib train --out estimators/pycode-moe
  python -m launch.distill --model /ckpt/Qwen3-30B-A3B --text docs/ --out est/q3 --distance 2 --tokens 200000
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

import moejax
from launch.bench.quality import read_texts, stdlib_texts, token_stream
from launch.calibrate import request_prompts
from launch.serve import read_lines
from moejax.engine import Engine
from moejax.offload.predict import replay
from moejax.offload.predict.traces import record
from moejax.train.distill import distill


def text_prompts(engine: Engine, texts: list[str], window: int) -> list[list[int]]:
    """Texts as one token stream (documents joined by end-of-text) cut into prompts of `window` tokens."""
    if engine.tokenizer is None:
        raise ValueError("the model has no tokenizer.json; give --input with token ids instead of text")
    eos = engine.config.eos_token_ids[0] if engine.config.eos_token_ids else 0
    stream = token_stream(engine.tokenizer, texts, eos)
    return [stream[s:s + window].tolist() for s in range(0, len(stream) - 1, window)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m launch.distill", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="pycode-moe", help="HF checkpoint directory or preset")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", help="requests JSONL (launch.serve format) whose prompts are traced")
    src.add_argument("--text", help="a text file or a directory of them, cut into --window-token prompts")
    src.add_argument("--stdlib", choices=["train", "held_out"], help="a split of the stdlib corpus (pycode-moe's)")
    p.add_argument("--out", required=True, help="directory to write (must not exist)")
    p.add_argument("--distance", type=int, default=1, help="MoE layers ahead to predict (default 1)")
    p.add_argument("--tokens", type=int, default=65536, help="tokens to trace at most (memory: tokens x MoE layers x "
                   "(hidden + experts) x 4 bytes)")
    p.add_argument("--window", type=int, default=256, help="--text/--stdlib: tokens per prompt")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch", type=int, default=1024, help="(token, layer) pairs per step")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--latent", type=int, default=256, help="estimator latent width")
    p.add_argument("--mlp", type=int, default=512, help="estimator MLP width")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if os.path.exists(args.out):
        sys.exit(f"--out: {args.out!r} already exists")
    for name in ("distance", "tokens", "window", "steps", "batch", "latent", "mlp"):
        if getattr(args, name) < 1:
            sys.exit(f"--{name}: must be >= 1, got {getattr(args, name)}")
    try:
        engine = moejax.load(args.model, dtype=args.dtype)
        if args.input:
            prompts, skipped = request_prompts(engine, read_lines(args.input))
            if skipped:
                print(f"launch.distill: skipped {skipped} bad lines of {args.input}", file=sys.stderr)
        else:
            prompts = text_prompts(engine, read_texts(args.text) if args.text else stdlib_texts(args.stdlib),
                                   args.window)
    except (ValueError, OSError) as e:
        sys.exit(f"launch.distill: {e}")
    if not prompts:
        sys.exit("launch.distill: no prompt to trace")
    moe = sum(engine.config.is_moe(i) for i in range(engine.config.num_layers))
    if args.distance >= moe:
        sys.exit(f"--distance: the model has {moe} MoE layers, so distance must be < {moe}")
    rng = np.random.default_rng(args.seed)  # a sample across the whole text, not its first files
    order = rng.permutation(len(prompts))
    print(f"launch.distill: tracing up to {args.tokens} tokens of {len(prompts)} prompts", file=sys.stderr)
    try:
        traces, vectors = record(engine, [prompts[i] for i in order], max_tokens=args.tokens)
        net = distill(replay.steps_of(engine), traces, vectors, distance=args.distance, train_steps=args.steps,
                      batch=args.batch, lr=args.lr, latent=args.latent, mlp=args.mlp, seed=args.seed,
                      progress=False if args.no_progress else None,
                      log=lambda msg: print(msg, file=sys.stderr))
    except ValueError as e:
        sys.exit(f"launch.distill: {e}")
    net.info.update(model=args.model, source=args.input or args.text or f"stdlib:{args.stdlib}")
    path = net.save(args.out)
    router, estimator = net.info["validation_recall"]["router"], net.info["validation_recall"]["estimator"]
    print("validation recall per target layer (router predictor -> estimator):", file=sys.stderr)
    for layer in router:
        print(f"  layer {layer}: {router[layer]:.3f} -> {estimator[layer]:.3f}", file=sys.stderr)
    print(f"hybrid: estimator on layers {net.info['hybrid_layers']} (router recall < "
          f"{net.info['hybrid_threshold']:.3f}); wrote {path} in {net.info['seconds']:.0f} s of training",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
