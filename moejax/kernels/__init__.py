"""Compute kernels, one folder per op, each with a plain-JAX path beside its Pallas GPU kernel.

Backends are chosen by argument (`backend="auto"` picks by platform), never by environment variable."""
from moejax.kernels.attention import BACKENDS as ATTENTION_BACKENDS
from moejax.kernels.attention import attention, cascade_attention
from moejax.kernels.backends import Kernels
from moejax.kernels.expert_ffn import BACKENDS as EXPERT_BACKENDS
from moejax.kernels.expert_ffn import expert_ffn
from moejax.kernels.grouped_matmul import BACKENDS as GROUPED_MATMUL_BACKENDS
from moejax.kernels.grouped_matmul import grouped_matmul
from moejax.kernels.routing import Routing, combine, dispatch, gather_rows

__all__ = ["ATTENTION_BACKENDS", "EXPERT_BACKENDS", "GROUPED_MATMUL_BACKENDS", "Kernels", "Routing", "attention",
           "cascade_attention", "combine", "dispatch", "expert_ffn", "gather_rows", "grouped_matmul"]
