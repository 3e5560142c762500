"""Where a record comes from (its commit, its device's name as file names carry it), without jax or moejax:
launch.gpu_check reads these before it knows that either imports on the machine."""
from __future__ import annotations

import os
import re
import subprocess

# A copy of the tree (the device tool sends one) may sit in another repository's checkout, whose HEAD is not the
# code's: the caller names the commit it sent.
COMMIT_VARIABLE = "MOEJAX_GIT_COMMIT"


def git_commit() -> tuple[str, bool]:
    """(the code's commit, whether COMMIT_VARIABLE named it): the variable's value where set, else git's HEAD, else
    ""."""
    if os.environ.get(COMMIT_VARIABLE):
        return os.environ[COMMIT_VARIABLE], True
    try:
        run = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "", False
    return (run.stdout.strip() if run.returncode == 0 else ""), False


def device_tag(kind: str) -> str:
    """A device kind as result file names carry it ('NVIDIA H100 80GB HBM3' -> 'NVIDIA_H100_80GB_HBM3')."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", kind.strip()) or "unknown-device"
