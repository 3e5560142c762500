"""Multiple-choice accuracy two ways, as MoE-Prefill (arXiv 2605.02960) §8.6 measures it (Tables 3-4, "tier 2"):
each question is answered by prefill-only scoring (the candidate of the highest log-likelihood after the context,
as lm-eval's multiple choice picks it) and by greedy generation from the context (the generated text names the
candidate it begins with, or none). Each mode's accuracy is reported against the labels, with how often the two
modes pick the same candidate."""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import numpy as np

from moejax.engine import Engine
from moejax.eval.generation import Completion, generate
from moejax.eval.scoring import Scorer


@dataclasses.dataclass(frozen=True)
class Question:
    context: str
    choices: tuple[str, ...]
    gold: int  # index into choices


def candidate_of_generation(generated: str, choices: Sequence[str]) -> int | None:
    """The index of the candidate the generated text begins with, leading whitespace stripped from both (a
    candidate's indentation is the tokenizer's business, not the answer); None when it begins with none. When
    several match (one candidate's text is a prefix of another's), the longest match: the generation said all of
    it. Candidates that strip to the same text: the first. A candidate that strips to nothing never matches."""
    text = generated.lstrip()
    best: int | None = None
    for i, choice in enumerate(choices):
        stripped = choice.lstrip()
        if stripped and text.startswith(stripped) and (best is None or len(stripped) > len(choices[best].lstrip())):
            best = i
    return best


def generation_answer(generated: str, question: Question) -> int | None:
    """The candidate a generation from the context's tokens names. The context's trailing whitespace (the line
    break before the answer's line) is left out of the prompt, as scoring moves it into the candidates, because
    byte-level BPE merges a line break with the next line's indentation: a prompt ending in a bare line break is one
    the model rarely saw. So the generation must produce that whitespace first (a model that continues the context's
    last line instead answers nothing), then a candidate."""
    context = question.context
    spaces = context[len(context.rstrip()):]
    if not generated.startswith(spaces):
        return None
    return candidate_of_generation(generated[len(spaces):], question.choices)


def accuracy_report(scored: Sequence[int], generated: Sequence[int | None], gold: Sequence[int]) -> dict:
    """Each mode's accuracy against the labels, how often the modes agree (a generation that names no candidate
    agrees with nothing) and how many generations named none."""
    if not len(scored) == len(generated) == len(gold) > 0:
        raise ValueError(f"answers for every question, at least one: got {len(scored)} scored, {len(generated)} "
                         f"generated and {len(gold)} labels")
    n = len(gold)
    return dict(questions=n,
                scoring_accuracy=sum(s == g for s, g in zip(scored, gold, strict=True)) / n,
                generation_accuracy=sum(a == g for a, g in zip(generated, gold, strict=True)) / n,
                agreement=sum(a is not None and a == s for s, a in zip(scored, generated, strict=True)) / n,
                generation_unmatched=sum(a is None for a in generated))


def encode_pair(encode: Callable[[str], list[int]], context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context tokens, continuation tokens) as lm-eval's models split them (TemplateLM._encode_pair): the context's
    trailing whitespace moves to the continuation, the two are encoded whole and split after the context's tokens."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole, head = encode(context + continuation), encode(context)
    return head, whole[len(head):]


@dataclasses.dataclass
class Answers:
    scored: list[int]  # the candidate of the highest log-likelihood, per question
    loglikelihoods: list[list[float]]  # [question][candidate]
    generated_tokens: list[list[int]]  # greedy tokens after the context (an end-of-sequence token kept last)
    generated_text: list[str]
    generated: list[int | None]  # the candidate each generation begins with
    report: dict  # accuracy_report's
    seconds: dict[str, float]  # wall time of each mode, compilation included


def answer_twice(engine: Engine, questions: Sequence[Question], encode: Callable[[str], list[int]],
                 decode: Callable[[list[int]], str], *, slack_tokens: int = 2, max_batch_tokens: int | None = None,
                 kv_pool_mb: float | None = None) -> Answers:
    """Every question scored (one prefix-shared request per context: moejax.eval.scoring) and generated greedily
    from the same context tokens (the continuous-batching scheduler: moejax.eval.generation) for as many tokens as
    its longest candidate takes plus `slack_tokens` (a generation may tokenize the same text into more pieces); the
    generation's candidate by generation_answer."""
    if not questions:
        raise ValueError("no questions")
    pairs: list[tuple[list[int], list[int]]] = []
    completions = []
    for k, q in enumerate(questions):
        if len(q.choices) < 2 or not 0 <= q.gold < len(q.choices):
            raise ValueError(f"question {k}: needs two choices or more and a gold index among them; got "
                             f"{len(q.choices)} choices, gold {q.gold}")
        encoded = [encode_pair(encode, q.context, c) for c in q.choices]
        if any(not ctx or not cont for ctx, cont in encoded):
            raise ValueError(f"question {k}: its context and every choice must encode to a token each")
        pairs += encoded
        prompt = tuple(encoded[0][0])  # the scored context (trailing whitespace left out): both modes answer after it
        longest = max(len(cont) for _, cont in encoded)
        room = engine.config.max_position_embeddings - len(prompt)
        completions.append(Completion(prompt, max(1, min(longest + slack_tokens, room)), stop=()))
    t0 = time.perf_counter()
    flat = [lp for lp, _ in Scorer(engine, max_batch_tokens=max_batch_tokens).score(pairs)]
    t1 = time.perf_counter()
    ll, start = [], 0
    for q in questions:
        ll.append(flat[start: start + len(q.choices)])
        start += len(q.choices)
    scored = [int(np.argmax(row)) for row in ll]  # ties: the first, as lm-eval's argmax
    tokens = generate(engine, completions, decode, kv_pool_mb=kv_pool_mb)
    t2 = time.perf_counter()
    texts = [decode(t) for t in tokens]
    generated = [generation_answer(t, q) for t, q in zip(texts, questions, strict=True)]
    report = accuracy_report(scored, generated, [q.gold for q in questions])
    return Answers(scored, ll, tokens, texts, generated, report, dict(scoring=t1 - t0, generation=t2 - t1))
