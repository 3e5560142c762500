"""Meshes for the layouts: one axis "x" over the first N devices of every process (jax.devices() is global)."""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh


def make_mesh(devices: int) -> Mesh:
    """A 1-D mesh with Auto axis types (shard_map and the XLA partitioner, not explicit sharding-in-types)."""
    return Mesh(np.asarray(jax.devices()[:devices]), ("x",), axis_types=(AxisType.Auto,))
