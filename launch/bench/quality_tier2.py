"""`python -m launch.bench quality --tier2`: MoE-Prefill's tier-2 accuracy (§8.6, Tables 3-4) on code questions.

Multiple-choice questions are cut from the text `quality` reads (launch/bench/code_questions.py: a context of
--context-lines source lines, the next line's first two words against --choices - 1 other lines' first two words,
all with the answer's indentation) and each is answered twice by moejax.eval.multiple_choice: by prefill-only
scoring (the candidate of the highest log-likelihood) and by greedy generation (the candidate the generated text
begins with, or none). The record holds each mode's accuracy against the labels, their agreement, the generations
that named no candidate and every question's answers.

  python -m launch.bench quality --tier2 --stdlib held_out               # pycode-moe on its held-out files
"""
from __future__ import annotations

import argparse
import time

import moejax
from launch.bench.code_questions import code_questions
from launch.bench.quality import read_texts, stdlib_texts
from launch.bench.util import cpu_seconds
from moejax.eval.multiple_choice import Question, answer_twice


def source_lines(texts: list[str]) -> list[str]:
    """Every text's lines, right-stripped, a blank line between texts so no context spans two files."""
    lines: list[str] = []
    for text in texts:
        lines += [ln.rstrip() for ln in text.splitlines()] + [""]
    return lines


def tier2(args: argparse.Namespace, env: dict) -> dict:
    texts = read_texts(args.text) if args.text else stdlib_texts(args.stdlib)
    try:
        docs = code_questions(source_lines(texts), args.questions, args.choices, args.context_lines, args.seed,
                              same_indent=True)
    except ValueError as e:
        raise SystemExit(f"quality: {e}") from None
    engine = moejax.load(args.model, dtype=args.dtype)
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise SystemExit(f"quality: {args.model} has no tokenizer.json; questions are text")
    questions = [Question(d["context"], tuple(d["choices"]), d["gold"]) for d in docs]
    print(f"quality --tier2: {args.model} ({engine.dtype}), {len(questions)} questions of {args.choices} choices "
          f"after {args.context_lines} lines", flush=True)
    t0, (_, cpu0) = time.perf_counter(), cpu_seconds()
    answers = answer_twice(engine, questions, lambda text: tokenizer.encode(text).ids,
                           lambda ids: tokenizer.decode(list(ids)), slack_tokens=args.slack_tokens)
    seconds, cpu = time.perf_counter() - t0, cpu_seconds()[1] - cpu0
    r = answers.report
    print(f"  scoring {r['scoring_accuracy']:.3f}, generation {r['generation_accuracy']:.3f} "
          f"({r['generation_unmatched']} named no candidate), agreement {r['agreement']:.3f}; chance "
          f"{1 / args.choices:.3f}; {seconds:.0f} s")
    per_question = [dict(choices=list(q.choices), gold=q.gold, scored=s, generated=g, generated_text=t,
                         loglikelihoods=ll)
                    for q, s, g, t, ll in zip(questions, answers.scored, answers.generated, answers.generated_text,
                                              answers.loglikelihoods, strict=True)]
    return dict(env, bench="quality-tier2", model=args.model, dtype=str(engine.dtype),
                text=args.text or f"stdlib:{args.stdlib}",
                settings=dict(questions=args.questions, choices=args.choices, context_lines=args.context_lines,
                              seed=args.seed, slack_tokens=args.slack_tokens),
                chance=1 / args.choices, seconds=seconds, seconds_per_mode=answers.seconds,
                process_cpu_seconds=cpu, **r, answers=per_question)
