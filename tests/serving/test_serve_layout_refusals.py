"""What a layout cannot serve is refused before the weights load, not answered 500 per batch: the pipeline layout
(attn=pp,experts=pp, prefill-only; one stage here, in-process) refuses a run with completions that generate,
naming their lines, or with --allow-invalid-lines answers them 400 with the reason and scores the rest as one
device does; its prefix cache runs off under `--kv-cache auto` (the shared blocks would be kept across batches on
one device) and `--kv-cache on` is refused; --explain lists the refused lines."""
import json
import re

import numpy as np
import pytest
from conftest import fixture_dir

from launch.serve import main

MODEL = fixture_dir("qwen3_moe")
PP = ["--layout", "attn=pp,experts=pp"]
RNG = np.random.default_rng(5)
SHARED = RNG.integers(1, 100, 40).tolist()  # 2.5 blocks shared by every scoring line


def line(cid, url, body) -> str:
    return json.dumps({"custom_id": cid, "url": url, "body": body})


SCORES = [line(f"s{i}", "/v1/score", {"prompt_token_ids": SHARED + RNG.integers(1, 100, 6).tolist(),
                                      "candidate_token_ids": [[8], [9, 10]]}) for i in range(4)]
COMPLETIONS = [line("c1", "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 3}),
               line("echo", "/v1/completions", {"prompt": [5, 6, 7, 8], "max_tokens": 0, "echo": True,
                                                "logprobs": 1})]


def run(tmp_path, lines, *flags, name="out.jsonl") -> dict:
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / name
    status = main(["--model", MODEL, "--dtype", "float32", "--input", str(tmp_path / "in.jsonl"), "--output", str(out),
                   "--max-batch-tokens", "64", *flags])
    assert status in (0, 1)
    return {r["custom_id"]: r["response"] for r in map(json.loads, out.read_text().splitlines())}


def refused(capsys, pattern: str, *args, **kw) -> None:
    """launch.serve refuses the run before any work: exit status 2, one line on stderr matching `pattern`."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        run(*args, **kw)
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and len(err.splitlines()) == 1 and re.search(pattern, err), err


def test_completions_are_refused_up_front_naming_their_lines(tmp_path, capsys):
    lines = [*SCORES[:1], *COMPLETIONS]
    refused(capsys, r"^--layout attn=pp,experts=pp: lines 2 ask for generation; .*prefill-only .*--allow-invalid-lines",
            tmp_path, lines, *PP)
    assert not (tmp_path / "out.jsonl").exists()


def test_allowed_invalid_lines_get_400_and_the_rest_equal_one_device(tmp_path):
    lines = [*SCORES, *COMPLETIONS]
    one = run(tmp_path, lines, name="one.jsonl")
    pp = run(tmp_path, lines, *PP, "--allow-invalid-lines", name="pp.jsonl")
    assert pp["c1"]["status_code"] == 400
    assert "prefill-only scoring" in pp["c1"]["body"]["error"]["message"]
    assert pp["c1"]["body"]["error"]["param"] == "max_tokens"
    for cid in [f"s{i}" for i in range(4)] + ["echo"]:
        assert pp[cid]["status_code"] == 200, (cid, pp[cid])
    for cid in [f"s{i}" for i in range(4)]:
        for got, want in zip(pp[cid]["body"]["results"][0]["candidates"],
                             one[cid]["body"]["results"][0]["candidates"], strict=True):
            assert got["logprob"] == pytest.approx(want["logprob"], rel=1e-5, abs=1e-5), cid
    got = pp["echo"]["body"]["choices"][0]["logprobs"]["token_logprobs"]
    want = one["echo"]["body"]["choices"][0]["logprobs"]["token_logprobs"]
    assert got[0] is None and want[0] is None
    np.testing.assert_allclose(got[1:], want[1:], rtol=1e-5, atol=1e-5)


def test_kv_cache_auto_runs_off_and_on_is_refused(tmp_path, capsys):
    pp = run(tmp_path, SCORES, *PP)
    assert all(r["status_code"] == 200 for r in pp.values()), pp
    assert "kv cache auto: off, layout attn=pp,experts=pp keeps no prefix KV cache" in capsys.readouterr().err
    refused(capsys, r"^--kv-cache on: layout attn=pp,experts=pp keeps no prefix KV cache", tmp_path, SCORES, *PP,
            "--kv-cache", "on", name="on.jsonl")


def test_explain_lists_the_refused_lines(tmp_path, capsys):
    (tmp_path / "in.jsonl").write_text("\n".join([*SCORES[:1], *COMPLETIONS]) + "\n")
    assert main(["--model", MODEL, "--dtype", "float32", "--input", str(tmp_path / "in.jsonl"), *PP,
                 "--allow-invalid-lines", "--explain"]) == 0
    assert "refused (400) lines 2: layout attn=pp,experts=pp runs prefill-only scoring" in capsys.readouterr().out
