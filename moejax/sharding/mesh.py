"""Meshes for the layouts: one axis "x" over N consecutive devices of every process (jax.devices() is global)."""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh


def make_mesh(devices: int, first: int = 0) -> Mesh:
    """A 1-D mesh over devices first..first+devices-1, with Auto axis types (shard_map and the XLA partitioner,
    not explicit sharding-in-types). DEP's attention and expert groups are two such meshes side by side."""
    return Mesh(np.asarray(jax.devices()[first:first + devices]), ("x",), axis_types=(AxisType.Auto,))
