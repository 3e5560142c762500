"""The placements, in the order `placement_for` tries them (the first whose `applies` holds runs). Adding a placement
is one file in moejax/placements/ holding its class, and one line here: "module:Class"."""
from __future__ import annotations

import functools
import importlib

from moejax.placements.base import Placement

REGISTRY = (
    "moejax.placements.dep:DEP",
    "moejax.placements.pipeline_parallel:Pipeline",
    "moejax.placements.gathered:Gathered",
    "moejax.placements.streamed:StreamedInJit",
    "moejax.placements.streamed:Streamed",
    "moejax.placements.cached:Cached",
    "moejax.placements.cached_ep:CachedEP",
    "moejax.placements.lightning:Lightning",
    "moejax.placements.resident:ResidentAsyncEP",
    "moejax.placements.resident:Resident",
)


@functools.cache
def load_registry(entries: tuple[str, ...] = REGISTRY) -> tuple[type[Placement], ...]:
    """The classes the entries name, imported (modules of moejax.placements, each a Placement subclass)."""
    out = []
    for entry in entries:
        module, name = entry.split(":")
        cls = getattr(importlib.import_module(module), name)
        assert isinstance(cls, type) and issubclass(cls, Placement), f"{entry} is not a Placement"
        out.append(cls)
    return tuple(out)
