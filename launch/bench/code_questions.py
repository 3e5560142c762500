"""Multiple-choice questions over Python source lines: a context of consecutive non-blank lines, the next line's
first two words (with its indentation) as the answer and the first two words of other lines as the distractors.
`launch.bench eval` times lm-eval on them; `launch.bench quality --tier2` answers them by scoring and by generation."""
from __future__ import annotations

import random
from typing import Any


def code_questions(lines: list[str], questions: int, choices: int, context_lines: int, seed: int, *,
                   same_indent: bool = False) -> list[dict[str, Any]]:
    """-> [{"context", "choices", "gold"}] (lm-eval's multiple-choice fields). same_indent: the distractors carry
    the answer's indentation too, so the whitespace does not give the answer away. ValueError when the lines give
    fewer contexts than `questions`."""
    rng = random.Random(seed)
    starts = [i for i in range(len(lines) - context_lines)
              if len(lines[i + context_lines].strip().split()) >= 2 and all(lines[i: i + context_lines])]
    if len(starts) < questions:
        raise ValueError(f"--questions {questions}: the sources give {len(starts)} contexts")
    words = lambda ln: " ".join(ln.strip().split()[:2])  # noqa: E731  (a continuation: the first two words)
    docs: list[dict[str, Any]] = []
    for i in rng.sample(starts, questions):
        nxt = lines[i + context_lines]
        indent = nxt[: len(nxt) - len(nxt.lstrip())]
        gold = indent + words(nxt)
        drawn = rng.sample(range(len(lines)), min(8 * choices, len(lines)))
        others = {words(lines[j]) for j in drawn if lines[j].strip()}
        options = [gold] + [indent * same_indent + o
                            for o in rng.sample(sorted(o for o in others if o != words(nxt)), choices - 1)]
        rng.shuffle(options)
        docs.append({"context": "\n".join(lines[i: i + context_lines]) + "\n", "choices": options,
                     "gold": options.index(gold)})
    return docs
