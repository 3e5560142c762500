"""One runner per output file: an advisory lock on `<path>.lock`, held from before the model loads until the output
is written, so a second runner on the same output (or its journal, or error file) is refused instead of redoing the
work.

The lock is `fcntl.flock` on the lock file, which also holds the holder's pid, host and command for the message that
refuses the next runner. The OS drops a flock when its process ends, crash and SIGKILL included, so a lock file left
behind by a killed runner blocks nobody; a clean release removes the file. Within one process the lock is reentrant
for the thread that holds it (launch.serve takes it early, serve_lines again around the store); another thread is
refused. Where fcntl is missing (Windows), or the file system has no locks, nothing is locked and a warning says so.

This module imports only the standard library (tests load it in a subprocess without importing JAX).
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]  # a module or None: checked before each use


class OutputLockError(RuntimeError):
    """The output at `path` (a real path) is being written by another runner, or its lock file cannot be taken."""

    def __init__(self, path: str, message: str):
        super().__init__(message)
        self.path = path


def lock_path(path: str) -> str:
    """The lock file of an output (or error) file."""
    return path + ".lock"


@contextlib.contextmanager
def hold(*paths: str | None) -> Iterator[None]:
    """Hold the lock of every given path (None: no file, e.g. stdout) until the block ends; OutputLockError when
    another process (or another thread of this one) holds any of them, after releasing those already taken."""
    taken = []
    try:
        for path in dict.fromkeys(os.path.realpath(p) for p in paths if p is not None):
            _acquire(path)
            taken.append(path)
        yield
    finally:
        for path in reversed(taken):
            _release(path)


class _Held:
    def __init__(self, fd: int | None, thread: int):
        self.fd, self.thread, self.count = fd, thread, 1


_held: dict[str, _Held] = {}  # real path of the output -> this process's lock on it
_registry = threading.Lock()
_warned = False


def _acquire(path: str) -> None:
    global _warned
    me = threading.get_ident()
    with _registry:
        held = _held.get(path)
        if held is not None:
            if held.thread != me:
                raise OutputLockError(path, f"{path} is being written by another thread of this process "
                                            f"(pid {os.getpid()}); refused, nothing changed: write to another output")
            held.count += 1
            return
        if fcntl is None:
            if not _warned:
                print(f"moejax: warning: {sys.platform} has no fcntl, so outputs are not locked: two runners on the "
                      "same output would both do all the work; start only one", file=sys.stderr)
                _warned = True
            _held[path] = _Held(None, me)
            return
        _held[path] = _Held(_lock(path), me)


_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS}  # flock's "this file system has no locks"


def _lock(path: str) -> int | None:
    lock = lock_path(path)
    while True:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by exec'd children (PEP 446)
        except OSError as e:
            raise OutputLockError(path, f"cannot open the lock file {lock}: {e.strerror or e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise OutputLockError(path, _refusal(path, lock, holder)) from None
        except OSError as e:
            os.close(fd)
            if e.errno not in _NO_LOCKS:
                raise OutputLockError(path, f"cannot lock {lock}: {e.strerror or e}") from None
            print(f"moejax: warning: cannot lock {lock} ({e.strerror or e}: a file system without locks), so "
                  f"{path} is not locked: two runners on it would both do all the work; start only one",
                  file=sys.stderr)
            with contextlib.suppress(OSError):
                os.remove(lock)
            return None
        # The previous holder may have released and removed the file between our open and flock: then this lock is
        # on a file nobody else will open; take the lock on what the path names now.
        try:
            current = os.stat(lock)
        except FileNotFoundError:
            current = None
        if current is not None and os.path.samestat(os.fstat(fd), current):
            break
        os.close(fd)
    holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S"),
              "command": " ".join(getattr(sys, "orig_argv", sys.argv))[:300]}
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode("utf-8"), 0)
    except OSError:  # a full disk: the lock holds all the same, a refused runner just cannot name us
        pass
    return fd


def _release(path: str) -> None:
    with _registry:
        held = _held[path]
        held.count -= 1
        if held.count:
            return
        del _held[path]
        if held.fd is None:
            return
        # Removed while still locked: a runner that opened the old file finds it gone once it gets the lock (_lock).
        try:
            os.remove(lock_path(path))
        except OSError:
            pass
        os.close(held.fd)


def _read_holder(fd: int) -> dict:
    try:
        holder = json.loads(os.pread(fd, 4096, 0).decode("utf-8"))
    except (OSError, ValueError):  # not written yet (the holder only just took the lock), or not ours
        return {}
    return holder if isinstance(holder, dict) else {}


def _refusal(path: str, lock: str, holder: dict) -> str:
    pid, host = holder.get("pid"), holder.get("host")
    if pid is None:
        who = "another process (it has not written its pid and host yet)"
    else:
        who = f"process {pid} on host {host}"
        if holder.get("since"):
            who += f", since {holder['since']}"
        if holder.get("command"):
            who += f": {holder['command']}"
        if host == socket.gethostname() and not _running(pid):
            who += " (no longer running here: a process it started still holds the lock)"
    return (f"{path} is being written by another runner ({who}), which holds the lock {lock}. Refused, nothing "
            "changed: wait for it to finish (a rerun then reuses its output, or resumes from its journal if it "
            "stopped early), stop it, or write to another output")


def _running(pid: int | str) -> bool:  # the lock file's pid, as its JSON gave it
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, ValueError, OverflowError):
        return False
    except PermissionError:  # someone else's process
        return True
    return True
