"""Crash-safe, input-ordered batch output: one result line per input line.

Results complete out of order, so they are appended to ``<output>.partial`` (a journal) as they
finish. A rerun after a crash reads the journal (and any earlier complete output), skips lines
already done, and ``finish`` writes every result in input order to ``<output>.tmp`` and renames
it onto the output atomically.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time

_FSYNC_EVERY_S = 1.0  # flush every write, but fsync at most this often (and always at close)


def request_id(line: int, text: str) -> str:
    """`req_<line>-<fingerprint of the line's text>`: a rerun reuses a result only for the very same request."""
    return f"req_{line}-{hashlib.blake2b(text.encode('utf-8', 'surrogateescape'), digest_size=4).hexdigest()}"


def ok_line(line: int, custom_id: str, body: dict, *, rid: str | None = None) -> dict:
    return {"id": rid or f"req_{line}", "custom_id": custom_id, "response": {"status_code": 200, "body": body},
            "error": None}


def error_line(line: int, custom_id: str | None, message: str, *, code="invalid_request", status=400,
               rid: str | None = None) -> dict:
    return {"id": rid or f"req_{line}", "custom_id": custom_id, "line": line,
            "response": {"status_code": status, "body": None}, "error": {"code": code, "message": message}}


class ResultStore:
    """Output file + a '<output>.partial' journal."""

    def __init__(self, output_path: str | None, expected: dict[int, str | None],
                 ids: dict[int, str] | None = None):
        """expected: line -> custom_id; ids: line -> result id (default `req_<line>`, see request_id)."""
        self.output_path = output_path
        self.expected = dict(expected)
        self.ids = {n: (ids or {}).get(n, f"req_{n}") for n in self.expected}
        # line -> serialized result; keeping the text means a rerun rewrites byte-identical output.
        self._results: dict[int, str] = {}
        self._journal = None
        self._last_fsync = 0.0
        self._closed = False
        if output_path is not None:
            self.journal_path = output_path + ".partial"
            self.tmp_path = output_path + ".tmp"
            # Output first, then journal: later journal entries win over a stale complete run.
            self._load(output_path)
            self._load(self.journal_path)
        self._resumed = len(self._results)

    def _load(self, path: str) -> None:
        try:
            with open(path, encoding="utf-8") as f:
                lines = f.read().split("\n")
        except FileNotFoundError:
            return
        for text in lines:
            try:
                result = json.loads(text)
            except ValueError:
                continue  # blank, torn (crash mid-write) or foreign line
            if not isinstance(result, dict):
                continue
            line = _line_of(result.get("id"))
            # Only reuse a result for the same request (the input file may have changed), and never a server
            # error: those are retried.
            if (line in self.expected and result["id"] == self.ids[line]
                    and result.get("custom_id") == self.expected[line] and _status(result) != 500):
                self._results[line] = text

    def done(self, line: int) -> bool:
        return line in self._results

    @property
    def resumed(self) -> int:
        return self._resumed

    def missing(self) -> list[int]:
        return sorted(n for n in self.expected if n not in self._results)

    def write(self, line: int, result: dict) -> None:
        if result.get("id") != self.ids.get(line, f"req_{line}"):
            raise ValueError(f"result id {result.get('id')!r} does not match line {line}")
        if line not in self.expected:
            raise ValueError(f"line {line} is not an expected input line")
        if self._closed:
            raise RuntimeError("ResultStore is closed")
        text = json.dumps(result)
        self._results[line] = text
        if self.output_path is None:
            return  # stdout mode: nothing to journal, finish() prints
        if self._journal is None:
            self._journal = self._open_journal()
        self._journal.write(text + "\n")
        self._journal.flush()
        now = time.monotonic()
        if now - self._last_fsync >= _FSYNC_EVERY_S:
            os.fsync(self._journal.fileno())
            self._last_fsync = now

    def _open_journal(self):
        journal = open(self.journal_path, "a", encoding="utf-8")
        # A crash may have left a torn last line; start on a fresh line so the next entry parses.
        if journal.tell() > 0:
            with open(self.journal_path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    journal.write("\n")
        return journal

    def finish(self) -> None:
        missing = self.missing()
        if missing:
            first = ", ".join(map(str, missing[:5])) + (", ..." if len(missing) > 5 else "")
            raise RuntimeError(f"{len(missing)} of {len(self.expected)} lines have no result (lines {first})")
        ordered = [self._results[n] + "\n" for n in sorted(self.expected)]
        if self.output_path is None:
            sys.stdout.writelines(ordered)
            sys.stdout.flush()
            self.close()
            return
        with open(self.tmp_path, "w", encoding="utf-8") as f:
            f.writelines(ordered)
            f.flush()
            os.fsync(f.fileno())
        os.replace(self.tmp_path, self.output_path)
        _fsync_dir(os.path.dirname(os.path.abspath(self.output_path)))
        # Only now is the journal redundant: the output holds everything.
        self.close()
        try:
            os.remove(self.journal_path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        if self._journal is not None:
            self._journal.flush()
            os.fsync(self._journal.fileno())
            self._journal.close()
            self._journal = None
        self._closed = True

    def __enter__(self) -> ResultStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_ID = re.compile(r"req_([1-9][0-9]*)(-[0-9a-f]{8})?")


def _line_of(result_id) -> int | None:
    m = _ID.fullmatch(result_id) if isinstance(result_id, str) else None
    return int(m.group(1)) if m else None


def _status(result: dict):
    response = result.get("response")
    return response.get("status_code") if isinstance(response, dict) else None


def _fsync_dir(path: str) -> None:
    # Makes the rename itself durable on POSIX; not supported (or needed) everywhere.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
