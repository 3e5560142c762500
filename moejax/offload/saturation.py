"""Saturation threshold Θ of the streamed placement (MoE-Prefill Eq. 3, §B.4) from a profile pass's timings:
Θ = (1+ε)·(max_l T_l / T_0)·F_ref, with T_0 the compute-only time of the first MoE layer and T_l the wall time of
layer l while streaming, on a reference batch of F_ref FLOPs (the pass itself: moejax.measure.saturation). Batches of
at least Θ FLOPs compute long enough to hide the copies; the batch runner packs prefill batches to that size.

FLOPs are true FLOPs, matmuls and attention (moejax.costs.true_prefill_flops), as the admission counts a batch
(moejax.sched.batch_schedule.tree_flops): T_0 times the first MoE layer's whole compute on the reference row, its
attention included, so F_ref is that row's true FLOPs, and Θ / F_ref reference rows of compute is what hides the
copies. (With matmul-only FLOPs here and true FLOPs in the admission, Θ came out short by the reference row's
attention, and batches were admitted with less compute than hides the copies.)"""
from __future__ import annotations

import dataclasses

import numpy as np

from moejax.config import ModelConfig
from moejax.costs import layer_flops_per_token, true_prefill_flops

EPSILON = 0.1

@dataclasses.dataclass(frozen=True)
class Saturation:
    theta_flops: float  # whole-forward true FLOPs of a batch (module docstring)
    ref_tokens: int
    ref_flops: float  # true FLOPs of the reference row of ref_tokens tokens
    token_flops: float  # FLOPs of one token with no context (moejax.costs.layer_flops_per_token)
    t0_s: float  # compute-only time of the first MoE layer
    compute_s: dict  # MoE layer -> compute-only seconds
    streamed_s: dict  # MoE layer -> wall seconds while streaming
    epsilon: float

    @property
    def source(self) -> str:
        return f"profiled (Eq. 3) on {self.ref_tokens} tokens"

    @property
    def theta_tokens(self) -> int:
        """Θ in tokens of no context, as Eq. 1's: the most a batch needs (rows with context reach Θ with fewer)."""
        return int(np.ceil(self.theta_flops / self.token_flops))

    def describe(self) -> str:
        worst = max(self.streamed_s, key=self.streamed_s.__getitem__)
        ms = lambda d: ", ".join(f"{k}: {v * 1e3:.2f}" for k, v in d.items())  # noqa: E731
        return (f"saturation threshold: Θ = (1+{self.epsilon})·(max T_l {self.streamed_s[worst] * 1e3:.2f} ms "
                f"(layer {worst}) / T_0 {self.t0_s * 1e3:.2f} ms)·F_ref {self.ref_flops:.3g} = "
                f"{self.theta_flops:.3g} FLOPs = {self.theta_tokens} tokens per prefill batch "
                f"(profiled on {self.ref_tokens} tokens)\n  compute-only ms per MoE layer: {ms(self.compute_s)}"
                f"\n  streamed ms per MoE layer: {ms(self.streamed_s)}")


def saturation_from_times(cfg: ModelConfig, tokens: int, compute_s: dict, streamed_s: dict,
                          epsilon: float = EPSILON) -> Saturation:
    """Eq. 3 from the timings of one row of `tokens` tokens: per MoE layer (in order) its compute-only seconds and
    its wall seconds while streaming. F_ref is the row's true FLOPs (module docstring)."""
    if not compute_s or sorted(compute_s) != sorted(streamed_s):
        raise ValueError(f"saturation: compute-only and streamed timings must cover the same MoE layers, got "
                         f"{sorted(compute_s)} and {sorted(streamed_s)}")
    t0 = compute_s[min(compute_s)]
    ref_flops = true_prefill_flops(cfg, tokens)
    theta = (1 + epsilon) * max(streamed_s.values()) / t0 * ref_flops
    return Saturation(theta, tokens, ref_flops, layer_flops_per_token(cfg), t0, compute_s, streamed_s, epsilon)
