"""Sampling (moejax.sampling): the temperature, top_k, top_p and min_p filters against transformers' logits warpers,
applied in the same order; per-row settings as arrays, so new values compile nothing; top_k 1 is greedy and seeded
draws do not depend on a request's neighbours, end to end through Engine.generate and the batch runner."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moejax
from moejax import compiles
from moejax.requests.parse import parse_line
from moejax.sampling import Sampling, SamplingParams, filtered, sample
from moejax.sched.batch import serve_lines
from moejax.sched.serving_options import ServingOptions

V = 64
# (temperature, top_k, top_p, min_p) per row: each filter alone, at its edges, and together
ROWS = [(1.0, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.3, -1, 0.8, 0.0), (1.0, 0, 1.0, 0.2), (0.5, 1, 1.0, 0.0),
        (1.0, 10, 0.6, 0.1), (2.0, 100, 0.9, 0.05), (1.0, 3, 0.3, 0.0), (0.9, 0, 0.5, 0.5), (1.0, 0, 1.0, 1.0),
        (1.5, 20, 0.95, 0.02), (1.0, 7, 1.0, 0.3)]


def _transformers_filtered(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float):
    torch = pytest.importorskip("torch")
    warpers = pytest.importorskip("transformers.generation.logits_process")
    chain = [warpers.TemperatureLogitsWarper(temperature)]
    if top_k > 0:
        chain.append(warpers.TopKLogitsWarper(top_k))
    chain.append(warpers.TopPLogitsWarper(top_p))
    if min_p > 0:
        chain.append(warpers.MinPLogitsWarper(min_p))
    scores = torch.tensor(logits[None])
    for warp in chain:
        scores = warp(None, scores)
    return scores[0].numpy()


def test_filters_match_transformers_warpers():
    """Per row, the tokens kept and their renormalised probabilities are transformers' (Temperature, TopK, TopP,
    MinP warpers in that order, as its generate applies them); the rows of one batch each have their own settings."""
    logits = np.random.default_rng(0).normal(0, 3, (len(ROWS), V)).astype(np.float32)
    params = [SamplingParams(t, top_p=p, top_k=k, min_p=m) for t, k, p, m in ROWS]
    s = Sampling.of(params, np.zeros((len(ROWS), 2), np.uint32), np.zeros(len(ROWS), np.int32))
    masked, order = filtered(jnp.asarray(logits), s.temperature, s.top_p, s.top_k, s.min_p)
    ours = np.full((len(ROWS), V), -np.inf, np.float32)
    np.put_along_axis(ours, np.asarray(order), np.asarray(masked), axis=-1)
    for b, (t, k, p, m) in enumerate(ROWS):
        theirs = _transformers_filtered(logits[b], t, k, p, m)
        kept = np.isfinite(theirs)
        np.testing.assert_array_equal(np.isfinite(ours[b]), kept, err_msg=f"row {b}: {ROWS[b]}")
        np.testing.assert_allclose(np.asarray(jax.nn.softmax(ours[b])), np.asarray(jax.nn.softmax(theirs)),
                                   rtol=1e-5, atol=1e-7, err_msg=f"row {b}: {ROWS[b]}")
    assert len({int(np.isfinite(ours[b]).sum()) for b in range(len(ROWS))}) > 5  # the filters did cut, differently


def test_draws_stay_in_the_kept_tokens():
    """4000 draws with top_k 3, then min_p 0.5: only the kept tokens come out, in their renormalised proportions."""
    logits = jnp.log(jnp.array([[0.4, 0.25, 0.15, 0.12, 0.08]] * 4000))
    keys = jax.random.split(jax.random.key(0), 4000)
    ones = jnp.ones(4000)
    draws = np.asarray(sample(logits, ones, ones, keys, top_k=jnp.full(4000, 3), min_p=jnp.zeros(4000)))
    assert set(draws.tolist()) == {0, 1, 2}
    assert abs((draws == 0).mean() - 0.4 / 0.8) < 0.03
    draws = np.asarray(sample(logits, ones, ones, keys, top_k=jnp.zeros(4000, jnp.int32), min_p=jnp.full(4000, 0.5)))
    assert set(draws.tolist()) == {0, 1}  # 0.15 < 0.5 * 0.4


def test_each_field_is_a_request_field_and_a_row_array():
    """Every SamplingParams field is read from a request by its name (the parser takes them from
    moejax.sampling.RULES) and, but the seed (which makes the rows' keys), is a per-row array of the step's Sampling:
    a new field needs neither the parser nor the steps changed."""
    values = {"temperature": 0.5, "top_p": 0.9, "top_k": 7, "min_p": 0.1, "seed": 3}
    assert set(values) == {f.name for f in dataclasses.fields(SamplingParams)}
    line = json.dumps({"custom_id": "a", "url": "/v1/completions", "body": {"prompt_token_ids": [1], **values}})
    assert parse_line(line, 1, tokenizer=None, vocab_size=V, max_context=64).sampling == SamplingParams(**values)
    rows = Sampling.of([SamplingParams(**values)], np.zeros((2, 2), np.uint32), np.zeros(2, np.int32), rows=2)
    for name in set(values) - {"seed"}:
        np.testing.assert_allclose(getattr(rows, name), [values[name], getattr(SamplingParams(), name)], rtol=1e-6)


def test_bad_values_name_the_field():
    for kwargs, message in [(dict(top_k=-2), "top_k: must be an int >= 1, or 0 or -1"),
                            (dict(top_k=2.0), "top_k: must be an int"), (dict(min_p=1.5), "min_p: must be in"),
                            (dict(temperature=-1.0), "temperature: must be >= 0"), (dict(top_p=0.0), "top_p: must be"),
                            (dict(temperature=float("nan")), "temperature: must be >= 0; got nan")]:
        with pytest.raises(ValueError, match=message.replace("(", "\\(").replace("[", "\\[")):
            SamplingParams(**kwargs)


@pytest.fixture(scope="module")
def tiny():
    return moejax.load("tiny-qwen3-moe", dtype="float32")


def test_new_values_compile_nothing_and_top_k_one_is_greedy(tiny):
    """The settings are the steps' per-row arrays, never static arguments: once a shape has run, other top_k, min_p,
    top_p and temperature values compile no program. top_k 1 keeps only the most likely token: greedy."""
    prompts = [[1, 2, 3], [7, 8]]
    greedy = tiny.generate(prompts, 6)
    tiny.generate(prompts, 6, temperature=1.0, seed=3)  # the sampling branch, compiled
    with compiles.counting() as counted:
        assert tiny.generate(prompts, 6, temperature=1.0, top_k=1, seed=3) == greedy
        topk = tiny.generate(prompts, 6, temperature=0.8, top_k=7, min_p=0.05, top_p=0.9, seed=3)
        assert tiny.generate(prompts, 6, sampling=SamplingParams(0.8, 0.9, top_k=7, min_p=0.05, seed=3)) == topk
        tiny.generate(prompts, 6, temperature=1.2, min_p=0.3, seed=4)
    assert counted.as_dict()["programs"] == 0, counted.as_dict()["by_function"]
    with pytest.raises(ValueError, match="top_k: must be"):
        tiny.generate(prompts, 2, top_k=-3)


def _line(cid, prompt, **body):
    return json.dumps({"custom_id": cid, "url": "/v1/completions", "body": {"prompt": prompt, "max_tokens": 6, **body}})


@pytest.mark.parametrize("batching", ["static", "continuous"])
def test_served_top_k_and_min_p_requests(tiny, tmp_path, batching):
    """Through the batch runner: top_k 1 at temperature 1 is greedy; a top_k + min_p request among neighbours with
    other settings draws what Engine.generate draws for it alone with its seed."""
    rng = np.random.default_rng(1)
    p = [rng.integers(1, 1024, n).tolist() for n in (5, 9, 14)]
    lines = [_line("greedy-k1", p[0], temperature=1.0, top_k=1, seed=9),
             _line("k-min-p", p[1], temperature=1.0, top_k=8, min_p=0.02, seed=5),
             _line("neighbour", p[2], temperature=0.6, top_p=0.7, seed=6, n=2)]
    out = tmp_path / "out.jsonl"
    summary = serve_lines(tiny, lines, str(out), ServingOptions(batching=batching), seed_nonce=0)
    assert summary["requests_ok"] == len(lines)
    tokens = {r["custom_id"]: r["response"]["body"]["choices"][0]["token_ids"]
              for r in map(json.loads, out.read_text().splitlines())}
    eos = list(tiny.config.eos_token_ids)
    assert tokens["greedy-k1"] == tiny.generate([p[0]], 6, stop_token_ids=eos)[0]
    assert tokens["k-min-p"] == tiny.generate([p[1]], 6, temperature=1.0, top_k=8, min_p=0.02, seed=5,
                                              stop_token_ids=eos)[0]
    assert tokens["k-min-p"] != tiny.generate([p[1]], 6, stop_token_ids=eos)[0]  # it did sample
