"""Compute kernels. Each op has a plain-JAX path; Pallas GPU kernels arrive with the kernels issue."""
from moejax.kernels.expert_ffn import EXPERT_IMPLS, expert_ffn

__all__ = ["EXPERT_IMPLS", "expert_ffn"]
