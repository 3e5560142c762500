"""Where a measured hardware profile lives, so that loading a model can find the one `python -m launch.profile_devices`
wrote for its device without measuring anything (and without importing JAX)."""
from __future__ import annotations

import os
import re


def device_tag(device_kind: str) -> str:
    """A device kind as file names carry it ('NVIDIA H100 80GB HBM3' -> 'NVIDIA_H100_80GB_HBM3'): the same rule
    as launch.bench.util.device_tag, repeated here because moejax does not import the launch scripts."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", device_kind.strip()) or "unknown-device"


def profiles_dir() -> str:
    """$XDG_CACHE_HOME/moejax/profiles, or ~/.cache/moejax/profiles."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "moejax", "profiles")


def default_profile_path(device_kind: str) -> str:
    """The measured profile of devices of this kind (`jax.devices()[0].device_kind`); the file may not exist."""
    return os.path.join(profiles_dir(), device_tag(device_kind) + ".json")
