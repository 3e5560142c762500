"""python -m launch.calibrate: default vectors for the router expert predictor (Speculating Experts §3), or with
--maps the expert-map store of the expert_map predictor (fMoE §4).

Runs the prompts of a requests file (the launch.serve format; bad lines are skipped with a count) through the
model, averages each expert's output over the tokens routed to it, and saves the vectors with orbax; serve with
`--placement cached --predictor router --default-vectors DIR`. With --maps: one map per prompt (its mean gate
distribution per MoE layer, keyed by its mean input embedding) into a store of --capacity maps, deduplicated as
fMoE §4.4 says; serve with `--placement cached --predictor expert_map --maps DIR`.

  python -m launch.calibrate --model /ckpt/Qwen3-30B-A3B --input sample.jsonl --out vectors/qwen3-30b \\
      --placement streamed --device-memory-gb 40
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

import moejax
from launch.serve import read_lines
from moejax.offload.memory_budget import PLACEMENTS
from moejax.offload.predict import calibrate
from moejax.sched.requests import BadLine, CompletionRequest, parse_lines


def request_prompts(engine, lines) -> tuple[list[list[int]], int]:
    """Token ids of every prompt in requests lines (a score request's contexts each), and how many lines were bad."""
    cfg = engine.config
    entries = parse_lines(lines, tokenizer=engine.tokenizer, vocab_size=cfg.vocab_size,
                          max_context=cfg.max_position_embeddings, chat=engine.chat_template)
    prompts = []
    for e in entries:
        if not isinstance(e, BadLine):
            prompts += [list(e.prompt)] if isinstance(e, CompletionRequest) else [list(c) for c in e.contexts]
    return prompts, sum(isinstance(e, BadLine) for e in entries)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m launch.calibrate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-qwen3-moe", help="HF checkpoint directory or preset")
    p.add_argument("--input", required=True, help="requests JSONL (launch.serve format) whose prompts calibrate")
    p.add_argument("--out", required=True, help="directory to write (must not exist)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--max-prompts", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=512, help="tokens per prompt at most")
    p.add_argument("--placement", default="auto", choices=PLACEMENTS[:3],
                   help="where the experts live while calibrating (see launch.serve)")
    p.add_argument("--device-memory-gb", type=float, default=None)
    p.add_argument("--maps", action="store_true", help="build expert maps (fMoE) instead of default vectors")
    p.add_argument("--capacity", type=int, default=1024, help="--maps: maps the store keeps")
    p.add_argument("--distance", type=int, default=1, help="--maps: prefetch distance in MoE layers")
    args = p.parse_args(argv)
    if os.path.exists(args.out):
        sys.exit(f"--out: {args.out!r} already exists")
    options = {"placement": args.placement}
    for name in ("num_layers", "device_memory_gb"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    try:
        engine = moejax.load(args.model, dtype=args.dtype, **options)
        lines = read_lines(args.input)
    except (ValueError, OSError) as e:
        sys.exit(f"launch.calibrate: {e}")
    prompts, skipped = request_prompts(engine, lines)
    if not prompts:
        sys.exit(f"launch.calibrate: no usable prompt in {args.input!r} ({skipped} bad lines)")
    if args.maps:
        return _write_maps(engine, prompts[: args.max_prompts], args, skipped)
    vectors = calibrate(engine, prompts[: args.max_prompts], max_tokens=args.max_tokens)
    path = vectors.save(args.out)
    cfg = engine.config
    tokens = int(vectors.counts.sum() // max(cfg.num_experts_per_tok, 1))
    print(f"wrote {path}: {min(len(prompts), args.max_prompts)} prompts, {tokens} token-layer visits, "
          f"{skipped} bad lines skipped", file=sys.stderr)
    return 0


def _write_maps(engine, prompts, args, skipped: int) -> int:
    from flax import nnx

    from moejax.offload.predict.expert_maps import build_store
    from moejax.offload.predict.traces import record
    if args.capacity < 1 or args.distance < 1:
        sys.exit("--capacity and --distance must be >= 1")
    traces, _ = record(engine, prompts, max_tokens_per_prompt=args.max_tokens, max_tokens=2 ** 62)
    embed = np.asarray(nnx.merge(engine.graphdef, engine.params).embed[...], np.float32)
    store = build_store(traces, embed, capacity=args.capacity, distance=args.distance)
    path = store.save(args.out)
    print(f"wrote {path}: {len(store)} expert maps from {traces.num_prompts} prompts ({len(traces.tokens)} tokens), "
          f"{skipped} bad lines skipped", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
