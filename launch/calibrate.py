"""python -m launch.calibrate: default vectors for the router expert predictor (Speculating Experts §3), or with
--maps the expert-map store of the expert_map predictor (fMoE §4).

Runs the prompts of a requests file (the launch.serve format; bad lines are skipped with a count) through the
model, averages each expert's output over the tokens routed to it, and saves the vectors with orbax; serve with
`--placement cached --predictor router --default-vectors DIR`. With --maps: each completion request is generated
(greedy, its max_tokens, at most --max-decode) and every inference iteration becomes one map, as fMoE's store
keeps them (§4.1): the prefill (the prompt's mean gate distribution per MoE layer, keyed by its mean input
embedding) and each decode iteration (the fed token's gate distributions, keyed by its embedding); score contexts
are one prefill each. The store holds --capacity maps, deduplicated as §4.4 says; serve with
`--placement cached --predictor expert_map --maps DIR`.

  python -m launch.calibrate --model /ckpt/Qwen3-30B-A3B --input sample.jsonl --out vectors/qwen3-30b \\
      --placement streamed --device-memory-gb 40
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import Counter

import numpy as np
from flax import nnx

import moejax
from launch.serve import read_lines
from moejax.engine import Engine
from moejax.offload.predict import calibrate
from moejax.offload.predict.expert_maps import build_store
from moejax.offload.predict.traces import record
from moejax.offload.settings import PLACEMENTS
from moejax.presets import DEFAULT_MODEL
from moejax.requests.parse import BadLine, CompletionRequest, parse_lines


def request_prompts(engine: Engine, lines: list[str]) -> tuple[list[list[int]], int]:
    """Token ids of every prompt in requests lines (a score request's contexts each), and how many lines were bad."""
    prompts, bad = request_generations(engine, lines)
    return [p for p, _ in prompts], len(bad)


def request_generations(engine: Engine, lines: list[str]) -> tuple[list[tuple[list[int], int]], list[BadLine]]:
    """(token ids, tokens to generate) of every prompt in requests lines: a completion's max_tokens, 0 for each
    context of a score request; and the bad lines (each says why)."""
    cfg = engine.config
    entries = parse_lines(lines, tokenizer=engine.tokenizer, vocab_size=cfg.vocab_size,
                          max_context=cfg.max_position_embeddings, chat=engine.chat_template)
    prompts: list[tuple[list[int], int]] = []
    for e in entries:
        if isinstance(e, CompletionRequest):
            prompts.append((list(e.prompt), e.max_tokens))
        elif not isinstance(e, BadLine):
            prompts += [(list(c), 0) for c in e.contexts]
    return prompts, [e for e in entries if isinstance(e, BadLine)]


def why_unusable(bad: list[BadLine]) -> str:
    """Why lines were skipped: how many, and the commonest reason with a line that has it (e.g. text prompts for a
    model without a tokenizer)."""
    if not bad:
        return "no bad lines"
    reasons = Counter(b.message for b in bad)
    message, count = reasons.most_common(1)[0]
    first = next(b.line for b in bad if b.message == message)
    more = f"; {len(reasons) - 1} other reasons" if len(reasons) > 1 else ""
    return f"{len(bad)} bad lines; {count} of them, e.g. line {first}: {message}{more}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m launch.calibrate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"HF checkpoint directory, embedded model or preset; default {DEFAULT_MODEL}, as "
                        "launch.serve's (a preset has no tokenizer: its requests give token ids)")
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
    p.add_argument("--max-decode", type=int, default=64,
                   help="--maps: decode iterations recorded per completion at most (its max_tokens otherwise)")
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
    generations, bad = request_generations(engine, lines)
    skipped = len(bad)
    if not generations:
        sys.exit(f"launch.calibrate: no usable prompt in {args.input!r} for --model {args.model} "
                 f"({why_unusable(bad)})")
    if bad:
        print(f"skipping {why_unusable(bad)}", file=sys.stderr)
    if args.maps:
        return _write_maps(engine, generations[: args.max_prompts], args, skipped)
    prompts = [p for p, _ in generations]
    vectors = calibrate(engine, prompts[: args.max_prompts], max_tokens=args.max_tokens)
    path = vectors.save(args.out)
    cfg = engine.config
    tokens = int(vectors.counts.sum() // max(cfg.num_experts_per_tok, 1))
    print(f"wrote {path}: {min(len(prompts), args.max_prompts)} prompts, {tokens} token-layer visits, "
          f"{skipped} bad lines skipped", file=sys.stderr)
    return 0


def iteration_sequences(engine: Engine, generations: list[tuple[list[int], int]], max_prompt: int, max_decode: int
                        ) -> tuple[list[list[int]], list[int]]:
    """Each prompt (cut to max_prompt tokens) followed by the tokens its decode iterations feed: greedy generation
    of min(its tokens to generate, max_decode, the context's room) tokens, all but the last (which no iteration
    feeds) -> (sequences, prompt lengths)."""
    cfg = engine.config
    prompts = [p[:max_prompt] for p, _ in generations]
    new = [min(n, max_decode, cfg.max_position_embeddings - len(p))
           for p, (_, n) in zip(prompts, generations, strict=True)]
    fed: list[list[int]] = [[] for _ in prompts]
    for n in sorted(set(new) - {0, 1}):  # one batch per length; a single new token feeds no decode iteration
        rows = [r for r, m in enumerate(new) if m == n]
        for r, tokens in zip(rows, engine.generate([prompts[r] for r in rows], n), strict=True):
            fed[r] = tokens[:-1]
    return [p + f for p, f in zip(prompts, fed, strict=True)], [len(p) for p in prompts]


def _write_maps(engine: Engine, generations: list[tuple[list[int], int]], args: argparse.Namespace, skipped: int
                ) -> int:
    if args.capacity < 1 or args.distance < 1 or args.max_decode < 0:
        sys.exit("--capacity and --distance must be >= 1, --max-decode >= 0")
    sequences, prefill = iteration_sequences(engine, generations, args.max_tokens, args.max_decode)
    traces, _ = record(engine, sequences, max_tokens_per_prompt=max(map(len, sequences)), max_tokens=2 ** 62)
    embed = np.asarray(nnx.merge(engine.graphdef, engine.params).embed[...], np.float32)
    store = build_store(traces, embed, capacity=args.capacity, distance=args.distance, prefill_lengths=prefill)
    path = store.save(args.out)
    decodes = len(traces.tokens) - sum(prefill)
    print(f"wrote {path}: {len(store)} expert maps ({store.nbytes / 2**20:.2f} MiB; capacity {args.capacity}) from "
          f"{traces.num_prompts + decodes} iterations ({traces.num_prompts} prefills, {decodes} decodes), "
          f"{skipped} bad lines skipped", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
