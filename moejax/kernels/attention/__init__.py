"""Attention kernels: one function (op.py: the arguments' meaning, the checks, `auto`), several backends computing the
same thing (reference, xla, blocked, pallas, cudnn), cascade attention over a shared prefix (cascade.py), and
attention over a paged KV cache (paged.py)."""
from moejax.kernels.attention.cascade import cascade_attention
from moejax.kernels.attention.op import BACKENDS, attention, pick_backend

__all__ = ["BACKENDS", "attention", "cascade_attention", "pick_backend"]
