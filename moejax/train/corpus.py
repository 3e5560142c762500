"""The training corpus: the `.py` sources of the running interpreter's standard library (no site-packages).

Every machine with Python has it, so training needs no download. The split into train and held-out is by file
with a fixed rule (a file is held out when the CRC-32 of its path relative to the stdlib is 0 mod 20, about 5%),
so the same interpreter version gives the same split everywhere; `describe()` records that version and a hash
of the file list.
"""
from __future__ import annotations

import hashlib
import os
import platform
import sysconfig
import tokenize
import zlib

HELD_OUT_MODULUS = 20  # one file in 20 is held out


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def source_files(root: str | None = None) -> list[str]:
    """Every `.py` file under the stdlib, as sorted paths relative to it; site-packages and caches skipped."""
    root = root or stdlib_dir()
    out = []
    for directory, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in ("site-packages", "dist-packages", "__pycache__")]
        out += [os.path.relpath(os.path.join(directory, f), root) for f in files if f.endswith(".py")]
    return sorted(out)


def is_held_out(relpath: str) -> bool:
    return zlib.crc32(relpath.replace(os.sep, "/").encode()) % HELD_OUT_MODULUS == 0


def split(files: list[str]) -> tuple[list[str], list[str]]:
    """(train, held_out), each in the order given."""
    return [f for f in files if not is_held_out(f)], [f for f in files if is_held_out(f)]


def list_hash(files: list[str]) -> str:
    return hashlib.sha256("\n".join(f.replace(os.sep, "/") for f in files).encode()).hexdigest()


def read_source(path: str) -> str:
    """A source file's text in the encoding it declares (PEP 263); undecodable bytes (a few test files hold
    them on purpose) become U+FFFD rather than dropping the file."""
    try:
        with tokenize.open(path) as f:
            return f.read()
    except (SyntaxError, UnicodeDecodeError):
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()


def describe(root: str | None = None) -> dict:
    root = root or stdlib_dir()
    files = source_files(root)
    train, held_out = split(files)
    size = lambda names: sum(os.path.getsize(os.path.join(root, n)) for n in names)  # noqa: E731
    return dict(python=platform.python_version(), stdlib=root, files=len(files), sha256=list_hash(files),
                train_files=len(train), held_out_files=len(held_out), train_bytes=size(train),
                held_out_bytes=size(held_out), held_out_rule=f"crc32(relative path) % {HELD_OUT_MODULUS} == 0")
