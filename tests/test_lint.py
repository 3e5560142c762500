"""ruff over the code with pyproject.toml's [tool.ruff] settings (pycodestyle errors and warnings, pyflakes, import
order, bugbear, pyupgrade)."""
import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATHS = ("moejax", "launch", "tests", "examples")  # named, so scratch folders at the root are never linted


# Not marked slow though it starts a process: ruff takes about a second, and the fast tier is the daily lint.
@pytest.mark.skipif(importlib.util.find_spec("ruff") is None, reason="ruff is not installed (pip install -e .[test])")
def test_ruff_finds_nothing():
    # --no-cache: leave nothing behind in the checkout
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", *PATHS],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"ruff check {' '.join(PATHS)} (exit {run.returncode}):\n{run.stdout}{run.stderr}"
