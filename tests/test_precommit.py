"""The pre-commit hooks (.pre-commit-config.yaml) run what the lint and type tests run: ruff over tests/test_lint.py's
paths, mypy over pyproject.toml's [tool.mypy] files, each the test extra's own install."""
import os
import re
import shlex
import tomllib

import yaml  # PyYAML: installed with flax
from test_lint import PATHS as LINT_PATHS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _hooks() -> dict:
    with open(os.path.join(ROOT, ".pre-commit-config.yaml")) as f:
        config = yaml.safe_load(f)
    return {hook["id"]: hook for repo in config["repos"] for hook in repo["hooks"]}


def _pyproject() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def _runs_on(hook: dict, path: str) -> bool:
    return re.search(hook.get("files", ""), path) is not None


def _test_extra_has(tool: str) -> bool:
    return any(re.match(rf"{tool}\b", req) for req in _pyproject()["project"]["optional-dependencies"]["test"])


def test_ruff_hook_lints_what_test_lint_lints():
    hook = _hooks()["ruff"]
    assert shlex.split(hook["entry"]) == ["ruff", "check", *LINT_PATHS]
    assert hook["language"] == "system" and _test_extra_has("ruff")  # the test extra's ruff, the CI's version
    assert hook["pass_filenames"] is False  # whole folders, not only the files a commit touches
    assert all(_runs_on(hook, f"{path}/any.py") for path in LINT_PATHS) and _runs_on(hook, "pyproject.toml")


def test_mypy_hook_checks_what_test_types_checks():
    hook = _hooks()["mypy"]
    # no paths and no config of its own: mypy reads pyproject.toml's [tool.mypy], files included, as the test does
    assert shlex.split(hook["entry"]) == ["mypy"] and "args" not in hook
    assert hook["language"] == "system" and _test_extra_has("mypy")
    assert hook["pass_filenames"] is False
    files = _pyproject()["tool"]["mypy"]["files"]
    assert "moejax" in files  # tests/test_types.py's package
    assert all(_runs_on(hook, f"{path}/any.py") for path in files) and _runs_on(hook, "pyproject.toml")
