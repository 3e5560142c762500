"""A watchdog over the processes a run starts (the local Ray cluster of `launch.serve --replicas`: its GCS, raylet,
agents and workers), so that none outlives the run. A separate process (this file, run as a script) notes every
process that the run's process started since, below it, each second; when the run stops them (`Watchdog.stop`) or
dies without stopping them (SIGKILL runs no handler, and Ray's agents then live on for minutes), it ends those still
alive: SIGTERM, then SIGKILL after a grace period. Linux only (it reads /proc); elsewhere it does nothing."""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

POLL_S = 1.0  # how often the run's descendants are noted
GRACE_S = 5.0  # between SIGTERM and SIGKILL

Proc = tuple[int, int]  # (pid, start time in clock ticks): a pid the kernel reused is another process


def supported() -> bool:
    return sys.platform.startswith("linux") and os.path.isdir("/proc/self")


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time) of a live process; None when it is gone (or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # after the command, which may hold spaces
    return None if fields[0] == "Z" else (int(fields[1]), int(fields[19]))


def descendants(roots: set[int]) -> set[Proc]:
    """Every live process below the `roots` pids (not the roots themselves)."""
    children: dict[int, list[Proc]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (st := _stat(int(name))) is not None:
            children.setdefault(st[0], []).append((int(name), st[1]))
    found: set[Proc] = set()
    todo = list(roots)
    while todo:
        for proc in children.get(todo.pop(), []):
            if proc not in found:
                found.add(proc)
                todo.append(proc[0])
    return found


def _alive(procs: set[Proc]) -> set[Proc]:
    return {p for p in procs if (st := _stat(p[0])) is not None and st[1] == p[1]}


def end(procs: set[Proc], grace_s: float = GRACE_S) -> None:
    """SIGTERM each process still alive (with the ones that started below it), SIGKILL those left after grace_s."""
    procs = _alive(procs | descendants({pid for pid, _ in procs}))
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 0.0)):
        for pid, _ in _alive(procs):
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + wait
        while _alive(procs) and time.monotonic() < deadline:
            time.sleep(0.05)


def watch(parent: int, pipe: int, poll_s: float = POLL_S) -> None:
    """The watchdog's loop: note the parent's descendants that it started since (not those it had before) until the
    pipe says stop or ends (the parent died), then end them."""
    me = os.getpid()
    before = descendants({parent})
    print("ready", flush=True)  # the parent waits for this before starting anything
    seen: set[Proc] = set()
    while True:
        ready, _, _ = select.select([pipe], [], [], poll_s)
        if ready:  # "stop", or end of file: the parent died
            os.read(pipe, 64)
            break
        seen |= {p for p in descendants({parent}) - before if p[0] != me}
    end(seen)


class Watchdog:
    """The watchdog process of this one: start() before starting the processes to watch, stop() after stopping
    them (it ends whatever they left)."""

    def __init__(self) -> None:
        self._write: int | None = None
        self._process: subprocess.Popen | None = None

    def start(self) -> None:
        if not supported():
            return
        read, self._write = os.pipe()
        # its own session: a signal to this process group (Ctrl-C) does not stop it before it has cleaned up
        # run as a script: it needs only the standard library, not moejax's imports (JAX)
        self._process = subprocess.Popen([sys.executable, os.path.abspath(__file__), str(os.getpid()), str(read)],
                                         pass_fds=(read,), start_new_session=True, stdin=subprocess.DEVNULL,
                                         stdout=subprocess.PIPE, text=True)
        os.close(read)
        assert self._process.stdout is not None
        self._process.stdout.readline()  # "ready": it knows what this process had before

    def stop(self) -> None:
        if self._write is None:
            return
        try:
            os.write(self._write, b"stop")
        except OSError:
            pass
        os.close(self._write)
        self._write = None
        if self._process is not None:
            try:
                self._process.wait(timeout=GRACE_S + 10)
            except subprocess.TimeoutExpired:
                self._process.kill()


if __name__ == "__main__":
    watch(int(sys.argv[1]), int(sys.argv[2]))
