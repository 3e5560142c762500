"""Faults while writing results: a read-only folder is refused before anything loads; a full disk stops the run
with every result that reached the journal intact, the earlier output untouched, and a rerun (after making room)
completes with the same results. Real file systems: a small tmpfs (mounting needs root; skipped otherwise)."""
import contextlib
import json
import os
import subprocess
import sys

import pytest

from moejax.requests.results import ResultStore, WriteFailed, ok_line
from moejax.sched.batch import serve_lines

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@contextlib.contextmanager
def tmpfs(path, size: str, *, read_only: bool = False):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    os.makedirs(path, exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True,
                             text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def grow(path, size: str) -> None:
    """Make room: the tmpfs gets bigger, its files stay."""
    subprocess.run(["mount", "-o", f"remount,size={size}", str(path)], check=True)


def complete_lines(path) -> list[dict]:
    """The journal's complete lines (a torn last line, cut by the full disk, is not one)."""
    text = open(path, encoding="utf-8").read()
    return [json.loads(x) for x in text.split("\n")[:-1]]


def same_choices(row: dict, want: dict) -> None:
    """The same tokens and text; log-probabilities equal up to float32 noise (other batches, other shapes)."""
    assert row["custom_id"] == want["custom_id"]
    got, ref = row["response"]["body"]["choices"][0], want["response"]["body"]["choices"][0]
    assert (got["token_ids"], got["text"]) == (ref["token_ids"], ref["text"])
    assert got["logprobs"]["tokens"] == ref["logprobs"]["tokens"]
    assert got["logprobs"]["token_logprobs"] == pytest.approx(ref["logprobs"]["token_logprobs"], abs=1e-5)


@pytest.mark.slow
def test_a_read_only_folder_is_refused_before_anything_loads(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    context = tmpfs(folder, "64k", read_only=True) if os.geteuid() == 0 else contextlib.nullcontext()
    if os.geteuid() != 0:
        folder.chmod(0o555)
    with context:
        r = subprocess.run([sys.executable, "-m", "launch.serve", "--input", "examples/requests.jsonl", "--output",
                            str(folder / "out.jsonl"), "--model", "/nonexistent"], cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 2 and r.stdout == "", r  # a path the user got wrong: 2
        # The model named does not exist: this message shows the folder was checked before anything loaded.
        assert r.stderr.strip().startswith(f"--output: cannot write in '{folder}'") and "Traceback" not in r.stderr
        assert os.listdir(folder) == []


@pytest.fixture(scope="module")
def engine(qwen3_engine):
    return qwen3_engine


@pytest.mark.slow  # two serve runs (about 16 s); the other faults are fast
def test_a_full_disk_stops_the_run_and_a_rerun_completes_it(engine, tmp_path):
    lines = [json.dumps({"custom_id": f"c{i}", "url": "/v1/completions",
                         "body": {"prompt": [5 + i, 6, 7], "max_tokens": 4, "logprobs": 20}}) for i in range(12)]
    serve_lines(engine, lines, str(tmp_path / "want.jsonl"))
    want = [json.loads(x) for x in (tmp_path / "want.jsonl").read_text().splitlines()]
    assert len((tmp_path / "want.jsonl").read_text()) > 2 * 16384  # more than the disk holds

    with tmpfs(tmp_path / "disk", "16k") as disk:
        out = str(disk / "out.jsonl")
        with pytest.raises(WriteFailed, match="No space left on device.*rerun the same command to resume"):
            serve_lines(engine, lines, out)
        kept = complete_lines(out + ".partial")
        assert not os.path.exists(out)
        results = [r for r in kept if "moejax_journal" not in r]
        assert results, "some results reached the journal"
        for r in results:  # each one whole and right
            same_choices(r, want[int(r["custom_id"][1:])])

        grow(disk, "1m")
        summary = serve_lines(engine, lines, out)
        assert summary["requests_resumed"] == len(results) and summary["requests_ok"] == 12 - len(results)
        got = [json.loads(x) for x in open(out, encoding="utf-8").read().splitlines()]
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            same_choices(g, w)
        assert not os.path.exists(out + ".partial")


def test_a_full_disk_while_writing_the_output_keeps_the_old_output_and_the_journal(tmp_path):
    ids = {n: f"c{n}" for n in range(1, 11)}
    with tmpfs(tmp_path / "disk", "48k") as disk:
        out = str(disk / "out.jsonl")
        with open(out, "w") as f:
            f.write("an earlier output\n")
        store = ResultStore(out, ids)  # (the earlier output holds no result of these requests)
        for n in ids:
            store.write(n, ok_line(n, ids[n], {"text": "x" * 3000, "system_fingerprint": store.fingerprint}))
        with pytest.raises(WriteFailed, match="Every result is kept in .*out.jsonl.partial"):
            store.finish()  # the journal (~30 kB) fits; a second copy of it does not
        assert open(out).read() == "an earlier output\n" and not os.path.exists(out + ".tmp")
        assert len([r for r in complete_lines(out + ".partial") if "id" in r]) == 10

        grow(disk, "1m")
        with ResultStore(out, ids) as store:
            assert store.resumed == 10
            store.finish()
        assert [json.loads(x)["custom_id"] for x in open(out).read().splitlines()] == list(ids.values())
