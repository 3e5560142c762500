"""Which hardware profile `auto` consults: the one asked for, else the one `launch.profile_devices` measured for these
devices, else the datasheet of their kind, else a clear error saying how to get one."""
from __future__ import annotations

import dataclasses
import os

from moejax.plan.datasheets import DATASHEETS, load_profile
from moejax.plan.hardware import Profile
from moejax.plan.paths import default_profile_path

# device_kind substrings -> datasheet (more specific first)
_KINDS = (("H200", "h200"), ("H100", "h100"), ("A100", "a100"), ("L4", "l4"), ("T4", "t4"))


class NoProfile(ValueError):
    pass


def datasheet_for(device_kind: str) -> str | None:
    return next((name for key, name in _KINDS if key in device_kind), None)


def profile_for(device_kind: str, devices: int, asked: str | None = None) -> Profile:
    """The profile for `devices` devices of `device_kind` (a measured or datasheet profile describes one machine;
    its device count is set to what is present)."""
    if asked is not None:
        profile = load_profile(asked)
    else:
        measured = default_profile_path(device_kind)
        if os.path.isfile(measured):
            profile = load_profile(measured)
        elif (datasheet := datasheet_for(device_kind)) is not None:
            profile = DATASHEETS[datasheet]
        else:
            raise NoProfile(f"no hardware profile for {devices} x {device_kind!r}: measure one with `python -m "
                            f"launch.profile_devices` (it writes {measured}), or name one with profile= (--profile): a "
                            f"datasheet ({', '.join(DATASHEETS)}) or a JSON file")
    return dataclasses.replace(profile, gpus=devices)
