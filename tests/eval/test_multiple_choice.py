"""MoE-Prefill's tier-2 accuracy (moejax.eval.multiple_choice): a generation's candidate, the two modes' report, and
the harness end to end on the qwen3_moe fixture against the one-device float32 engine's own logits."""
import numpy as np
import pytest

from moejax.eval.multiple_choice import (
    Question,
    accuracy_report,
    answer_twice,
    candidate_of_generation,
    encode_pair,
    generation_answer,
)

CHOICES = ("    return self._data", "raise ValueError(name)", "return", "self.assertEqual(a, b)")


@pytest.mark.parametrize("generated, want", [
    ("return self._data\n    def", 0),  # the candidate's indentation is not asked of the generation
    ("        return self._data[key]", 0),  # leading whitespace of the generation stripped too
    ("return None", 2),  # begins with "return" only
    ("raise ValueError(name) from e", 1),
    ("self.assertEqual(a, c)", None),  # differs inside the candidate
    ("", None),  # an empty generation names nothing
    ("   \n  ", None),  # nor does one of whitespace only
    ("retur", None),  # a generation cut inside a candidate does not begin with it
    ("Return self._data", None),  # case counts
])
def test_candidate_of_generation(generated, want):
    assert candidate_of_generation(generated, CHOICES) == want


def test_longest_match_wins_whatever_the_order():
    # "return" is a prefix of "return self._data": the generation said all of the longer one
    assert candidate_of_generation("return self._data", ["return", "return self._data", "x"]) == 1
    assert candidate_of_generation("return self._data", ["return self._data", "return", "x"]) == 0
    assert candidate_of_generation("return self", ["return", "return self._data"]) == 0


def test_blank_and_duplicate_candidates():
    assert candidate_of_generation("anything", ["", "  ", "other"]) is None  # a blank candidate matches nothing
    assert candidate_of_generation("x = 1", ["  x = 1", "x = 1"]) == 0  # the same text stripped: the first


def test_generation_answer_starts_with_the_context_line_break():
    q = Question("def f(self):\n", CHOICES, gold=0)
    assert generation_answer("\n    return self._data\n", q) == 0  # the line break the prompt left out, then it
    assert generation_answer("\n\n    raise ValueError(name)", q) == 1  # a blank line first: whitespace too
    assert generation_answer(" return self._data", q) is None  # the context's last line continued: no answer
    assert generation_answer("", q) is None
    # a context that ends without whitespace asks for nothing before the candidate
    assert generation_answer(" return self._data", Question("x =", CHOICES, gold=0)) == 0


def test_accuracy_report_counts_agreement_and_unmatched():
    report = accuracy_report(scored=[0, 1, 2, 3], generated=[0, None, 1, 3], gold=[0, 1, 1, 2])
    assert report == dict(questions=4, scoring_accuracy=0.5, generation_accuracy=0.5, agreement=0.5,
                          generation_unmatched=1)
    with pytest.raises(ValueError, match="answers for every question"):
        accuracy_report([0], [0, 1], [0, 1])


def test_encode_pair_moves_trailing_whitespace_to_the_continuation():
    seen = []

    def encode(text):
        seen.append(text)
        return [ord(c) for c in text]
    ctx, cont = encode_pair(encode, "def f():\n", "    pass")
    assert seen == ["def f():\n    pass", "def f():"]
    assert ctx == [ord(c) for c in "def f():"] and cont == [ord(c) for c in "\n    pass"]


def _reference_greedy(engine, prompt, max_new):
    """Greedy tokens from the whole-sequence float32 forward, one token per call, ended at end-of-sequence."""
    seq, out = list(prompt), []
    for _ in range(max_new):
        token = int(np.argmax(engine.logits([seq])[0, -1]))
        out.append(token)
        seq.append(token)
        if token in engine.config.eos_token_ids:
            break
    return out


def _reference_loglikelihood(engine, ctx, cont):
    logits = engine.logits([ctx + cont]).astype(np.float64)[0]
    logp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
    return sum(logp[len(ctx) - 1 + i, t] for i, t in enumerate(cont))


@pytest.mark.slow
def test_harness_equals_the_float32_reference(qwen3_engine):
    engine = qwen3_engine
    tok = engine.tokenizer
    encode = lambda text: tok.encode(text).ids  # noqa: E731
    decode = lambda ids: tok.decode(list(ids))  # noqa: E731
    # the first two contexts end without whitespace, the last with a line break (left out of the prompt)
    contexts = ["def add(a, b):", "class Stack:\n    def push(self, item):", "for i in range(10):\n"]
    questions = []
    for k, ctx in enumerate(contexts):
        # the reference's own greedy text as one candidate (gold in the first question only), so a generation must
        # name it; the last question's candidates leave it out, so its generation names none
        greedy = decode(_reference_greedy(engine, encode(ctx.rstrip()), 4)).lstrip()[:6]
        assert greedy.strip()
        choices = ["    return a + b", "pass", "import os"]
        if k < 2:
            choices.insert(1 + k, greedy)
        questions.append(Question(ctx, tuple(choices), gold=1 if k == 0 else 0))
    got = answer_twice(engine, questions, encode, decode, max_batch_tokens=64)
    for q, scored, ll, tokens, generated in zip(questions, got.scored, got.loglikelihoods, got.generated_tokens,
                                                got.generated, strict=True):
        pairs = [encode_pair(encode, q.context, c) for c in q.choices]
        want_ll = [_reference_loglikelihood(engine, ctx, cont) for ctx, cont in pairs]
        np.testing.assert_allclose(ll, want_ll, rtol=1e-5, atol=1e-4)
        assert scored == int(np.argmax(want_ll))
        max_new = max(len(cont) for _, cont in pairs) + 2
        assert tokens == _reference_greedy(engine, encode(q.context.rstrip()), max_new)
        assert generated == generation_answer(decode(tokens), q)
    assert got.generated == [1, 2, None]  # each generation names the greedy candidate where there is one
    assert got.report["questions"] == 3
    assert got.report["scoring_accuracy"] == sum(s == q.gold for s, q in zip(got.scored, questions, strict=True)) / 3
    assert got.report["generation_accuracy"] == 1 / 3 and got.report["generation_unmatched"] == 1
