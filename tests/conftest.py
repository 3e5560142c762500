import os

import numpy as np
import pytest

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
FIXTURE_NAMES = sorted(d for d in os.listdir(FIXTURES) if os.path.isfile(os.path.join(FIXTURES, d, "config.json")))


def fixture_dir(name: str) -> str:
    return os.path.join(FIXTURES, name)


def reference(name: str) -> dict:
    with np.load(os.path.join(FIXTURES, name, "reference.npz")) as z:
        return {k: z[k] for k in z.files}


@pytest.fixture(scope="session")
def qwen3_engine():
    """The qwen3_moe fixture (a tokenizer and a chat template) in float32, shared so its compiled steps are too."""
    import moejax
    return moejax.load(fixture_dir("qwen3_moe"), dtype="float32")


@pytest.fixture(autouse=True, scope="session")
def _compile_cache(tmp_path_factory):
    # Keep the persistent compilation cache inside the test run, not in the user's home.
    os.environ.setdefault("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))


def kill_when_journal_has(child, journal: str, lines: int, *, timeout: float, poll: float = 0.01) -> None:
    """SIGKILL `child` (a Popen) once `journal` holds at least `lines` lines; fails if it exits first."""
    import signal
    import time
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if os.path.exists(journal):
                with open(journal, encoding="utf-8") as f:
                    if f.read().count("\n") >= lines:
                        break
            assert child.poll() is None, "the process exited before it could be killed"
            time.sleep(poll)
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait()
