"""A hardware profile measured at load when none exists: `auto` choices (the layout planner, DEP's auto fields,
lightning's policy search, the offloaded placements' choice) need one, and a machine without a datasheet (a CPU,
an unlisted GPU) has none until `python -m launch.profile_devices` runs. This measures launch.profile_devices'
quick sweep at generic shapes (seconds), caches it where that command writes its profile (so later loads read it),
and says so: a coarse profile, which the full command replaces."""
from __future__ import annotations

import os
import tempfile
import time

import jax

from moejax.measure.hardware import QUICK, Shapes, measure_profile
from moejax.plan.hardware import Profile
from moejax.plan.paths import default_profile_path

_MEASURED: dict[str, Profile] = {}  # by device kind: when the cache folder cannot be written, this process's one


def measure_quick_profile(device_kind: str) -> tuple[Profile, str]:
    """-> (the profile, a line saying what was measured, how long it took and where it was cached)."""
    path = default_profile_path(device_kind)
    if device_kind in _MEASURED:
        return _MEASURED[device_kind], f"a quick profile measured earlier in this process (not cached: {path})"
    start = time.perf_counter()
    profile = measure_profile(Shapes.generic(quick=True), QUICK).profile
    seconds = time.perf_counter() - start
    try:
        write_profile(profile, path)
        where = f"cached it at {path} for later loads"
    except OSError as e:
        _MEASURED[device_kind] = profile
        where = f"could not cache it at {path} ({e.strerror or e}), so it is kept for this process only"
    return profile, (f"no hardware profile for {jax.device_count()} x {device_kind!r}: measured a quick one in "
                     f"{seconds:.1f} s (generic shapes, few sizes: coarse) and {where}; `python -m "
                     "launch.profile_devices` measures a finer one")


def write_profile(profile: Profile, path: str) -> None:
    """Whole or not at all: a scratch file in the same folder (made if missing), renamed over `path` (another
    process may be reading it)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, scratch = tempfile.mkstemp(dir=folder, prefix=".profile-", suffix=".tmp")
    os.close(fd)
    try:
        profile.save(scratch)
        os.replace(scratch, path)
    except BaseException:
        os.unlink(scratch)
        raise
