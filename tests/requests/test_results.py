import json
import os
import signal
import subprocess
import sys

import pytest
from conftest import kill_when_journal_has

from moejax.requests.results import ResultStore, SettingsMismatch, error_line, fingerprint, ok_line

RESULTS_PY = os.path.join(os.path.dirname(os.path.dirname(__file__)), "..", "moejax", "requests", "results.py")


FP = fingerprint({})  # a store's default settings


def expected_ids(n: int) -> dict[int, str | None]:
    ids = {i: f"c{i}" for i in range(1, n + 1)}
    ids[3] = None  # a line whose custom_id could not be parsed
    return ids


def result_for(line: int, cid: str | None) -> dict:
    if cid is None:
        return error_line(line, None, "bad json")
    return ok_line(line, cid, {"text": f"out {line}", "system_fingerprint": FP})


def expected_text(ids: dict[int, str | None]) -> str:
    return "".join(json.dumps(result_for(n, ids[n])) + "\n" for n in sorted(ids))


def write_all(store: ResultStore, ids: dict, lines) -> None:
    for n in lines:
        store.write(n, result_for(n, ids[n]))


def read(path) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def test_fresh_run_orders_output_and_removes_journal(tmp_path):
    out, ids = str(tmp_path / "out.jsonl"), expected_ids(6)
    with ResultStore(out, ids) as store:
        assert store.resumed == 0 and store.missing() == [1, 2, 3, 4, 5, 6]
        write_all(store, ids, [5, 2, 6, 1, 3, 4])
        assert os.path.exists(out + ".partial")
        store.finish()
    assert read(out) == expected_text(ids)
    assert len(read(out).splitlines()) == 6
    assert not os.path.exists(out + ".partial") and not os.path.exists(out + ".tmp")


def test_line_helpers():
    assert ok_line(2, "a", {"x": 1}) == {"id": "req_2", "custom_id": "a", "error": None,
                                         "response": {"status_code": 200, "request_id": "req_2", "body": {"x": 1}}}
    err = error_line(4, None, "boom", code="internal_error", status=500)
    assert err["id"] == "req_4" and err["line"] == 4 and err["custom_id"] is None
    assert err["response"] == {"status_code": 500, "request_id": "req_4", "body": {"error": {
        "message": "boom", "type": "server_error", "param": None, "code": "internal_error"}}}
    assert err["error"] == {"code": "internal_error", "message": "boom"}
    bad = error_line(5, "c", "body.n: must be 1", param="n")["response"]["body"]["error"]
    assert bad == {"message": "body.n: must be 1", "type": "invalid_request_error", "param": "n",
                   "code": "invalid_request"}


def test_write_rejects_mismatched_id(tmp_path):
    with ResultStore(str(tmp_path / "o.jsonl"), {1: "a", 2: "b"}) as store:
        with pytest.raises(ValueError):
            store.write(1, ok_line(2, "b", {}))


def test_resume_after_crash_with_torn_line(tmp_path):
    out, ids = str(tmp_path / "out.jsonl"), expected_ids(6)
    store = ResultStore(out, ids)
    write_all(store, ids, [4, 1, 3])
    store.close()  # crash: no finish
    with open(out + ".partial", "a", encoding="utf-8") as f:
        f.write(json.dumps(result_for(6, ids[6]))[:20])  # torn half line from a kill mid-write

    with ResultStore(out, ids) as store:
        assert store.resumed == 2  # line 3's error is made again, not reused
        assert [store.done(n) for n in range(1, 7)] == [True, False, False, True, False, False]
        assert store.missing() == [2, 3, 5, 6]
        write_all(store, ids, [6, 2, 5, 3])
        store.finish()
    assert read(out) == expected_text(ids)


def test_journal_later_entry_wins(tmp_path):
    out, ids = str(tmp_path / "out.jsonl"), {1: "a", 2: "b"}
    with ResultStore(out, ids) as store:
        store.write(1, ok_line(1, "a", {"v": "old", "system_fingerprint": FP}))
        store.write(1, ok_line(1, "a", {"v": "new", "system_fingerprint": FP}))
    with ResultStore(out, ids) as store:
        assert store.resumed == 1
        store.write(2, ok_line(2, "b", {}))
        store.finish()
    assert json.loads(read(out).splitlines()[0])["response"]["body"]["v"] == "new"


def test_rerun_after_complete_run_is_identical(tmp_path):
    out, ids = str(tmp_path / "out.jsonl"), expected_ids(5)
    with ResultStore(out, ids) as store:
        write_all(store, ids, [3, 1, 2, 5, 4])
        store.finish()
    before = open(out, "rb").read()
    with ResultStore(out, ids) as store:
        assert store.resumed == 4 and store.missing() == [3]  # an error line is made again
        write_all(store, ids, [3])
        store.finish()
    assert open(out, "rb").read() == before
    assert not os.path.exists(out + ".partial")


def test_changed_input_does_not_reuse_stale_result(tmp_path):
    out, ids = str(tmp_path / "out.jsonl"), expected_ids(4)
    with ResultStore(out, ids) as store:
        write_all(store, ids, [1, 2, 3, 4])
        store.finish()
    changed = {**ids, 2: "renamed", 3: "now-known"}  # line 3's custom_id was None before
    with ResultStore(out, changed) as store:
        assert store.missing() == [2, 3]
        assert store.done(1) and store.done(4) and store.resumed == 2


def test_stdout_mode_prints_in_order(tmp_path, capsys):
    ids = expected_ids(4)
    with ResultStore(None, ids) as store:
        write_all(store, ids, [4, 2, 1, 3])
        store.finish()
    assert capsys.readouterr().out == expected_text(ids)
    assert os.listdir(tmp_path) == []


def test_finish_with_missing_lines_raises(tmp_path):
    out, ids = str(tmp_path / "out.jsonl"), expected_ids(10)
    with ResultStore(out, ids) as store:
        write_all(store, ids, [1, 2, 4])
        with pytest.raises(RuntimeError, match=r"7 of 10 .*lines 3, 5, 6, 7, 8, \.\.\."):
            store.finish()
    assert not os.path.exists(out)


# Loads results.py by path so the child does not import jax via moejax/__init__.py (keeps it fast).
CHILD = """
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("results", sys.argv[1])
results = importlib.util.module_from_spec(spec); spec.loader.exec_module(results)
ids = {i: f"c{i}" for i in range(1, 41)}
store = results.ResultStore(sys.argv[2], ids)
for n in sorted(ids, reverse=True):  # out of order, like length-sorted batches
    if not store.done(n):
        store.write(n, results.ok_line(n, ids[n], {"text": f"out {n}", "system_fingerprint": store.fingerprint}))
        time.sleep(0.05)
store.finish()
"""


@pytest.mark.slow
def test_sigkill_midway_then_resume(tmp_path):
    out = str(tmp_path / "out.jsonl")
    ids = {i: f"c{i}" for i in range(1, 41)}
    child = subprocess.Popen([sys.executable, "-c", CHILD, RESULTS_PY, out])
    kill_when_journal_has(child, out + ".partial", 3, timeout=10)  # the header and two results
    assert child.returncode == -signal.SIGKILL and not os.path.exists(out)

    with ResultStore(out, ids) as store:
        assert 2 <= store.resumed < 40
        for n in store.missing():
            store.write(n, ok_line(n, ids[n], {"text": f"out {n}", "system_fingerprint": FP}))
        store.finish()
    lines = read(out).splitlines()
    assert [json.loads(s)["id"] for s in lines] == [f"req_{n}" for n in range(1, 41)]
    assert read(out) == "".join(json.dumps(ok_line(n, ids[n], {"text": f"out {n}", "system_fingerprint": FP})) + "\n"
                                for n in range(1, 41))


def made_with(settings: dict, line: int, cid: str) -> dict:
    return ok_line(line, cid, {"text": f"out {line}", "system_fingerprint": fingerprint(settings)})


@pytest.mark.parametrize("complete", [False, True], ids=["journal", "output"])
def test_results_made_with_other_settings_are_refused_and_kept(tmp_path, complete):
    out, ids = str(tmp_path / "out.jsonl"), {1: "a", 2: "b"}
    before = {"model": "m1", "dtype": "float32"}
    store = ResultStore(out, ids, settings=before)
    store.write(1, made_with(before, 1, "a"))
    if complete:
        store.write(2, made_with(before, 2, "b"))
        store.finish()
    store.close()
    files = {p: read(p) for p in (out, out + ".partial") if os.path.exists(p)}
    with pytest.raises(SettingsMismatch, match="made with other settings") as e:
        ResultStore(out, ids, settings={"model": "m1", "dtype": "bfloat16"})
    if not complete:  # the journal's header names what changed
        assert "dtype 'float32' then, 'bfloat16' now" in str(e.value)
    assert {p: read(p) for p in files} == files  # nothing changed
    with ResultStore(out, ids, settings=before) as store:  # the same settings resume
        assert store.resumed == (2 if complete else 1)


def test_a_resumed_journal_keeps_its_seed_nonce(tmp_path):
    out, ids = str(tmp_path / "out.jsonl"), {1: "a", 2: "b"}
    store = ResultStore(out, ids, seed_nonce=1234)
    store.write(1, result_for(1, "a"))
    store.close()
    with ResultStore(out, ids, seed_nonce=99) as store:
        assert store.seed_nonce == 1234 and store.resumed == 1
