"""The documentation lives in the repository and stands alone: the README is an orientation of at most 200 lines,
every relative link in it and in docs/ reaches a file of the repository, and no tracked file points outside the
repository (a sibling `shared` folder, the machine's work folder) or names a tracker's issue by number."""
import glob
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
PAGES = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
# Markdown links and images: [text](target) and ![alt](target); the target ends at whitespace or ")".
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
# Written in pieces so that this file does not match itself.
OUTSIDE = re.compile(re.escape("../" + "shared") + "|" + re.escape("/" + "work/"))
ISSUE = re.compile(r"\bissues?\s*#?\s*\d+", re.IGNORECASE)


def tracked_files() -> list[str]:
    """The repository's tracked files (git ls-files); without git, every file under the root but .git."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60).stdout
        return [os.path.join(ROOT, p) for p in out.decode().split("\0") if p]
    except (OSError, subprocess.SubprocessError):
        return [os.path.join(d, f) for d, dirs, files in os.walk(ROOT) if ".git" not in d.split(os.sep) for f in files]


def text_of(path: str) -> str | None:
    """The file's text, or None for a binary file (a NUL byte or not UTF-8) or one that is gone."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def test_the_readme_is_an_orientation_of_at_most_200_lines():
    with open(README, encoding="utf-8") as f:
        lines = f.read().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move reference content into docs/"


def test_docs_exist_with_the_design_and_the_topic_pages():
    names = {os.path.basename(p) for p in PAGES}
    assert {"design.md", "papers.md", "serving-and-formats.md", "placements.md", "layouts.md", "plans.md",
            "kernels.md", "benchmarks.md", "development.md"} <= names


@pytest.mark.parametrize("page", [README, *PAGES], ids=lambda p: os.path.relpath(p, ROOT))
def test_every_relative_link_reaches_a_file_of_the_repository(page):
    with open(page, encoding="utf-8") as f:
        text = f.read()
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)  # code blocks hold no links
    links = [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]
    broken = []
    for target in links:
        path = os.path.normpath(os.path.join(os.path.dirname(page), target.split("#", 1)[0]))
        if not path.startswith(ROOT + os.sep) or not os.path.exists(path):
            broken.append(target)
    assert not broken, f"{os.path.relpath(page, ROOT)}: links that reach no file of the repository: {broken}"
    if page == README:
        assert any(t.startswith("docs/") for t in links)  # the README leads into docs/


def test_no_tracked_file_points_outside_the_repository_or_names_an_issue_number():
    found = []
    for path in tracked_files():
        text = text_of(path)
        if text is None:
            continue
        for pattern in (OUTSIDE, ISSUE):
            for m in pattern.finditer(text):
                line = text.count("\n", 0, m.start()) + 1
                found.append(f"{os.path.relpath(path, ROOT)}:{line}: {m.group(0)!r}")
    assert not found, "say what the thing is, not which ticket asked for it or where a local copy lies:\n" + \
        "\n".join(found)
