"""The watchdog of `launch.serve --replicas`' local Ray cluster, on plain processes (no Ray: the processes it
watches are whatever the run started): a run killed by SIGKILL, which runs no handler, leaves nothing behind, and
one that stops its watchdog has what it started ended, and nothing it had before."""
import os
import signal
import subprocess
import sys
import time

import pytest

from moejax.replicas import watchdog

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.skipif(not watchdog.supported(), reason="the watchdog reads /proc (Linux)")

# a run: a process it had before, the watchdog, then a child and a grandchild (as Ray's raylet and its workers);
# it prints their pids, then stops the watchdog when told ("stop" on stdin) or is killed
RUN = """
import subprocess, sys, time
from moejax.replicas.watchdog import Watchdog
before = subprocess.Popen(["sleep", "300"])
dog = Watchdog()
dog.start()
child = subprocess.Popen(["sh", "-c", "sleep 300 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
grandchild = int(child.stdout.readline())
print(before.pid, child.pid, grandchild, flush=True)
if sys.stdin.readline().strip() == "stop":
    dog.stop()
    print("stopped", flush=True)
    time.sleep(300)
"""


def alive(pid: int) -> bool:
    st = watchdog._stat(pid)
    return st is not None


def wait_gone(pids, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while any(map(alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


@pytest.fixture
def run():
    proc = subprocess.Popen([sys.executable, "-c", RUN], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": ROOT})
    before, child, grandchild = map(int, proc.stdout.readline().split())
    time.sleep(2.5 * watchdog.POLL_S)  # the watchdog has noted them
    yield proc, before, child, grandchild
    for pid in (proc.pid, before, child, grandchild):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    proc.wait()


def test_a_killed_run_leaves_nothing_it_started(run):
    proc, before, child, grandchild = run
    proc.kill()  # SIGKILL: no handler, no finally
    proc.wait()
    assert wait_gone([child, grandchild], timeout=watchdog.GRACE_S + 10) == []
    assert alive(before)  # what the run had before its watchdog started is not the watchdog's


def test_stop_ends_what_the_run_started_and_nothing_else(run):
    proc, before, child, grandchild = run
    proc.stdin.write("stop\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "stopped"
    assert wait_gone([child, grandchild], timeout=1) == []
    assert alive(before) and proc.poll() is None
