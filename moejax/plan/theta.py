"""MoE-Prefill's saturation threshold Θ from a hardware profile (Eq. 1): the batch FLOPs at which a layer's compute
covers the transfer of the next layer's experts, Θ = (1+ε)·T_comm·P, with T_comm the per-layer time of the
slowest weight channel and P the device's compute rate. It is the fallback when Θ was not profiled (Eq. 3,
moejax.offload.saturation); both give a FLOPs floor that prefill batches are filled to.

Channels (MoE-Prefill §6.2-6.3), per MoE layer, per device:
  streamed     one device copies the layer's experts from pinned host memory: h2d(layer bytes)
  async_ep     experts resident, split over P devices; each gathers the others' shards: all_gather((P-1)/P · layer)
  two_channel  AsyncEP from the host: each device copies its 1/P shard from the host while gathering the next
               layer's shards from the others; the channels run at once, the slower one counts
Batch FLOPs are whole-forward true FLOPs, matmuls and attention (moejax.costs.true_prefill_flops), the unit in which
Eq. 3's F_ref and the scheduler's admission (moejax.sched.batch_schedule.tree_flops) count a batch too: a batch of
F FLOPs spends F / L of them in each of L layers. Attention counts because the copy of the next layer's experts runs
during a whole layer (issued at this layer's MoE, waited for at the next one's, after its attention) and Eq. 1 takes
every FLOP at the one rate P; Θ = (1+ε)·T_comm·P·L·devices needs no per-token FLOPs. `theta_tokens` is Θ in tokens
of no context (Θ / moejax.costs.layer_flops_per_token): the most tokens any batch needs, since rows with context
attend more per token and reach Θ with fewer. P is the profile's peak, as in Eq. 1: the datasheet's, or the best rate
`launch.profile_devices` measured. (A measured profile's slower small GEMMs are not used: on a CPU they mostly measure
dispatch, which Eq. 3's reference batch folds in differently; taking the peak keeps Eq. 1 the paper's.)"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Protocol

from moejax.config import ModelConfig
from moejax.costs import layer_flops_per_token, param_count
from moejax.plan.hardware import Profile

EPSILON = 0.1
MODES = ("streamed", "async_ep", "two_channel")


class Theta(Protocol):
    """Θ as an Engine holds it (Engine.saturation): a ThetaEstimate made at load, or one measured on the engine
    (moejax.offload.saturation.Saturation)."""

    @property
    def theta_flops(self) -> float: ...

    @property
    def theta_tokens(self) -> int: ...

    @property
    def source(self) -> str: ...

    def describe(self) -> str: ...


@dataclasses.dataclass(frozen=True)
class ThetaEstimate:
    theta_flops: float  # whole-forward true FLOPs of a batch, all devices together (moejax.costs.true_prefill_flops)
    theta_tokens: int  # Θ in tokens of no context: the most a batch needs (module docstring)
    source: str
    mode: str
    devices: int
    t_comm_s: float  # per MoE layer, the slowest channel
    channels_s: dict  # channel -> seconds per MoE layer
    compute_flops_per_s: float  # P, per device
    layer_expert_bytes: float
    epsilon: float

    def describe(self) -> str:
        channels = ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in self.channels_s.items())
        return (f"saturation threshold ({self.source}): Θ = (1+{self.epsilon})·T_comm {self.t_comm_s * 1e3:.3f} ms·"
                f"P {self.compute_flops_per_s / 1e12:.3g} TFLOP/s x {self.devices} device(s) x layers = "
                f"{self.theta_flops:.3g} FLOPs = {self.theta_tokens} tokens per prefill batch ({self.mode}; one MoE "
                f"layer's experts {self.layer_expert_bytes / 2**20:.1f} MiB; per layer: {channels})")

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def layer_expert_bytes(cfg: ModelConfig, dtype_bytes: int) -> float:
    """Bytes of one MoE layer's routed experts."""
    moe = sum(cfg.moe_layers) or 1
    routed = param_count(cfg) - param_count(cfg.replace(num_experts=0, num_experts_per_tok=0)) \
        if cfg.num_experts else 0
    return routed / moe * dtype_bytes


def channel_times(cfg: ModelConfig, profile: Profile, mode: str, devices: int) -> dict:
    """Seconds per MoE layer of each weight channel of `mode` (module docstring)."""
    if mode not in MODES:
        raise ValueError(f"theta: mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode != "streamed" and devices < 2:
        raise ValueError(f"theta: mode {mode} gathers experts between devices: needs 2 or more, got {devices}")
    layer = layer_expert_bytes(cfg, profile.dtype_bytes)
    gather = {"all_gather": profile.all_gather.time((devices - 1) / devices * layer)} if devices > 1 else {}
    if mode == "streamed":
        return {"h2d": profile.h2d.time(layer)}
    if mode == "async_ep":
        return gather
    return {"h2d": profile.h2d.time(layer / devices), **gather}


def theta_eq1(cfg: ModelConfig, profile: Profile, *, mode: str = "streamed", devices: int = 1,
              epsilon: float = EPSILON) -> ThetaEstimate:
    """Θ by Eq. 1 from the profile (module docstring)."""
    channels = channel_times(cfg, profile, mode, devices)
    t_comm = max(channels.values())
    rate = profile.device.flops
    theta_flops = (1 + epsilon) * t_comm * rate * cfg.num_layers * devices  # any FLOPs at rate P: true FLOPs
    tokens = theta_flops / layer_flops_per_token(cfg)  # tokens of no context (module docstring)
    return ThetaEstimate(theta_flops=theta_flops, theta_tokens=max(1, int(round(tokens))),
                         source=f"Eq. 1 from profile {profile.name} ({profile.source})", mode=mode, devices=devices,
                         t_comm_s=t_comm, channels_s=channels, compute_flops_per_s=rate,
                         layer_expert_bytes=layer_expert_bytes(cfg, profile.dtype_bytes), epsilon=epsilon)


def layer_time_curve(cfg: ModelConfig, profile: Profile, theta: ThetaEstimate, batch_flops: Iterable[float]
                     ) -> list[tuple[float, float]]:
    """(compute-only, overlapped) seconds per MoE layer for whole-batch FLOPs values: what the Θ plot draws."""
    out = []
    for f in batch_flops:
        compute = f / theta.devices / cfg.num_layers / theta.compute_flops_per_s
        out.append((compute, max(compute, theta.t_comm_s)))
    return out


def theta_at_load(cfg: ModelConfig, mode: str | None, devices: int, find_profile: Callable[[], Profile]
                  ) -> ThetaEstimate | None:
    """Θ a freshly loaded engine fills its prefill batches to: Eq. 1 in the placement's channel `mode` (None: its
    experts are not copied during a forward, so no Θ) on the hardware profile `find_profile()` returns; None when
    no profile is known (it raises ValueError; batches then follow the token budget alone). On one device async_ep
    gathers nothing (None) and two_channel is a plain host stream. A measured Θ (Eq. 3, moejax.offload.saturation)
    may replace it later."""
    if mode is None or (mode == "async_ep" and devices < 2):
        return None
    try:
        profile = find_profile()
    except ValueError:
        return None
    return theta_eq1(cfg, profile, mode=mode if devices > 1 or mode == "streamed" else "streamed", devices=devices)
