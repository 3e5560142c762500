"""Predictor files: a flat dict of numpy arrays written and read with orbax, errors naming the file."""
from __future__ import annotations

import os

import numpy as np
import orbax.checkpoint as ocp


def save_arrays(path: str, arrays: dict) -> str:
    """Write to the directory `path` (which must not exist yet) -> its absolute path."""
    path = os.path.abspath(path)
    saver = ocp.StandardCheckpointer()
    saver.save(path, {k: np.asarray(v) for k, v in arrays.items()})
    saver.wait_until_finished()
    return path


def load_arrays(path: str, what: str) -> dict:
    try:
        tree = ocp.StandardCheckpointer().restore(os.path.abspath(path))
    except Exception as e:  # orbax raises several types for a missing or foreign directory
        raise ValueError(f"{what}: cannot read {path!r} ({type(e).__name__}: {e})") from None
    return {k: np.asarray(v) for k, v in tree.items()}
