"""launch.serve refuses, before the model loads, every path it would write that is the input or another of its
outputs, a folder, or not writable: one line naming the flag, and the requests and earlier results survive.

The model named does not exist: a message about the path shows it was checked before anything loaded."""
import os
import sys

import pytest
from conftest import serve_stopped

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples", "requests.jsonl")
NO_MODEL = ["--model", "/nonexistent/model-dir"]


@pytest.fixture
def files(tmp_path):
    """A requests file and an earlier run's output, results and summary, each with distinct bytes."""
    requests = tmp_path / "requests.jsonl"
    requests.write_bytes(open(EXAMPLES, "rb").read())
    for name in ("out.jsonl", "errors.jsonl", "metrics.json"):
        (tmp_path / name).write_text(f"earlier {name}\n")
    (tmp_path / "plots").mkdir()
    return tmp_path


@pytest.fixture
def refusal(capsys):
    def refused(argv) -> str:
        status, message = serve_stopped(capsys, argv + NO_MODEL)
        assert status == 2 and message and "\n" not in message, (status, message)
        assert "/nonexistent/model-dir" not in message, message  # refused before the model was looked for
        return message
    return refused


def snapshot(folder) -> dict:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


@pytest.mark.parametrize("flags, message", [
    # --metrics over the requests, the output, its journal, the error file: each used to be overwritten
    (["--metrics", "{d}/requests.jsonl"], "--metrics {d}/requests.jsonl: is the input file"),
    (["--metrics", "{d}/./sub/../requests.jsonl"], "--metrics {d}/./sub/../requests.jsonl: is the input file"),
    (["--output", "{d}/out.jsonl", "--metrics", "{d}/out.jsonl"], "--metrics {d}/out.jsonl: is the --output file"),
    (["--output", "{d}/out.jsonl", "--metrics", "{d}/out.jsonl.partial"],
     "--metrics {d}/out.jsonl.partial: is the --output journal"),
    (["--output", "{d}/out.jsonl", "--metrics", "{d}/out.jsonl.lock"],
     "--metrics {d}/out.jsonl.lock: is the --output lock"),
    (["--error-file", "{d}/errors.jsonl", "--metrics", "{d}/errors.jsonl"],
     "--metrics {d}/errors.jsonl: is the --error-file file"),
    (["--output", "{d}/out.jsonl", "--error-file", "{d}/out.jsonl.partial"],
     "--error-file {d}/out.jsonl.partial: is the --output journal"),
    # a chart of --plot over the requests or the summary
    (["--input", "{d}/plots/theta.png", "--plot", "{d}/plots"], "--plot {d}/plots/theta.png: is the input file"),
    (["--metrics", "{d}/plots/dep-gantt.png", "--plot", "{d}/plots"],
     "--plot {d}/plots/dep-gantt.png: is the --metrics file"),
    # folders, missing folders
    (["--output", "{d}/plots"], "--output {d}/plots: is a folder; give a file"),
    (["--metrics", "{d}/plots"], "--metrics {d}/plots: is a folder; give a file"),
    (["--error-file", "{d}"], "--error-file {d}: is a folder; give a file"),
    (["--metrics", "{d}/missing/m.json"], "--metrics: folder '{d}/missing' does not exist"),
    (["--output", "{d}/missing/o.jsonl"], "--output: folder '{d}/missing' does not exist"),
    (["--plot", "{d}/metrics.json"], "--plot {d}/metrics.json: is a file, not a folder"),
    (["--plot", "{d}/metrics.json/charts"], "--plot {d}/metrics.json/charts: {d}/metrics.json is a file"),
    # a folder no one can create files in, even root (a read-only mount)
    (["--metrics", "/proc/moejax-metrics.json"], "--metrics: cannot write in '/proc'"),
    (["--plot", "/proc/moejax-plots"], "--plot: cannot write in '/proc'"),
])
def test_paths_that_would_destroy_something_or_fail_later_are_refused(files, flags, message, refusal):
    fill = lambda text: text.format(d=files)  # noqa: E731
    before = snapshot(files)
    argv = [fill(f) for f in flags]
    if "--input" not in argv:
        argv = ["--input", str(files / "requests.jsonl"), *argv]
    (files / "plots" / "theta.png").write_bytes(b"a chart")
    assert refusal(argv).startswith(fill(message))
    assert snapshot(files) == before
    assert (files / "plots" / "theta.png").read_bytes() == b"a chart"


def test_a_symlink_or_hard_link_to_the_input_is_refused(files, refusal):
    os.symlink(files / "requests.jsonl", files / "link.json")
    os.link(files / "requests.jsonl", files / "hard.json")
    for name in ("link.json", "hard.json"):
        message = refusal(["--input", str(files / "requests.jsonl"), "--metrics", str(files / name)])
        assert message.startswith(f"--metrics {files / name}: is the input file")
    assert (files / "requests.jsonl").read_bytes() == open(EXAMPLES, "rb").read()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_folder_or_file_is_refused(files, refusal):
    locked = files / "locked"
    locked.mkdir()
    os.chmod(locked, 0o555)
    os.chmod(files / "metrics.json", 0o444)
    try:
        assert refusal(["--input", str(files / "requests.jsonl"), "--metrics", str(locked / "m.json")]).startswith(
            f"--metrics: cannot write in '{locked}'")
        assert refusal(["--input", str(files / "requests.jsonl"), "--output", str(locked / "o.jsonl")]).startswith(
            f"--output: cannot write in '{locked}'")
        assert refusal(["--input", str(files / "requests.jsonl"), "--metrics", str(files / "metrics.json")]) == \
            f"--metrics {files / 'metrics.json'}: the file is read-only"
    finally:
        os.chmod(locked, 0o755)


def test_plot_without_matplotlib_names_the_extra(files, monkeypatch, refusal):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if the plots extra were not installed
    message = refusal(["--input", str(files / "requests.jsonl"), "--explain", "--plot", str(files / "plots")])
    assert message == "--plot: drawing the plans needs matplotlib: pip install 'moejax[plots]'"
