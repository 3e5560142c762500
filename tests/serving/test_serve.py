"""The batch runner `python -m launch.serve`: JSONL requests in, one result line per input line out, in order.

Most tests call `serve_lines` / `explain_lines` in-process on one module-scoped engine, or the CLI's main(argv);
subprocesses are used only where the process is the point (the CLI itself, stdin, SIGKILL)."""
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile

import numpy as np
import pytest
from conftest import fixture_dir, kill_when_journal_has, serve_stopped
from garbage import FORMAT_EXAMPLES, damage
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import moejax
from launch import serve as serve_cli
from moejax.kernels.platform import on_gpu
from moejax.requests.parse import CompletionRequest, parse_lines
from moejax.sched.batch import explain_lines, serve_lines
from moejax.sched.serving_options import ServingOptions

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples", "requests.jsonl")
TINY = "tiny-qwen3-moe"  # no tokenizer, vocab 1024, context 2048
DEFAULT = "pycode-moe"  # launch.serve's default: the embedded trained model, with a tokenizer
TINY_VOCAB, TINY_CONTEXT, TINY_EOS = 1024, 2048, 0
FLAGS = ["--model", "--input", "--output", "--dtype", "--max-batch-tokens", "--kv-cache", "--metrics", "--explain"]


def read_text(path) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def example_lines() -> list[str]:
    return read_text(EXAMPLES).splitlines()


def cli(*args, input=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "launch.serve", *args], cwd=ROOT, capture_output=True, text=True,
                          input=input, timeout=timeout)


def rows_of(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines()]


def summary_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("# ")]
    assert len(lines) == 1, stderr
    return lines[0]


def score(cid, prompt, cands, suffixes=None) -> str:
    body = {"prompt_token_ids": prompt, "candidate_token_ids": cands}
    if suffixes is not None:
        body["suffixes"] = suffixes
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/score", "body": body})


def completion(cid, prompt, max_tokens, **extra) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/completions",
                       "body": {"prompt_token_ids": prompt, "max_tokens": max_tokens, **extra}})


def check_score_body(body: dict, req_body: dict) -> None:
    """Structure and normalization of one /v1/score body against the request that produced it."""
    assert body["object"] == "score"
    cands = req_body.get("candidate_token_ids") or req_body["candidates"]
    assert len(body["results"]) == len(req_body.get("suffixes", [None]))  # one result per suffix (sibling)
    for res in body["results"]:
        assert len(res["candidates"]) == len(cands)
        assert math.isclose(sum(c["prob"] for c in res["candidates"]), 1.0, abs_tol=1e-9)
        lps = [c["logprob"] for c in res["candidates"]]
        assert all(math.isfinite(x) and x < 0 for x in lps)
        assert res["best_index"] == int(np.argmax(lps))
        assert res["best"] == res["candidates"][res["best_index"]]["text"]
        # prob is the softmax of the logprobs over the candidates
        norm = math.log(sum(math.exp(x) for x in lps))
        for c, lp in zip(res["candidates"], lps, strict=True):
            assert math.isclose(c["prob"], math.exp(lp - norm), rel_tol=1e-6, abs_tol=1e-12)
        if "candidate_token_ids" in req_body:
            assert [c["token_ids"] for c in res["candidates"]] == cands


def check_completion_body(body: dict, req_body: dict, eos=(TINY_EOS,)) -> None:
    assert body["object"] == "text_completion"
    (choice,) = body["choices"]
    ids, max_tokens = choice["token_ids"], req_body.get("max_tokens", 16)
    assert 1 <= len(ids) <= max_tokens
    assert all(isinstance(t, int) for t in ids)
    assert choice["finish_reason"] in ("stop", "length")
    if choice["finish_reason"] == "length":
        assert len(ids) == max_tokens
    elif not req_body.get("stop"):
        assert ids[-1] in tuple(req_body.get("stop_token_ids", ())) + tuple(eos)
    usage = body["usage"]
    assert usage["completion_tokens"] == len(ids)
    assert usage["total_tokens"] == usage["prompt_tokens"] + len(ids)


def line_no(row: dict) -> int:
    """The input line a result belongs to: ids are `req_<line>-<fingerprint of the line>`."""
    m = re.fullmatch(r"req_(\d+)-[0-9a-f]{8}", row["id"])
    assert m, row["id"]
    return int(m.group(1))


def check_ok(row: dict, n: int, line: str) -> dict:
    req = json.loads(line)
    assert line_no(row) == n and row["custom_id"] == req["custom_id"], row
    assert row["error"] is None and row["response"]["status_code"] == 200, row
    body = row["response"]["body"]
    if req["url"] == "/v1/score":
        check_score_body(body, req["body"])
    else:
        check_completion_body(body, req["body"])
    return body


@pytest.fixture(scope="module")
def tiny():
    return moejax.load(TINY, dtype="float32")


@pytest.fixture(scope="module")
def qwen3(qwen3_engine):
    assert qwen3_engine.tokenizer is not None
    return qwen3_engine


# ---- 1. the main job on the examples, and --help ---------------------------------------------------------------------

@pytest.mark.slow
def test_main_job_on_examples():
    """The README's first command: the text examples on the embedded trained model, answered as a Python
    programmer expects."""
    lines = example_lines()
    r = cli("--input", EXAMPLES, "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    rows = rows_of(r.stdout)  # stdout holds only result lines: the summary goes to stderr
    assert [line_no(row) for row in rows] == list(range(1, len(lines) + 1))
    kinds, ranked, answers = set(), 0, {}
    for n, (row, line) in enumerate(zip(rows, lines, strict=True), start=1):
        body = check_ok(row, n, line)
        kinds.add(body["object"])
        req_body = json.loads(line)["body"]
        if "suffixes" in req_body:  # the multi-suffix (ranking) request: one result per suffix
            assert len(req_body["suffixes"]) > 1 and len(body["results"]) == len(req_body["suffixes"])
            ranked += 1
        answers[row["custom_id"]] = [res["best"] for res in body["results"]] if "results" in body else \
            req_body["prompt"] + body["choices"][0]["text"]
    assert kinds == {"score", "text_completion"} and ranked == 1
    # the trained model picks the closing token a programmer would (its model card says what it gets wrong)
    assert answers["close-init"] == ["):"] and answers["is-none"] == [" None"]
    assert answers["close-each-call"][0] == ")" and answers["close-each-call"][2] == "v)"
    prompts = {json.loads(line)["custom_id"]: json.loads(line)["body"].get("prompt") for line in lines}
    for cid in ("complete-append", "complete-read", "complete-repr"):
        assert len(answers[cid]) > len(prompts[cid])  # text came back, not token ids only
    summary = summary_line(r.stderr)
    assert summary.startswith(f"# {DEFAULT} on ")
    assert f"{len(lines)} ok, 0 failed, 0 resumed" in summary


@pytest.mark.slow
def test_batch_files_of_openai_vllm_and_sglang_run_unchanged(tmp_path):
    """examples/formats.jsonl as those APIs' clients write their batch files (chat and completions with the fields
    they carry, SGLang and vLLM scoring), on a checkpoint with a chat template: every line served, exit 0."""
    out, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    r = cli("--model", fixture_dir("qwen3_moe"), "--input", os.path.join(ROOT, "examples", "formats.jsonl"),
            "--output", str(out), "--error-file", str(errors))
    assert r.returncode == 0, r.stderr
    rows = rows_of(read_text(out))
    assert [row["custom_id"] for row in rows] == [f"request-{i}" for i in range(1, 7)]
    assert [row["response"]["status_code"] for row in rows] == [200] * 6 and read_text(errors) == ""
    assert [row["response"]["body"]["object"] for row in rows] == [
        "chat.completion", "chat.completion", "text_completion", "text_completion", "scoring", "list"]
    assert rows[0]["response"]["body"]["model"] == "gpt-4o-mini"


@pytest.mark.slow
def test_help_as_a_process():
    r = cli("--help", timeout=120)
    assert r.returncode == 0, r.stderr
    assert "default auto: the checkpoint's own" in r.stdout  # --dtype
    for flag in FLAGS:
        assert flag in r.stdout, flag


@pytest.mark.parametrize("args, message", [
    (["--input", "/nonexistent/requests.jsonl"], "--input: cannot read"),
    (["--input", EXAMPLES, "--max-batch-tokens", "8"], "--max-batch-tokens must be >= 16"),
    (["--input", EXAMPLES, "--model", "/nonexistent/model-dir"], "neither a checkpoint directory nor a preset"),
    (["--input", EXAMPLES, "--output", "/nonexistent/dir/out.jsonl"], "--output: folder '/nonexistent/dir'"),
])
def test_cli_argument_errors_exit_with_a_message(args, message, capsys):
    status, text = serve_stopped(capsys, args)
    assert message in text and "\n" not in text
    assert status == (1 if "/nonexistent/model-dir" in args else 2)  # a flag the user got wrong: 2


@pytest.mark.parametrize("flag, value, message", [
    ("--num-layers", "0", "--num-layers must be >= 1"),
    ("--device-memory-gb", "0", "--device-memory-gb must be > 0"),
    ("--device-memory-gb", "nan", "--device-memory-gb must be a finite number"),
    ("--cache-slots", "0", "--cache-slots must be >= 1"),
    ("--prefix-cache-mb", "-1", "--prefix-cache-mb must be >= 0"),
    ("--window", "0", "--window must be >= 1"),
    ("--prefetch-distance", "0", "--prefetch-distance must be >= 1"),
])
def test_numeric_flags_are_checked_before_the_model_loads(flag, value, message, capsys):
    # The model does not exist: a message about the flag shows it was checked before anything loaded.
    status, text = serve_stopped(capsys, ["--input", EXAMPLES, "--model", "/nonexistent/model-dir", flag, value])
    assert status == 2 and message in text


@pytest.mark.skipif(on_gpu(), reason="GPU-only backends run here")
@pytest.mark.parametrize("kernels", ["pallas", "experts=xla,attention=cudnn"])
def test_gpu_only_kernels_are_refused_before_anything_loads(kernels, capsys):
    status, text = serve_stopped(capsys, ["--input", EXAMPLES, "--model", "/nonexistent/model-dir", "--kernels",
                                          kernels])
    assert status == 2 and text.startswith(f"--kernels {kernels}: ") and "needs an NVIDIA GPU" in text
    with pytest.raises(ValueError, match="needs an NVIDIA GPU"):
        moejax.load(TINY, kernels=kernels)


def test_process_id_must_be_below_the_process_count(tmp_path, capsys):
    status, text = serve_stopped(capsys, ["--input", EXAMPLES, "--output", str(tmp_path / "o.jsonl"), "--coordinator",
                                          "127.0.0.1:1", "--num-processes", "2", "--process-id", "2"])
    assert status == 2 and "--process-id must be below --num-processes (2); got 2" in text


@pytest.mark.parametrize("how", ["same path", "symlink", "journal"])
def test_output_that_is_the_input_is_refused_and_the_requests_survive(tmp_path, how, capsys):
    name = "out.jsonl.partial" if how == "journal" else "requests.jsonl"  # journal: OUTPUT.partial is the input
    requests = tmp_path / name
    requests.write_bytes(open(EXAMPLES, "rb").read())
    before = requests.read_bytes()
    output = {"same path": str(tmp_path / "." / name), "symlink": str(tmp_path / "link.jsonl"),
              "journal": str(tmp_path / "out.jsonl")}[how]
    if how == "symlink":
        os.symlink(requests, output)
    status, text = serve_stopped(capsys, ["--input", str(requests), "--output", output, "--model",
                                          "/nonexistent/model-dir"])
    assert status == 2 and "is the input file" in text and "refusing to overwrite the requests" in text
    assert requests.read_bytes() == before


@pytest.mark.parametrize("flags, message", [
    (["--error-file", "{input}"], "--error-file {input}: is the input file"),
    (["--output", "{dir}/o.jsonl", "--error-file", "{dir}/o.jsonl"],
     "--error-file {dir}/o.jsonl: is the --output file"),
    (["--error-file", "{dir}/missing/e.jsonl"], "--error-file: folder '{dir}/missing' does not exist"),
])
def test_an_error_file_that_would_destroy_something_is_refused(tmp_path, flags, message, capsys):
    requests = tmp_path / "requests.jsonl"
    requests.write_bytes(open(EXAMPLES, "rb").read())
    fill = lambda text: text.format(input=requests, dir=tmp_path)  # noqa: E731
    status, text = serve_stopped(capsys, ["--input", str(requests), *map(fill, flags), "--model",
                                          "/nonexistent/model-dir"])
    assert status == 2 and text.startswith(fill(message)), text
    assert requests.read_bytes() == open(EXAMPLES, "rb").read()


# ---- 2. --explain ----------------------------------------------------------------------------------------------

def test_explain_loads_no_weights():
    engine = moejax.load(DEFAULT, dtype="float32")  # the examples' model (text); a fresh engine, so nothing ran yet
    assert engine._state is None
    lines = example_lines() + ["not json", completion("late", [1, 2, 3], 4)]
    text = explain_lines(engine, lines, ServingOptions(max_batch_tokens=64))
    assert engine._state is None
    assert "prefix KV cache:" in text and "batches:" in text
    assert "score" in text and "completion" in text
    # the paged pool holds every sequence's prompt and max_tokens at once here (the default 1 GiB is more)
    parsed = parse_lines(lines, tokenizer=engine.tokenizer, vocab_size=engine.config.vocab_size,
                         max_context=engine.config.max_position_embeddings)
    need = sum(-(-(len(r.prompt) + r.max_tokens) // 16) * r.n for r in parsed if isinstance(r, CompletionRequest))
    assert re.search(rf"KV pool \(continuous batching\): {need} blocks of 16 tokens", text), text
    n_batches = int(re.search(r"(\d+) batches:", text).group(1))
    assert n_batches >= 2 and len(re.findall(r"^\s+\d+ (score|completion) ", text, re.M)) == n_batches


def test_explain_loads_no_checkpoint_weights():
    engine = moejax.load(fixture_dir("qwen3_moe"), dtype="float32")
    line = json.dumps({"custom_id": "t", "url": "/v1/score",
                       "body": {"prompt": "the cat sat on the mat", "candidates": [" yes", " no"]}})
    text = explain_lines(engine, [line])
    assert engine._state is None and "1 batches:" in text


@pytest.mark.slow
def test_explain_process_writes_no_output(tmp_path):
    out = tmp_path / "out.jsonl"
    r = cli("--input", EXAMPLES, "--output", str(out), "--explain", "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    assert "batches:" in r.stdout and "prefix KV cache:" in r.stdout
    assert '"status_code"' not in r.stdout  # a plan, not results
    assert os.listdir(tmp_path) == []  # no output, no journal, no tmp file


# ---- 3. bad lines ----------------------------------------------------------------------------------------------

GOOD_SCORE = [11, 12, 13, 14, 15, 16, 17, 18]

BAD_LINE_CASES = [  # (line, custom_id reported, message fragment)
    ('{"custom_id": "nj", "url": "/v1/score", "body": {', None, "not JSON"),
    (json.dumps({"url": "/v1/score", "body": {"prompt_token_ids": [1], "candidate_token_ids": [[2]]}}),
     None, "custom_id: missing"),
    (json.dumps({"custom_id": "type", "url": "/v1/completions", "body": {"prompt_token_ids": [1, 2],
                                                                          "max_tokens": "8"}}),
     "type", "body.max_tokens: must be an int >= 1; got '8'"),
    (json.dumps({"custom_id": "ids-type", "url": "/v1/score",
                 "body": {"prompt_token_ids": [1, "2"], "candidate_token_ids": [[3]]}}),
     "ids-type", "body.prompt_token_ids[1]: must be a token id (int)"),
    (json.dumps({"custom_id": "url", "url": "/v1/embeddings", "body": {"prompt_token_ids": [1]}}),
     "url", "url '/v1/embeddings': unknown"),
    (json.dumps({"custom_id": "chat", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user",
                                                                                          "content": "hi"}]}}),
     "chat", "body.messages: this model has no chat template"),
    (score("long-score", [7] * (TINY_CONTEXT - 1), [[1, 2, 3]]), "long-score",
     f"= {TINY_CONTEXT + 1} tokens exceed the model's context of {TINY_CONTEXT}"),
    (completion("long-completion", [7] * (TINY_CONTEXT - 4), 8), "long-completion",
     f"max_tokens 8 = {TINY_CONTEXT + 4} tokens exceed the model's context of {TINY_CONTEXT}"),
    (score("no-cands", [1, 2, 3], []), "no-cands", "body.candidate_token_ids: must be a non-empty list"),
    (score("good-1", [5, 6, 7], [[8]]), "good-1", "custom_id 'good-1' duplicates line 1"),
    (json.dumps({"custom_id": "text", "url": "/v1/score", "body": {"prompt": "hello", "candidate_token_ids": [[1]]}}),
     "text", "body.prompt: model has no tokenizer; send prompt_token_ids"),
    (json.dumps({"custom_id": "text-cands", "url": "/v1/score",
                 "body": {"prompt_token_ids": [1], "candidates": ["a", "b"]}}),
     "text-cands", "body.candidates: model has no tokenizer"),
    (score("oov", [1, 2, TINY_VOCAB], [[3]]), "oov", f"token id {TINY_VOCAB} outside the vocabulary [0, {TINY_VOCAB})"),
    (score("oov-cand", [1, 2], [[3], [-1]]), "oov-cand", "body.candidate_token_ids[1][0]: token id -1 outside"),
    (completion("zero", [1, 2, 3], 0), "zero", "body.max_tokens: must be an int >= 1; got 0"),
    ("", None, "empty line"),
    ("[1, 2]", None, "not a JSON object"),
]


def good_lines(k: int) -> list[str]:
    """Varied good lines, the k-th for the k-th gap between bad lines."""
    if k == 0:
        return [score("good-1", GOOD_SCORE, [[501], [502]])]
    if k % 3 == 1:
        return [completion(f"good-c{k}", [20 + k, 30, 40], 1 + k % 5)]
    if k % 3 == 2:
        return [score(f"good-s{k}", GOOD_SCORE + [100 + k], [[601, 602], [603]], suffixes=[[k], [k, k + 1]])]
    return [score(f"good-s{k}", [200 + k] * (k + 2), [[700 + k]] * 1 + [[701]])]


def test_bad_lines_get_400_and_the_rest_is_served_in_order(tiny, tmp_path):
    lines, expected = [], {}  # line number -> (custom_id, message fragment) for bad lines
    for k, (bad, cid, fragment) in enumerate(BAD_LINE_CASES):
        lines += good_lines(k)
        lines.append(bad)
        expected[len(lines)] = (cid, fragment)
    lines += good_lines(len(BAD_LINE_CASES))
    out = tmp_path / "out.jsonl"
    summary = serve_lines(tiny, lines, str(out), ServingOptions(max_batch_tokens=256))
    rows = rows_of(read_text(out))
    assert [line_no(row) for row in rows] == list(range(1, len(lines) + 1))
    ok_bodies = {}
    for n, (row, line) in enumerate(zip(rows, lines, strict=True), start=1):
        if n in expected:
            cid, fragment = expected[n]
            message = row["error"]["message"]
            error = {"message": message, "type": "invalid_request_error",
                     "param": row["response"]["body"]["error"]["param"], "code": "invalid_request"}
            assert line_no(row) == n and row == {"id": row["id"], "custom_id": cid, "line": n,
                           "response": {"status_code": 400, "request_id": row["id"], "body": {"error": error}},
                           "error": {"code": "invalid_request", "message": message}}, row
            assert fragment in row["error"]["message"], (n, row["error"]["message"])
        else:
            ok_bodies[n] = check_ok(row, n, line)
    assert summary["requests_failed"] == len(BAD_LINE_CASES)
    assert summary["requests_ok"] == len(lines) - len(BAD_LINE_CASES) == len(ok_bodies)
    assert summary["lines"] == len(lines)
    assert not os.path.exists(str(out) + ".partial")

    # Bad lines do not change what the good ones get.
    good = [line for n, line in enumerate(lines, start=1) if n not in expected]
    alone = tmp_path / "alone.jsonl"
    serve_lines(tiny, good, str(alone), ServingOptions(max_batch_tokens=256))
    for row, body in zip(rows_of(read_text(alone)), ok_bodies.values(), strict=True):
        got = row["response"]["body"]
        if body["object"] == "score":
            for r1, r2 in zip(got["results"], body["results"], strict=True):
                np.testing.assert_allclose([c["logprob"] for c in r1["candidates"]],
                                           [c["logprob"] for c in r2["candidates"]], atol=1e-4)
        else:
            assert got["choices"][0]["token_ids"] == body["choices"][0]["token_ids"]


def test_bytes_that_are_not_utf8_make_their_line_a_400_naming_the_byte(tmp_path):
    good_score, good_completion = score("ok-1", GOOD_SCORE, [[501], [502]]), completion("ok-2", [5, 6, 7], 2)
    in_value = score("bad-bytes", [1, 2], [[3]]).encode().replace(b'"url"', b'"x\xff": 1, "url"')
    in_id = completion("bad-\xe9", [1], 1).encode().replace(b"\\u00e9", b"\xe9")  # a Latin-1 custom_id
    requests = tmp_path / "requests.jsonl"
    requests.write_bytes(b"\n".join([good_score.encode(), in_value, in_id, good_completion.encode()]) + b"\n")
    out = tmp_path / "out.jsonl"
    argv = ["--input", str(requests), "--output", str(out), "--model", TINY, "--dtype", "float32"]
    assert serve_cli.main(argv) == 1  # lines failed
    rows = rows_of(out.read_bytes().decode("utf-8"))  # the output itself is UTF-8
    assert [line_no(row) for row in rows] == [1, 2, 3, 4]
    check_ok(rows[0], 1, good_score)
    check_ok(rows[3], 4, good_completion)
    for row, cid, raw in ((rows[1], "bad-bytes", in_value), (rows[2], None, in_id)):
        assert row["response"]["status_code"] == 400 and row["custom_id"] == cid, row
        at = raw.index(b"\xff" if cid else b"\xe9")
        assert f"not valid UTF-8: byte 0x{raw[at]:02x} at byte {at} of the line" in row["error"]["message"], row
    # A rerun reuses every line; the output still holds the invalid lines' 400s, so the status stays 1 unless
    # invalid input is allowed.
    assert serve_cli.main(argv) == 1
    assert serve_cli.main(argv + ["--allow-invalid-lines"]) == 0


def test_all_lines_bad_still_writes_every_line(tiny, tmp_path):
    out = tmp_path / "out.jsonl"
    lines = ["nope", completion("z", [1], 0), ""]
    summary = serve_lines(tiny, lines, str(out))
    rows = rows_of(read_text(out))
    assert [line_no(row) for row in rows] == [1, 2, 3]
    assert all(row["response"]["status_code"] == 400 for row in rows)
    assert summary["requests_failed"] == 3 and summary["requests_ok"] == 0


def test_empty_input_writes_an_empty_file(tiny, tmp_path):
    out = tmp_path / "out.jsonl"
    summary = serve_lines(tiny, [], str(out))
    assert read_text(out) == "" and summary["lines"] == 0 and summary["requests_ok"] == 0


# ---- 4. text requests on a checkpoint with a tokenizer ---------------------------------------------------------

def text_score_line(cid="ts"):
    return json.dumps({"custom_id": cid, "url": "/v1/score",
                       "body": {"prompt": "Question: is the cat on the mat?", "candidates": [" yes", " no", " maybe"],
                                "suffixes": [" Answer:", " Reply:", [46, 22]]}})


def text_completion_line(cid, prompt, max_tokens, **extra):
    return json.dumps({"custom_id": cid, "url": "/v1/completions",
                       "body": {"prompt": prompt, "max_tokens": max_tokens, **extra}})


# a tokenizer's whole serve run (about 20 s); tests/requests/test_openai_models.py serves text prompts in the fast tier
@pytest.mark.slow
def test_text_requests_with_a_tokenizer(qwen3, tmp_path):
    tok = qwen3.tokenizer
    prompt = "the cat sat on"
    lines = [text_score_line(), text_completion_line("free", prompt, 20)]
    out = tmp_path / "out.jsonl"
    serve_lines(qwen3, lines, str(out))
    rows = rows_of(read_text(out))
    assert [row["response"]["status_code"] for row in rows] == [200, 200], rows

    sc = rows[0]["response"]["body"]
    check_score_body(sc, json.loads(lines[0])["body"])
    texts = [" yes", " no", " maybe"]
    assert len(sc["results"]) == 3
    for res in sc["results"]:
        assert [c["text"] for c in res["candidates"]] == texts  # echoed as sent
        assert [c["token_ids"] for c in res["candidates"]] == [tok.encode(t, add_special_tokens=False).ids
                                                                for t in texts]
        assert res["best"] in texts
    assert sc["usage"]["prompt_tokens"] == sum(
        len(tok.encode("Question: is the cat on the mat?").ids) + len(s)
        for s in (tok.encode(" Answer:", add_special_tokens=False).ids,
                  tok.encode(" Reply:", add_special_tokens=False).ids, [46, 22]))

    free = rows[1]["response"]["body"]["choices"][0]
    assert free["finish_reason"] == "length" and len(free["token_ids"]) == 20
    assert free["text"] == tok.decode(free["token_ids"])
    text = free["text"]
    # A stop string that occurs in the middle of the free-running greedy text, and one that never occurs.
    stop = next(text[i:i + 2] for i in range(len(text) // 3, len(text) - 2) if text[i:i + 2].strip())
    never = "\u00a7never\u00a7"
    assert never not in text
    lines2 = [text_completion_line("stopped", prompt, 20, stop=[never, stop]),
              text_completion_line("single-stop", prompt, 20, stop=stop),
              text_completion_line("not-hit", prompt, 20, stop=never)]
    out2 = tmp_path / "out2.jsonl"
    serve_lines(qwen3, lines2, str(out2))
    rows2 = rows_of(read_text(out2))
    for row in rows2[:2]:
        choice = row["response"]["body"]["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        assert stop not in choice["text"] and never not in choice["text"]
        assert choice["text"] == text[:text.find(stop)]
        ids = choice["token_ids"]
        assert 1 <= len(ids) < 20 and ids == free["token_ids"][:len(ids)]
        assert row["response"]["body"]["usage"]["completion_tokens"] == len(ids)
    not_hit = rows2[2]["response"]["body"]["choices"][0]
    assert not_hit["finish_reason"] == "length" and not_hit["text"] == text
    assert not_hit["token_ids"] == free["token_ids"]


def test_text_lines_that_cannot_be_served(qwen3, tmp_path):
    lines = [
        json.dumps({"custom_id": "nl", "url": "/v1/score", "body": {"prompt": "hi", "candidates": ["\n"]}}),
        text_score_line("ok"),
        json.dumps({"custom_id": "long", "url": "/v1/completions",
                    "body": {"prompt": "a" * 300, "max_tokens": 4}}),
    ]
    out = tmp_path / "out.jsonl"
    serve_lines(qwen3, lines, str(out))
    rows = rows_of(read_text(out))
    assert [row["response"]["status_code"] for row in rows] == [400, 200, 400]
    assert "tokenizes to no tokens" in rows[0]["error"]["message"]  # this fixture's vocabulary has no newline
    assert "exceed the model's context of 256" in rows[2]["error"]["message"]


# ---- 5. stdin and --metrics ------------------------------------------------------------------------------------

@pytest.mark.slow
def test_stdin_input_and_metrics_file(tmp_path):
    metrics = tmp_path / "m.json"
    # The examples (whose compiled steps test_main_job_on_examples left in the persistent cache) plus a bad line.
    lines = example_lines()
    lines.insert(2, "garbage")
    r = cli("--input", "-", "--metrics", str(metrics), "--dtype", "float32", input="\n".join(lines) + "\n")
    assert r.returncode == 1, r.stderr  # a line failed (invalid input)
    rows = rows_of(r.stdout)
    assert [line_no(row) for row in rows] == list(range(1, len(lines) + 1))
    assert rows[2]["response"]["status_code"] == 400 and "not JSON" in rows[2]["error"]["message"]
    generated = prompt_tokens = 0
    for n, (row, line) in enumerate(zip(rows, lines, strict=True), start=1):
        if n != 3:
            body = check_ok(row, n, line)
            prompt_tokens += body["usage"]["prompt_tokens"]
            generated += body["usage"].get("completion_tokens", 0)
    k = next(k for k, line in enumerate(lines) if '"suffixes"' in line)  # the ranking request
    req = json.loads(lines[k])["body"]  # each suffix's context counts whole; texts are tokenized on their own
    tokens = moejax.load(DEFAULT).tokenizer  # (loads no weights)
    count = lambda text: len(tokens.encode(text, add_special_tokens=False).ids)  # noqa: E731
    assert rows[k]["response"]["body"]["usage"]["prompt_tokens"] == sum(
        count(req["prompt"]) + count(s) for s in req["suffixes"])
    m = json.loads(read_text(metrics))
    assert m["model"] == DEFAULT and m["dtype"] == "float32" and m["lines"] == len(lines)
    assert m["requests_ok"] == len(lines) - 1 and m["requests_failed"] == 1 and m["requests_resumed"] == 0
    assert m["requests_invalid"] == 1 and m["requests_batch_failed"] == 0
    assert m["prompt_tokens"] == prompt_tokens and m["generated_tokens"] == generated
    assert isinstance(m["tokens_per_s"], float) and m["tokens_per_s"] > 0
    assert math.isclose(m["tokens_per_s"], (prompt_tokens + generated) / m["wall_s"], rel_tol=1e-9)
    assert 0.0 <= m["prefix_cache_hit_rate"] <= 1.0
    assert math.isclose(m["prefix_cache_hit_rate"], m["cached_prompt_tokens"] / prompt_tokens)
    assert f"{len(lines) - 1} ok, 1 failed" in summary_line(r.stderr)


# ---- a failing batch costs only its own requests -----------------------------------------------------------------

def test_failing_batch_gives_500_to_its_requests_only(tiny, tmp_path, monkeypatch):
    calls = []
    real_score = tiny.score_packed

    def flaky_score(batch, pool=None, span=(0, None)):
        calls.append(batch["tokens"].shape)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return real_score(batch, pool, span)

    def broken_generate(*args, **kwargs):
        raise MemoryError("no room")

    monkeypatch.setattr(tiny, "score_packed", flaky_score)
    monkeypatch.setattr(tiny, "generate_rows", broken_generate)
    # Each score request needs a 64-token row of its own at this budget, so it is a batch of its own; the
    # longest goes first, into the failing call.
    lines = [score("s50", list(range(100, 150)), [[1], [2]]),
             score("s60", list(range(200, 260)), [[1], [2]]),
             "nope",
             completion("c", [1, 2, 3], 4),
             score("s40", list(range(300, 340)), [[1], [2]])]
    out = tmp_path / "out.jsonl"
    summary = serve_lines(tiny, lines, str(out), ServingOptions(max_batch_tokens=64, batching="static"))
    assert len(calls) == 3 and summary["batches"] == 4
    rows = rows_of(read_text(out))
    assert [line_no(row) for row in rows] == list(range(1, 6))
    assert [row["response"]["status_code"] for row in rows] == [200, 500, 400, 500, 200]
    assert rows[1]["custom_id"] == "s60" and rows[1]["error"]["code"] == "internal_error"
    assert rows[1]["error"]["message"] == "batch failed: RuntimeError: boom"
    assert rows[3]["error"]["message"] == "batch failed: MemoryError: no room"
    check_ok(rows[0], 1, lines[0])
    check_ok(rows[4], 5, lines[4])
    assert summary["requests_ok"] == 2 and summary["requests_failed"] == 3
    assert summary["requests_batch_failed"] == 2 and summary["requests_invalid"] == 1
    assert serve_cli.exit_status(summary, allow_invalid_lines=True) == 1  # 500s are never allowed
    # Rerun with the engine healthy and line 3 fixed: server errors are retried, the changed line is served
    # anew (its id fingerprints the new text), the rest is reused.
    monkeypatch.undo()
    lines[2] = score("fixed", [5, 6, 7], [[1], [2]])
    summary = serve_lines(tiny, lines, str(out), ServingOptions(max_batch_tokens=64))
    rows = rows_of(read_text(out))
    assert [row["response"]["status_code"] for row in rows] == [200] * 5
    assert summary["requests_resumed"] == 2 and summary["requests_ok"] == 3
    check_ok(rows[2], 3, lines[2])


# ---- 6. kill and resume ----------------------------------------------------------------------------------------

RESUME_N = 60


def resume_input(path) -> list[str]:
    rng = np.random.default_rng(0)
    lines = []
    for i in range(RESUME_N):
        prompt = rng.integers(1, TINY_VOCAB, int(rng.integers(3, 50))).tolist()
        cands = [rng.integers(1, TINY_VOCAB, int(rng.integers(1, 3))).tolist() for _ in range(int(rng.integers(2, 4)))]
        lines.append(score(f"r{i}", prompt, cands))
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return lines


def resumed_count(stderr: str) -> int:
    return int(re.search(r"(\d+) resumed", summary_line(stderr)).group(1))


def logprobs(rows) -> list[list[float]]:
    return [[c["logprob"] for res in row["response"]["body"]["results"] for c in res["candidates"]] for row in rows]


def serve_in_process(capsys, argv) -> tuple[int, str]:
    """launch.serve's main(argv) in this process -> (exit status, what it wrote to stderr)."""
    capsys.readouterr()
    status = serve_cli.main(argv)
    return status, capsys.readouterr().err


@pytest.mark.slow
def test_sigkill_then_resume_completes_the_output(tmp_path, capsys):
    """The run is killed as a process; the resumes and the reference run are launch.serve's main in this process
    (reading the journal is the same in a fresh process)."""
    inp, out, ref = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "ref.jsonl"
    journal = str(out) + ".partial"
    resume_input(inp)
    args = ["--input", str(inp), "--max-batch-tokens", "64", "--dtype", "float32", "--model", TINY]

    child = subprocess.Popen([sys.executable, "-m", "launch.serve", *args, "--output", str(out)], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kill_when_journal_has(child, journal, 3, timeout=240, poll=0.005)
    assert child.returncode == -signal.SIGKILL  # it really was interrupted
    assert not os.path.exists(out)
    done = read_text(journal).count("\n")
    assert 3 <= done < RESUME_N

    # Resuming with another dtype would mix two models' answers in one file: refused, naming it; nothing changed.
    journal_before = read_text(journal)
    with pytest.raises(SystemExit) as refused:
        serve_cli.main([a if a != "float32" else "bfloat16" for a in args] + ["--output", str(out)])
    assert "dtype 'float32' then, 'bfloat16' now" in refused.value.code, refused.value.code
    assert read_text(journal) == journal_before and not os.path.exists(out)

    status, err = serve_in_process(capsys, args + ["--output", str(out)])
    assert status == 0, err
    assert 0 < resumed_count(err) < RESUME_N
    assert not os.path.exists(journal) and not os.path.exists(str(out) + ".tmp")
    rows = rows_of(read_text(out))
    assert [line_no(row) for row in rows] == list(range(1, RESUME_N + 1))
    assert [row["custom_id"] for row in rows] == [f"r{i}" for i in range(RESUME_N)]
    assert all(row["response"]["status_code"] == 200 for row in rows)

    # Same numbers as an uninterrupted run (batches differ, so only up to float32 noise).
    status, err = serve_in_process(capsys, args + ["--output", str(ref)])
    assert status == 0, err
    assert resumed_count(err) == 0
    want = logprobs(rows_of(read_text(ref)))
    got = logprobs(rows)
    assert [len(x) for x in got] == [len(x) for x in want]
    np.testing.assert_allclose(np.concatenate(got), np.concatenate(want), atol=1e-4, rtol=0)

    # A rerun on the complete output recomputes nothing and rewrites it byte for byte.
    before = read_text(out)
    status, err = serve_in_process(capsys, args + ["--output", str(out)])
    assert status == 0, err
    assert resumed_count(err) == RESUME_N
    assert "0 computed" in summary_line(err)
    assert read_text(out) == before
    assert not os.path.exists(journal)


# ---- 7. property: garbage in, one line out per line -------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 40) | st.sampled_from([1024, 2**31, 2**63, -2**70, 10**40])
    | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)


@st.composite
def mutated_example(draw, examples):
    obj = json.loads(draw(st.sampled_from(examples)))
    return damage(draw, obj, json_values, rewrite=draw(st.booleans()))


def garbage_lines(examples):
    line = st.one_of(st.text(max_size=30), json_values.map(json.dumps), mutated_example(examples),
                     st.sampled_from(examples))
    return st.lists(line, max_size=6)


GARBAGE = settings(max_examples=20, deadline=None,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@GARBAGE
@given(lines=garbage_lines(example_lines()))
def test_garbage_lines_one_result_each_in_order(tiny, lines):
    check_garbage(tiny, lines)


# 10 generated files of garbage through serve (about 25 s); tests/requests/test_requests.py checks each bad field fast
@pytest.mark.slow
@settings(GARBAGE, max_examples=10)
@given(lines=garbage_lines([json.dumps(x) for x in FORMAT_EXAMPLES]))
def test_garbage_in_the_openai_and_sglang_formats(qwen3, lines):
    check_garbage(qwen3, lines)


def check_garbage(engine, lines):
    lines = [line.replace("\n", " ") for line in lines]  # one request per line, as read from a file
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "out.jsonl")
        summary = serve_lines(engine, lines, out, ServingOptions(max_batch_tokens=256))
        text = read_text(out)
        assert not os.path.exists(out + ".partial")
    rows = rows_of(text)
    assert len(rows) == len(lines) == summary["lines"]
    for i, row in enumerate(rows, start=1):
        assert line_no(row) == i
        if row["error"] is None:
            assert row["response"]["status_code"] == 200 and row["response"]["body"]["object"] in (
                "score", "scoring", "list", "text_completion", "chat.completion")
            assert row["custom_id"] == json.loads(lines[i - 1])["custom_id"]
        else:
            assert row["response"]["status_code"] in (400, 500) and row["response"]["body"]["error"]["message"]
            assert row["error"]["code"] and row["error"]["message"] == row["response"]["body"]["error"]["message"]
    assert summary["requests_ok"] + summary["requests_failed"] == len(lines)


def test_generation_stops_at_generation_config_eos_ids(tmp_path):
    """generation_config.json's eos ids replace config.json's, as in transformers' generate (here config.json's
    eos is 0 and the file names a token this prompt reaches greedily)."""
    path = tmp_path / "model"
    shutil.copytree(fixture_dir("qwen3_moe"), path)
    prompt = [5, 6, 7, 8]
    free = moejax.load(str(path), dtype="float32").generate([prompt], max_new_tokens=8, temperature=0.0,
                                                             stop_token_ids=())[0]
    at = next(i for i in range(1, len(free)) if free[i] not in free[:i] and free[i] != 0)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [free[at], 99999]}))
    engine = moejax.load(str(path), dtype="float32")
    assert engine.config.eos_token_ids == (free[at], 99999)
    out = tmp_path / "out.jsonl"
    serve_lines(engine, [completion("c", prompt, 8)], str(out))
    (choice,) = rows_of(read_text(out))[0]["response"]["body"]["choices"]
    assert choice["finish_reason"] == "stop" and choice["token_ids"] == free[: at + 1]
