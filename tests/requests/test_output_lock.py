"""One runner per output: a second runner on the same --output (its journal) or --error-file is refused, naming the
first's pid and host; a killed runner's lock file blocks nobody; a rerun afterwards resumes as before.

The other runner is a real process that takes the lock through moejax.requests.output_lock, loaded from its file so
that the process starts without importing JAX; launch.serve itself runs in this process."""
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import threading

import pytest
from conftest import serve_stopped

from launch import serve as serve_cli
from moejax.requests import output_lock

fcntl = pytest.importorskip("fcntl")  # POSIX; without it nothing is locked (tested below by taking it away)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODULE = os.path.join(ROOT, "moejax", "requests", "output_lock.py")
TINY = "tiny-qwen3-moe"

# Takes the locks of argv[1:] and prints "held" (or exits 1 with the refusal); holds them until stdin closes.
RUNNER = f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("output_lock", {MODULE!r})
lock = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lock)
try:
    with lock.hold(*sys.argv[1:]):
        print("held", flush=True)
        sys.stdin.read()
except lock.OutputLockError as e:
    sys.exit(f"refused: {{e}}")
"""


def start_holder(*paths) -> subprocess.Popen:
    """Another runner, holding the locks of `paths` once this returns."""
    child = subprocess.Popen([sys.executable, "-c", RUNNER, *map(str, paths)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "held\n", child.communicate()
    return child


def release(child: subprocess.Popen) -> None:
    child.communicate(input="", timeout=30)
    assert child.returncode == 0


def refusal(paths) -> str:
    with pytest.raises(output_lock.OutputLockError) as refused:
        with output_lock.hold(*map(str, paths)):
            pass
    return str(refused.value)


@pytest.mark.slow
def test_a_second_process_is_refused_naming_the_first_and_runs_once_it_is_done(tmp_path):
    out = tmp_path / "out.jsonl"
    with output_lock.hold(str(out)):
        second = subprocess.run([sys.executable, "-c", RUNNER, str(out)], capture_output=True, text=True, timeout=60)
        assert second.returncode != 0 and second.stdout == ""
        message = second.stderr
        assert f"process {os.getpid()} on host {socket.gethostname()}" in message, message
        assert f"{out}.lock" in message and "Refused, nothing changed" in message
    assert not os.path.exists(f"{out}.lock")  # a clean release leaves nothing behind
    second = subprocess.run([sys.executable, "-c", RUNNER, str(out)], input="", capture_output=True, text=True,
                            timeout=60)
    assert second.returncode == 0 and second.stdout == "held\n", second.stderr


@pytest.mark.slow
def test_a_killed_runner_leaves_a_lock_file_that_blocks_nobody(tmp_path):
    out = tmp_path / "out.jsonl"
    child = start_holder(out)
    message = refusal([out])
    assert f"process {child.pid} on host {socket.gethostname()}" in message, message
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert json.loads((tmp_path / "out.jsonl.lock").read_text())["pid"] == child.pid  # stale, left behind
    with output_lock.hold(str(out)):
        assert json.loads((tmp_path / "out.jsonl.lock").read_text())["pid"] == os.getpid()
    assert not os.path.exists(f"{out}.lock")


@pytest.mark.slow
def test_other_outputs_are_not_blocked_but_a_shared_error_file_is(tmp_path):
    a, b, errors = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "errors.jsonl"
    child = start_holder(a, errors)
    try:
        with output_lock.hold(str(b)):
            pass
        message = refusal([b, errors])  # the error file is rewritten whole at the end: one runner at a time
        assert f"{errors} is being written by another runner (process {child.pid}" in message, message
        assert not os.path.exists(f"{b}.lock")  # the lock it did take was given back
        assert f"process {child.pid}" in refusal([tmp_path / "." / "a.jsonl"])  # the same file by another name
    finally:
        release(child)


def test_reentrant_in_its_thread_refused_in_another(tmp_path):
    out = str(tmp_path / "out.jsonl")
    refused = []

    def other_thread():
        try:
            with output_lock.hold(out):
                pass
        except output_lock.OutputLockError as e:
            refused.append(str(e))

    with output_lock.hold(out):
        with output_lock.hold(out):  # launch.serve holds it, then serve_lines takes it again
            pass
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
        assert os.path.exists(f"{out}.lock")  # still held after the inner release
    assert len(refused) == 1 and f"another thread of this process (pid {os.getpid()})" in refused[0]
    assert not os.path.exists(f"{out}.lock")


def test_without_fcntl_the_run_goes_on_and_says_it_is_not_locked(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(output_lock, "fcntl", None)  # as on Windows
    monkeypatch.setattr(output_lock, "_warned", False)
    with output_lock.hold(str(tmp_path / "out.jsonl")):
        pass
    assert "has no fcntl, so outputs are not locked" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_on_a_file_system_without_locks_the_run_goes_on_and_says_so(tmp_path, monkeypatch, capsys):
    class NoLocks:  # what flock answers there (some FUSE and network mounts); no such mount here
        LOCK_EX, LOCK_NB = fcntl.LOCK_EX, fcntl.LOCK_NB

        @staticmethod
        def flock(fd, operation):
            raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(output_lock, "fcntl", NoLocks)
    with output_lock.hold(str(tmp_path / "out.jsonl")):
        pass
    assert f"cannot lock {tmp_path / 'out.jsonl.lock'} (No locks available" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_a_lock_file_that_is_the_input_is_refused(tmp_path, capsys):
    requests = tmp_path / "req.jsonl.lock"
    requests.write_text("{}\n")
    status, text = serve_stopped(capsys, ["--input", str(requests), "--output", str(tmp_path / "req.jsonl"), "--model",
                                          "/nonexistent"])
    assert status == 2 and "is the input file" in text
    assert requests.read_text() == "{}\n"


def score(cid, prompt, cands) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/score",
                       "body": {"prompt_token_ids": prompt, "candidate_token_ids": cands}})


@pytest.mark.slow
def test_launch_serve_is_refused_while_another_runner_writes_its_output_and_resumes_after(tmp_path, capsys):
    """The issue's case: a second launch.serve on an output another runner is writing exits non-zero, naming it,
    before its model loads, with the first's output and journal untouched; once the first is killed, a rerun
    resumes."""
    lines = [score(f"c{i}", [5 + i, 6, 7, 8], [[9], [10, 11]]) for i in range(3)]
    first, requests = tmp_path / "first.jsonl", tmp_path / "requests.jsonl"
    first.write_text("\n".join(lines[:2]) + "\n")
    requests.write_text("\n".join(lines) + "\n")
    out, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    args = ["--model", TINY, "--dtype", "float32", "--output", str(out)]
    assert serve_cli.main(["--input", str(first), *args]) == 0  # what an earlier run left: 2 of the 3 lines
    before = out.read_bytes()
    journal = tmp_path / "out.jsonl.partial"
    journal.write_text("a journal the first runner is writing\n")

    child = start_holder(out)
    with pytest.raises(SystemExit) as refused:
        serve_cli.main(["--input", str(requests), *args])
    message = str(refused.value.code)
    assert message.startswith(f"--output {out}: ") and f"process {child.pid} on host {socket.gethostname()}" in message
    assert out.read_bytes() == before and journal.read_text() == "a journal the first runner is writing\n"
    with pytest.raises(SystemExit) as refused:  # no model could load: refused before loading one
        serve_cli.main(["--input", str(requests), "--output", str(tmp_path / "other.jsonl"),
                        "--error-file", str(out), "--model", "/nonexistent/model-dir"])
    assert str(refused.value.code).startswith(f"--error-file {out}: ") and f"process {child.pid}" in refused.value.code
    assert not os.path.exists(tmp_path / "other.jsonl.lock")

    child.send_signal(signal.SIGKILL)  # the first runner crashes: its lock file stays, its lock does not
    child.wait()
    assert os.path.exists(f"{out}.lock")
    capsys.readouterr()
    assert serve_cli.main(["--input", str(requests), *args, "--error-file", str(errors)]) == 0
    assert "1 ok, 0 failed, 2 resumed" in capsys.readouterr().err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["custom_id"] for r in rows] == ["c0", "c1", "c2"]
    assert out.read_text().startswith(before.decode())
    assert not os.path.exists(f"{out}.lock") and not os.path.exists(f"{errors}.lock")
