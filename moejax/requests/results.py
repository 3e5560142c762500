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
from typing import TextIO

_FSYNC_EVERY_S = 1.0  # flush every write, but fsync at most this often (and always at close)


def request_id(line: int, text: str) -> str:
    """`req_<line>-<fingerprint of the line's text>`: a rerun reuses a result only for the very same request."""
    return f"req_{line}-{hashlib.blake2b(text.encode('utf-8', 'surrogateescape'), digest_size=4).hexdigest()}"


ERROR_TYPES = {400: "invalid_request_error", 500: "server_error"}


def ok_line(line: int, custom_id: str, body: dict, *, rid: str | None = None) -> dict:
    """An OpenAI Batch output line for a served request."""
    rid = rid or f"req_{line}"
    return {"id": rid, "custom_id": custom_id, "response": {"status_code": 200, "request_id": rid, "body": body},
            "error": None}


def error_line(line: int, custom_id: str | None, message: str, *, code: str = "invalid_request", status: int = 400,
               rid: str | None = None, param: str | None = None) -> dict:
    """An OpenAI Batch output line for a refused (4xx) or failed (5xx) request: the body is OpenAI's error object.
    `line` and the top-level `error` (code, message) are kept for readers of earlier moejax output."""
    rid = rid or f"req_{line}"
    error = {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": param, "code": code}
    return {"id": rid, "custom_id": custom_id, "line": line,
            "response": {"status_code": status, "request_id": rid, "body": {"error": error}},
            "error": {"code": code, "message": message}}


def fingerprint(settings: dict) -> str:
    """`fp_<hash>` of the settings that decide a result (OpenAI's system_fingerprint)."""
    text = json.dumps(settings, sort_keys=True, separators=(",", ":"))
    return "fp_" + hashlib.blake2b(text.encode("utf-8"), digest_size=6).hexdigest()


class WriteFailed(RuntimeError):
    """The output or its journal could not be written (full disk, read-only folder, ...). What reached the journal
    before is kept; a rerun resumes from it."""


class SettingsMismatch(ValueError):
    """An existing output or journal holds results computed with other settings."""


class ResultStore:
    """Output file + a '<output>.partial' journal. The journal starts with a header naming the settings that
    produced it; a served result carries their fingerprint (`body.system_fingerprint`). A rerun reuses only
    results of the same request made with the same settings, and refuses (SettingsMismatch, before writing
    anything) an output or journal whose results were made with other settings."""

    def __init__(self, output_path: str | None, expected: dict[int, str | None],
                 ids: dict[int, str] | None = None, *, settings: dict | None = None, seed_nonce: int = 0):
        """expected: line -> custom_id; ids: line -> result id (default `req_<line>`, see request_id); settings:
        what decides a result (model, dtype, kernels, ...); seed_nonce: what requests without a seed derive
        theirs from (a resumed journal's own nonce wins, so a resumed run samples as the first would have)."""
        self.output_path = output_path
        self.expected = dict(expected)
        self.ids = {n: (ids or {}).get(n, f"req_{n}") for n in self.expected}
        self.settings = dict(settings or {})
        self.fingerprint = fingerprint(self.settings)
        self.seed_nonce = seed_nonce
        # line -> serialized result; keeping the text means a rerun rewrites byte-identical output.
        self._results: dict[int, str] = {}
        self._failed: set[int] = set()  # lines whose result is an error (loaded results are all served ones)
        self._journal: TextIO | None = None
        self._has_header = False
        self._foreign: dict[str, int] = {}  # file -> results made with other settings
        self._foreign_settings: dict | None = None  # another journal header's settings
        self._last_fsync = 0.0
        self._closed = False
        if output_path is not None:
            self.journal_path = output_path + ".partial"
            # Output first, then journal: later journal entries win over a stale complete run.
            self._load(output_path)
            self._load(self.journal_path, journal=True)
            if self._foreign or self._foreign_settings is not None:
                raise SettingsMismatch(self._mismatch())
        self._resumed = len(self._results)

    def _load(self, path: str, journal: bool = False) -> None:
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
            if journal and isinstance(result.get(_HEADER), dict):
                self._read_header(result[_HEADER])
                continue
            line = _line_of(result.get("id"))
            # Only a result for the same request (the input file may have changed), and only a served one: errors
            # are made again (validation is cheap; a failed batch is retried).
            if (line not in self.expected or result["id"] != self.ids[line]
                    or result.get("custom_id") != self.expected[line] or _status(result) != 200):
                continue
            if _body(result).get("system_fingerprint") != self.fingerprint:
                self._foreign[path] = self._foreign.get(path, 0) + 1
                continue
            self._results[line] = text

    def _read_header(self, header: dict) -> None:
        if header.get("settings") == self.settings:
            self._has_header = True
            if isinstance(header.get("seed_nonce"), int):
                self.seed_nonce = header["seed_nonce"]
        else:
            self._foreign_settings = header.get("settings") if isinstance(header.get("settings"), dict) else {}

    def _mismatch(self) -> str:
        held = "; ".join(f"{path} holds {n} result{'s' * (n > 1)} made with other settings"
                         for path, n in self._foreign.items())
        if self._foreign_settings is not None:
            then = self._foreign_settings
            diff = [f"{k} {then.get(k)!r} then, {self.settings.get(k)!r} now" for k in sorted({*then, *self.settings})
                    if then.get(k) != self.settings.get(k)]
            held = "; ".join(filter(None, [held, f"{self.journal_path} was written with other settings: "
                                           + (", ".join(diff) or "unknown")]))
        return (f"{held} (this run's fingerprint: {self.fingerprint}). Nothing was changed: rerun with the settings "
                f"that made them to resume, or remove {self.output_path} and {self.output_path}.partial, or write "
                "to another output")

    def texts(self) -> dict[int, str]:
        """line -> its result as written (JSON text), for the lines that have one."""
        return dict(self._results)

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
        if _status(result) == 200:
            self._failed.discard(line)
        else:
            self._failed.add(line)
        if self.output_path is None:
            return  # stdout mode: nothing to journal, finish() prints
        try:
            if self._journal is None:
                self._journal = self._open_journal()
            self._journal.write(text + "\n")
            self._journal.flush()
            now = time.monotonic()
            if now - self._last_fsync >= _FSYNC_EVERY_S:
                os.fsync(self._journal.fileno())
                self._last_fsync = now
        except OSError as e:
            self._abandon_journal()
            raise WriteFailed(f"{self.journal_path}: cannot write results: {e.strerror or e}. The results it holds are "
                              "kept: make room (or fix the folder's permissions) and rerun the same command to "
                              "resume") from None

    def _open_journal(self) -> TextIO:
        journal = open(self.journal_path, "a", encoding="utf-8")
        # A crash may have left a torn last line; start on a fresh line so the next entry parses.
        if journal.tell() > 0:
            with open(self.journal_path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    journal.write("\n")
        if not self._has_header:
            header = {"settings": self.settings, "fingerprint": self.fingerprint, "seed_nonce": self.seed_nonce}
            journal.write(json.dumps({_HEADER: header}) + "\n")
            self._has_header = True
        return journal

    def finish(self, error_path: str | None = None) -> None:
        """Write every result in input order (to stdout when there is no output path), and the failed ones (4xx,
        5xx) to `error_path` when given; then drop the journal."""
        missing = self.missing()
        if missing:
            first = ", ".join(map(str, missing[:5])) + (", ..." if len(missing) > 5 else "")
            raise RuntimeError(f"{len(missing)} of {len(self.expected)} lines have no result (lines {first})")
        ordered = [self._results[n] + "\n" for n in sorted(self.expected)]
        errors = [self._results[n] + "\n" for n in sorted(self._failed)]
        if self.output_path is None:
            sys.stdout.writelines(ordered)
            sys.stdout.flush()
            if error_path is not None:
                _write_atomically(error_path, errors)
            self.close()
            return
        try:
            self.close()  # everything is in the journal before the output is written
            _write_atomically(self.output_path, ordered)
            if error_path is not None:
                _write_atomically(error_path, errors)
        except OSError as e:
            raise WriteFailed(f"{getattr(e, 'filename', None) or self.output_path}: cannot write the results: "
                              f"{e.strerror or e}. Every result is kept in {self.journal_path}: make room and rerun "
                              "the same command to write the output without computing anything") from None
        # Only now is the journal redundant: the output holds everything.
        try:
            os.remove(self.journal_path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        if self._journal is not None:
            try:
                self._journal.flush()
                os.fsync(self._journal.fileno())
                self._journal.close()
            except OSError:
                self._abandon_journal()
                raise
            self._journal = None
        self._closed = True

    def _abandon_journal(self) -> None:
        """After a failed write: close without flushing again (a torn last line is skipped on resume)."""
        journal, self._journal, self._closed = self._journal, None, True
        if journal is not None:
            try:
                journal.close()  # retries the flush, fails again, and closes the file all the same
            except OSError:
                pass

    def __enter__(self) -> ResultStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_ID = re.compile(r"req_([1-9][0-9]*)(-[0-9a-f]{8})?")


def _line_of(result_id: object) -> int | None:
    m = _ID.fullmatch(result_id) if isinstance(result_id, str) else None
    return int(m.group(1)) if m else None


_HEADER = "moejax_journal"


def _body(result: dict) -> dict:
    body = result["response"].get("body")
    return body if isinstance(body, dict) else {}


def _status(result: dict) -> object:  # the response's status_code as written (an int when valid)
    response = result.get("response")
    return response.get("status_code") if isinstance(response, dict) else None


def _write_atomically(path: str, lines: list[str]) -> None:
    """`path` holds all of `lines` or is as it was: written to `<path>.tmp`, synced, renamed over it."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(lines)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


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
