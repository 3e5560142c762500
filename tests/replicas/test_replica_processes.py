"""What `launch.serve --replicas` / `--ray` leave behind and how long they take to fail: --ray ADDRESS with no
cluster there is a one-line error within a time limit (Ray alone retries for minutes), and the local Ray cluster a
run starts (GCS, raylet, agents, workers) ends with the run, whether it is stopped by SIGTERM or killed by SIGKILL
(moejax.replicas.watchdog). Each starts a Ray instance or waits on one: slow."""
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("ray")

from moejax.replicas import watchdog  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QWEN3 = os.path.join(ROOT, "tests", "fixtures", "qwen3_moe")
FORMATS = os.path.join(ROOT, "examples", "formats.jsonl")


def serve(*args, **popen):
    return subprocess.Popen([sys.executable, "-m", "launch.serve", "--model", QWEN3, "--dtype", "float32", "--input",
                             FORMATS, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **popen)


@pytest.mark.parametrize("listening", [False, True], ids=["nothing there", "not a Ray cluster"])
def test_ray_address_without_a_cluster_is_one_line_within_a_time_limit(listening, tmp_path):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    port = server.getsockname()[1]
    if listening:
        server.listen()  # answers TCP, never speaks Ray
    else:
        server.close()
    start = time.monotonic()
    child = serve("--ray", f"127.0.0.1:{port}", "--output", str(tmp_path / "out.jsonl"))
    _, err = child.communicate(timeout=120)
    took = time.monotonic() - start
    server.close()
    last = err.strip().splitlines()[-1]
    assert child.returncode == 1 and "Traceback" not in err, err[-3000:]
    assert last.startswith(f"--ray 127.0.0.1:{port}: "), last
    assert ("could not connect to a Ray cluster" if listening else "no Ray cluster answers") in last, last
    assert took < 60, took


def ray_processes_of(pid: int, timeout: float = 600) -> set:
    """The processes below `pid` once its local Ray cluster runs the replicas' workers."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        below = watchdog.descendants({pid})
        names = [open(f"/proc/{p}/cmdline", "rb").read() for p, _ in below if os.path.exists(f"/proc/{p}/cmdline")]
        if sum(b"ReplicaWorker" in n for n in names) >= 2 and any(b"raylet" in n for n in names):
            return below
        time.sleep(0.5)
    raise AssertionError("the replicas did not start")


def left(procs: set, timeout: float) -> set:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = {p for p in procs if (st := watchdog._stat(p[0])) is not None and st[1] == p[1]}
        if not alive:
            return alive
        time.sleep(0.5)
    return alive


@pytest.mark.skipif(not watchdog.supported(), reason="the watchdog reads /proc (Linux)")
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=["SIGINT", "SIGTERM", "SIGKILL"])
def test_the_local_ray_cluster_ends_with_the_run(sig, tmp_path):
    child = serve("--replicas", "2", "--output", str(tmp_path / "out.jsonl"))
    try:
        procs = ray_processes_of(child.pid)
        child.send_signal(sig)
        child.wait(timeout=120)
        assert left(procs, timeout=60) == set()
        # (an exception a signal handler raises inside a garbage-collection callback is printed and ignored by
        # Python, and a loaded machine may let the run finish first: the run then completes, status 0, and still
        # leaves nothing behind)
        if sig == signal.SIGTERM:  # (its stderr in the message: a rare status 1 under load is not yet explained)
            assert child.returncode in (0, 128 + signal.SIGTERM), child.communicate()[1][-3000:]
        elif sig == signal.SIGINT and child.returncode != 0:  # Ctrl-C: the run stops itself (a message, no traceback)
            err = child.communicate()[1]
            assert child.returncode == 128 + signal.SIGINT and "Traceback" not in err, err[-3000:]
            assert err.strip().splitlines()[-1].startswith("launch.serve: interrupted"), err[-3000:]
    finally:
        child.kill()
        child.communicate()
