"""A pytest plugin (`-p launch.bench.pytest_outcomes --outcomes FILE`): each test's outcome is appended to FILE as one
JSON line as soon as it is known, so a run stopped at its time limit still says which tests passed (a junit
report is written only at the end)."""
from __future__ import annotations

import json

import pytest

_path: list[str] = []  # the file this session writes to, once configured


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--outcomes", default=None, help="append each test's outcome to this JSON-lines file")


def pytest_configure(config: pytest.Config) -> None:
    _path[:] = [config.getoption("outcomes")] if config.getoption("outcomes") else []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if not _path or not (report.when == "call" or report.failed or report.skipped):
        return
    outcome: str = "error" if report.failed and report.when != "call" else report.outcome
    if hasattr(report, "wasxfail"):
        outcome = "xfailed" if report.skipped else "xpassed"
    line = dict(test=report.nodeid, outcome=outcome, when=report.when, seconds=round(report.duration, 3))
    if report.failed:
        line["message"] = report.longreprtext[-2000:]
    elif report.skipped and isinstance(report.longrepr, tuple):
        line["message"] = str(report.longrepr[2])[:300]
    with open(_path[0], "a") as f:
        f.write(json.dumps(line) + "\n")
