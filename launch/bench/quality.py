"""`python -m launch.bench quality`: how good a model is on held-out text (moejax.train.quality).

Held-out perplexity and top-1 next-token accuracy over plain text files (documents joined by the tokenizer's
end-of-text token, scored in consecutive windows), each MoE layer's share of routed tokens per expert, and the
same two numbers for an interpolated bigram fit on training text (default: the training split of the running
Python's standard library, the embedded model's corpus): the floor to beat.

  python -m launch.bench quality --model pycode-moe --stdlib held_out
  python -m launch.bench quality --model /ckpt/dir --text my_docs/ --bigram-text train_docs/
"""
from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import numpy as np
from tokenizers import Tokenizer

import moejax
from moejax.train import corpus
from moejax.train.quality import bigram_quality, model_quality
from moejax.train.tokenizer import END_OF_TEXT

TIER2_DEFAULTS = dict(questions=100, choices=4, context_lines=8, slack_tokens=2, seed=0)
TARGETS = dict(perplexity_over_bigram_at_most=0.5, expert_share_over_uniform_between=[0.25, 4.0])


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = sub.add_parser("quality", help="held-out perplexity, top-1 and expert load against a bigram floor")
    p.add_argument("--model", default="pycode-moe", help="preset or HF checkpoint directory with a tokenizer")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", help="a text file or a directory of them (read recursively)")
    src.add_argument("--stdlib", choices=["held_out", "train"], help="a split of the stdlib corpus")
    p.add_argument("--bigram-text", default=None, help="text the bigram is fit on (default: the stdlib train split)")
    p.add_argument("--window", type=int, default=512, help="tokens per scored window")
    p.add_argument("--max-tokens", type=int, default=None, help="score at most this many tokens")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--out", default=None,
                   help="JSON file (default bench/results/quality-<device>.json, quality-tier2-<device>.json)")
    t2 = p.add_argument_group("tier 2 (launch/bench/quality_tier2.py)")
    t2.add_argument("--tier2", action="store_true",
                    help="multiple-choice accuracy by prefill-only scoring and by greedy generation instead")
    t2.add_argument("--questions", type=_int_at_least(1), default=TIER2_DEFAULTS["questions"],
                    help="questions cut from the text")
    t2.add_argument("--choices", type=_int_at_least(2), default=TIER2_DEFAULTS["choices"],
                    help="candidates per question")
    t2.add_argument("--context-lines", type=_int_at_least(1), default=TIER2_DEFAULTS["context_lines"],
                    help="source lines in each question's context")
    t2.add_argument("--slack-tokens", type=_int_at_least(0), default=TIER2_DEFAULTS["slack_tokens"],
                    help="tokens generated beyond the question's longest candidate")
    t2.add_argument("--seed", type=int, default=TIER2_DEFAULTS["seed"], help="which questions and distractors")
    # tier 2 is another record's shape: its own results file
    p.set_defaults(results_stem=lambda a: os.path.join("bench", "results", "quality-tier2" if a.tier2 else "quality"),
                   check=check_args)
    return p


def check_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Before any work: flags of the other mode are refused rather than ignored."""
    if args.tier2:
        typed = [f for f, v in (("--bigram-text", args.bigram_text), ("--max-tokens", args.max_tokens)) if v]
        if typed:
            parser.error(f"{', '.join(typed)}: the perplexity run's, not --tier2's")
        return
    typed = ["--" + k.replace("_", "-") for k, v in TIER2_DEFAULTS.items() if getattr(args, k) != v]
    if typed:
        parser.error(f"{', '.join(typed)}: --tier2's; add --tier2 or leave them out")


def _int_at_least(least: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        if not text.isdigit() or int(text) < least:
            raise argparse.ArgumentTypeError(f"{text!r} must be an integer >= {least}")
        return int(text)
    return parse


def read_texts(path: str) -> list[str]:
    """A file, or every file under a directory (sorted), as text; files that are not UTF-8 are skipped."""
    if os.path.isfile(path):
        files = [path]
    elif os.path.isdir(path):
        files = sorted(os.path.join(d, f) for d, _, names in os.walk(path) for f in names)
    else:
        raise SystemExit(f"quality: {path!r} is neither a file nor a directory")
    texts = []
    for f in files:
        try:
            with open(f, encoding="utf-8") as handle:
                texts.append(handle.read())
        except UnicodeDecodeError:
            print(f"  skipped {f}: not UTF-8")
    if not texts:
        raise SystemExit(f"quality: no text files under {path!r}")
    return texts


def stdlib_texts(which: str) -> list[str]:
    root = corpus.stdlib_dir()
    train, held_out = corpus.split(corpus.source_files(root))
    return [corpus.read_source(os.path.join(root, f)) for f in (held_out if which == "held_out" else train)]


def token_stream(tokenizer: Tokenizer, texts: list[str], eos: int) -> np.ndarray:
    ids: list[int] = []
    for enc in tokenizer.encode_batch(texts, add_special_tokens=False):
        ids += enc.ids + [eos]
    return np.asarray(ids, np.int32)


def quality(args: argparse.Namespace, env: dict) -> dict:
    engine = moejax.load(args.model, dtype=args.dtype)
    if engine.tokenizer is None:
        raise SystemExit(f"quality: {args.model} has no tokenizer.json; text cannot be scored")
    eos = engine.tokenizer.token_to_id(END_OF_TEXT)
    if eos is None:
        eos = engine.config.eos_token_ids[0]
    texts = read_texts(args.text) if args.text else stdlib_texts(args.stdlib)
    held_out = token_stream(engine.tokenizer, texts, eos)
    if args.max_tokens:
        held_out = held_out[:args.max_tokens + 1]
    train = token_stream(engine.tokenizer, read_texts(args.bigram_text) if args.bigram_text else stdlib_texts("train"),
                    eos)
    window = min(args.window, engine.config.max_position_embeddings - 1)
    print(f"quality: {args.model} ({engine.dtype}) on {len(held_out)} tokens in windows of {window}; bigram fit "
          f"on {len(train)} tokens", flush=True)
    result = model_quality(engine, held_out, window=window)
    result.update(bigram_quality(train, held_out, engine.config.vocab_size, window=window))
    shares = np.asarray(result["expert_share"]) * engine.config.num_experts
    result.update(perplexity_over_bigram=result["perplexity"] / result["bigram_perplexity"],
                  expert_share_over_uniform=[float(shares.min()), float(shares.max())])
    print(f"  perplexity {result['perplexity']:.2f} (bigram {result['bigram_perplexity']:.2f}, ratio "
          f"{result['perplexity_over_bigram']:.3f}); top-1 {result['top1_accuracy']:.3f} (bigram "
          f"{result['bigram_top1_accuracy']:.3f}); expert share / uniform in [{shares.min():.2f}, {shares.max():.2f}]")
    return dict(env, bench="quality", model=args.model, dtype=str(engine.dtype),
                text=args.text or f"stdlib:{args.stdlib}", bigram_text=args.bigram_text or "stdlib:train",
                targets=TARGETS, **result)
