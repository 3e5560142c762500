"""A benchmark's results file, `{"runs": [...]}`: each run of a benchmark adds one record. While a run measures, its
record is written after every measured row, marked `"partial": true` with how far it got (`"progress"`), and each
write replaces the previous one: a run that is stopped (a time limit, a crash, a lease that ends) leaves what it
measured, once. The complete record drops both marks."""
from __future__ import annotations

import json
import os
import tempfile
import time


def read_runs(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return json.load(f)["runs"]


def write_json(path: str, value: object) -> None:
    """Whole or not at all (a scratch file renamed over `path`): a kill mid-write leaves the previous file."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, scratch = tempfile.mkstemp(dir=folder, prefix=".write-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(value, f, indent=1)
        os.replace(scratch, path)
    except BaseException:
        os.unlink(scratch)
        raise


def write_runs(path: str, runs: list[dict]) -> None:
    write_json(path, {"runs": runs})


class ResultsFile:
    """This run's record in `path`, after the runs already there."""

    def __init__(self, path: str) -> None:
        self.path, self.earlier, self.rows, self.started = path, read_runs(path), 0, time.monotonic()

    def partial(self, record: dict, last: str) -> None:
        """After a measured row: the record so far; `last` names the row (e.g. "gemm T=8192 pallas")."""
        self.rows += 1
        progress = dict(rows=self.rows, last=last, seconds=round(time.monotonic() - self.started, 1))
        write_runs(self.path, self.earlier + [dict(record, partial=True, progress=progress)])

    def complete(self, record: dict) -> int:
        """The finished record; returns how many runs the file holds."""
        write_runs(self.path, self.earlier + [record])
        return len(self.earlier) + 1


def no_file(record: dict, last: str) -> None:
    """`partial` for a benchmark called without a results file (tests, other scripts)."""
