"""Parallel layouts as shard_map programs on a jax.sharding.Mesh (see moejax.layout for the spec)."""
from moejax.layout import Layout
from moejax.sharding.mesh import make_mesh

__all__ = ["Layout", "make_mesh"]
