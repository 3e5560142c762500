"""mypy over the package and the launch/ entry points with pyproject.toml's [tool.mypy] settings."""
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Not marked slow: mypy checks the package and launch/ in about 25 s of one core, the fast tier's type check.
@pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="mypy is not installed (pip install -e .[test])")
def test_mypy_finds_nothing(monkeypatch):
    from mypy import api

    # the cache goes to the null device: nothing left behind in the checkout, every run checks from scratch
    args = ["--config-file", os.path.join(ROOT, "pyproject.toml"), "--cache-dir", os.devnull, "--no-error-summary",
            "--show-error-codes", os.path.join(ROOT, "moejax"), os.path.join(ROOT, "launch")]
    monkeypatch.chdir(ROOT)  # the paths mypy prints are the checkout's
    stdout, stderr, status = api.run(args)
    assert status == 0, f"mypy moejax launch (exit {status}):\n{stdout}{stderr}"
