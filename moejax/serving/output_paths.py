"""launch.serve's output paths, checked before the model loads: every file a run writes (--output with its journal,
scratch file and lock; --error-file with its scratch file and lock; --metrics; the --plot folder's charts) must not
be the input or another of them, must not be a folder, and must be writable where it is, so that a run can neither
overwrite the requests or its results nor fail after the work."""
from __future__ import annotations

import argparse
import os
import tempfile
from typing import NamedTuple

from moejax.requests import output_lock

# the charts --explain --plot DIR may draw (launch.serve.plan_plots)
PLOT_FILES = ("dep-gantt.png", "theta.png", "lightning-gantt.png")


class Written(NamedTuple):
    flag: str  # the flag that names it
    path: str
    role: str  # "file", or what the run keeps beside it: "journal", "scratch file", "lock", "chart"


def written_paths(args: argparse.Namespace) -> list[Written]:
    """Every file the run may write, with the flag that names it."""
    out: list[Written] = []
    if args.output:
        out += [Written("--output", args.output, "file"), Written("--output", args.output + ".partial", "journal"),
                Written("--output", args.output + ".tmp", "scratch file"),
                Written("--output", output_lock.lock_path(args.output), "lock")]
    if args.error_file:
        out += [Written("--error-file", args.error_file, "file"),
                Written("--error-file", args.error_file + ".tmp", "scratch file"),
                Written("--error-file", output_lock.lock_path(args.error_file), "lock")]
    if args.metrics:
        out.append(Written("--metrics", args.metrics, "file"))
    if getattr(args, "plot", None):
        out += [Written("--plot", os.path.join(args.plot, name), "chart") for name in PLOT_FILES]
    return out


def same_file(a: str, b: str) -> bool:
    """The same file: equal resolved paths (symlinks, `..`), or two names of one existing file (a hard link)."""
    return os.path.realpath(a) == os.path.realpath(b) or (os.path.exists(a) and os.path.exists(b)
                                                          and os.path.samefile(a, b))


def check_collisions(args: argparse.Namespace) -> str | None:
    """A written file that is the input or another written file, as a message naming the flag; None when none is."""
    written = written_paths(args)
    if args.input != "-":
        for w in written:
            if same_file(w.path, args.input):
                return f"{w.flag} {w.path}: is the input file {args.input}; refusing to overwrite the requests"
    for j, later in enumerate(written):
        for earlier in written[:j]:
            if earlier.flag != later.flag and same_file(earlier.path, later.path):
                what = "file" if earlier.role == "file" else f"{earlier.role} ({earlier.path})"
                named = later.path if later.role in ("file", "chart") else \
                    f"{getattr(args, later.flag[2:].replace('-', '_'))} (its {later.role} {later.path})"
                return f"{later.flag} {named}: is the {earlier.flag} {what}; give another"
    return None


def check_file(flag: str, path: str | None) -> str | None:
    """A file `path` can be written: not a folder, not read-only, in a folder that exists and takes new files."""
    if path is None:
        return None
    if os.path.isdir(path):
        return f"{flag} {path}: is a folder; give a file"
    if os.path.exists(path) and not os.access(path, os.W_OK):
        return f"{flag} {path}: the file is read-only"
    return _check_folder(flag, os.path.dirname(os.path.abspath(path)))


def check_folder(flag: str, folder: str | None) -> str | None:
    """Files can be written into `folder`, created (with its parents) if missing: it is not a file, and its nearest
    existing ancestor takes new files."""
    if folder is None:
        return None
    folder = os.path.abspath(folder)
    if os.path.exists(folder) and not os.path.isdir(folder):
        return f"{flag} {folder}: is a file, not a folder"
    existing = folder
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"{flag} {folder}: {existing} is a file, not a folder"
    return _check_folder(flag, existing)


def _check_folder(flag: str, folder: str) -> str | None:
    if not os.path.isdir(folder):
        return f"{flag}: folder {folder!r} does not exist"
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".moejax-write-test-"):
            pass
    except OSError as e:
        return f"{flag}: cannot write in {folder!r}: {e.strerror or e}"
    return None


def check_paths(args: argparse.Namespace) -> str | None:
    """The first problem with the paths the run writes, as one line naming the flag; None when there is none."""
    return (check_collisions(args) or check_file("--output", args.output)
            or check_file("--error-file", args.error_file) or check_file("--metrics", args.metrics)
            or check_folder("--plot", getattr(args, "plot", None)))
