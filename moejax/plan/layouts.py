"""Which parallel layout serves a step fastest on a profile: each implemented layout's predicted step time from the
analytic costs (moejax.costs: FLOPs, and the bytes each device sends, as implemented) and the profile's roofline
and α-β links; DEP's through FinDEP's solver. What `layout="auto"` asks.

Model, per device, for a prefill step of `tokens` tokens in sequences of `seq_len`:
  compute   the step's FLOPs split over the devices (attn=tp with replicated experts computes every token's experts
            on every device), at the profile's measured rate for the rows a device holds, or at its memory roof
            when reading the device's weights takes longer
  comm      each collective of moejax.costs.layout_comm, α + bytes sent / bandwidth, once per (MoE) layer; an
            all-reduce is a reduce-scatter then an all-gather of half its bytes each
  async_ep  the gathers of the next layer's experts run beside this layer's compute: max(compute, gathers)
  memory    a device's weights (routed experts as the layout splits them; async_ep holds one layer whole too) must
            fit 90% of its memory, else the layout is listed as not fitting
Nothing here touches a device."""
from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterable

from moejax.config import ModelConfig
from moejax.costs import Transfer, layout_comm, param_count, prefill_flops
from moejax.layout import ATTN, IMPLEMENTED, Layout
from moejax.plan.findep import DepSchedule, solve_dep
from moejax.plan.hardware import Profile
from moejax.plan.theta import layer_expert_bytes

FIT_FRACTION = 0.9
_LINK = {"all-to-all": "all_to_all", "all-gather": "all_gather", "reduce-scatter": "reduce_scatter"}


@dataclasses.dataclass(frozen=True)
class LayoutOption:
    spec: str
    predicted_s: float | None  # None: it does not fit or does not apply (see `why`)
    tokens: int = 0  # computed per step, padding included
    compute_s: float = 0.0
    comm_s: float = 0.0
    why: str = ""

    @property
    def tokens_per_s(self) -> float | None:
        return None if self.predicted_s is None else self.tokens / self.predicted_s


@dataclasses.dataclass(frozen=True)
class LayoutChoice:
    best: LayoutOption
    options: tuple[LayoutOption, ...]  # every candidate, fastest first, those that do not fit last
    tokens: int
    seq_len: int
    profile: str
    solve_ms: float

    def describe(self) -> str:
        lines = [f"layout auto: {self.best.spec} predicted {self.best.tokens_per_s:,.0f} tokens/s for steps of "
                 f"{self.tokens} tokens (sequences of {self.seq_len}) on profile {self.profile}; alternatives:"]
        for o in self.options[1:]:
            lines.append(f"  {o.spec}: " + (o.why if o.predicted_s is None else f"{o.tokens_per_s:,.0f} tokens/s" + (
                f" (compute {o.compute_s * 1e3:.2f} ms, communication {o.comm_s * 1e3:.2f} ms)" if o.compute_s else
                " (FinDEP's pipeline model)")))
        return "\n".join(lines)


def _comm_time(profile: Profile, transfers: Iterable[Transfer]) -> float:
    total = 0.0
    for t in transfers:
        if t.kind == "all-reduce":
            total += profile.reduce_scatter.time(t.bytes_sent / 2) + profile.all_gather.time(t.bytes_sent / 2)
        else:
            total += getattr(profile, _LINK[t.kind]).time(t.bytes_sent)
    return total


def _weights_per_device(cfg: ModelConfig, layout: Layout, dtype_bytes: int) -> tuple[float, float]:
    """(bytes of weights other than routed experts, bytes of routed experts) one device holds."""
    layer = layer_expert_bytes(cfg, dtype_bytes)
    experts = layer * sum(cfg.moe_layers)
    rest = param_count(cfg) * dtype_bytes - experts
    P = layout.devices
    assert P is not None  # a resolved layout
    if layout.attn == "tp":  # attention projections split by heads (approximately the whole of them)
        rest -= (1 - 1 / P) * cfg.num_layers * (cfg.num_heads * cfg.head_dim * cfg.hidden_size * 2) * dtype_bytes
    if layout.experts == "replicated":
        return rest, experts
    if layout.experts == "async_ep":
        return rest, experts / P + 2 * layer
    return rest, experts / P


def predict_layout(cfg: ModelConfig, profile: Profile, layout: Layout, tokens: int, seq_len: int) -> LayoutOption:
    """Predicted step time of a resolved (non-DEP) layout (module docstring)."""
    P, b = layout.devices, profile.dtype_bytes
    assert P is not None, "predict_layout: resolve the layout first"
    batch = max(1, tokens // seq_len)
    if layout.attn == "dp":
        batch = -(-batch // P) * P  # rows pad to a multiple of the devices
    rest, experts = _weights_per_device(cfg, layout, b)
    if rest + experts > FIT_FRACTION * profile.device.memory_bytes:
        return LayoutOption(str(layout), None, why=f"does not fit: {(rest + experts) / 2**30:.1f} GiB of weights per "
                            f"device > {FIT_FRACTION:.0%} of {profile.device.memory_bytes / 2**30:.0f} GiB")
    flops = prefill_flops(cfg, batch, seq_len, all_logits=False)
    rows = batch * seq_len / P
    expert_flops = flops.experts * (1 if layout.attn == "tp" and layout.experts == "replicated" else 1 / P)
    dense = profile.device.op_time((flops.total - flops.experts) / P, rest, "matmul", rows)
    per_expert_rows = batch * seq_len * max(cfg.num_experts_per_tok, 1) / max(cfg.num_experts, 1)
    routed = profile.device.op_time(expert_flops, experts, "grouped", per_expert_rows)
    comm = layout_comm(cfg, layout, batch, seq_len, b)
    moe = sum(cfg.moe_layers)
    attn_comm = _comm_time(profile, comm.attention) * cfg.num_layers
    expert_comm = _comm_time(profile, comm.experts) * max(moe - 1, 0) + _comm_time(profile, comm.first_experts)
    if layout.experts == "async_ep":  # the gathers run beside the compute
        step = max(dense + routed, expert_comm) + attn_comm
    else:
        step = dense + routed + attn_comm + expert_comm
    return LayoutOption(str(layout), step, batch * seq_len, dense + routed, attn_comm + expert_comm)


def candidates(cfg: ModelConfig, devices: int) -> list[Layout]:
    """Every implemented layout that resolves for the model on `devices` devices, but DEP (FinDEP's solver plans
    it) and the pipeline (prefill-only, and its bubbles are not in this model)."""
    out = []
    for attn, experts in sorted(IMPLEMENTED):
        if experts in ("dep", "pp") or attn not in ATTN:
            continue
        try:
            out.append(Layout(attn=attn, experts=experts).resolve(cfg.num_experts or 1, devices,
                                                                  expert_width=cfg.moe_intermediate_size or 0,
                                                                  heads=cfg.num_heads))
        except ValueError:
            pass
    return out


def dep_option(cfg: ModelConfig, profile: Profile, devices: int, tokens: int, seq_len: int,
               fixed: Layout | None = None) -> tuple[LayoutOption, DepSchedule | None]:
    """FinDEP's best DEP layout (fields of `fixed` that are not "auto" held), as an option, and its DepSchedule."""
    fields = ("attn_devices", "expert_devices", "r1", "r2", "order")
    held = {} if fixed is None else {k: getattr(fixed, k) for k in fields if getattr(fixed, k) not in ("auto", None)}
    try:
        schedule = solve_dep(cfg, profile, devices=devices, tokens=tokens, seq_len=seq_len, **held)
    except ValueError as e:
        return LayoutOption("attn=dp,experts=dep", None, why=f"does not apply: {e}"), None
    option = LayoutOption(schedule.layout_spec(), schedule.predicted_s,
                          round(schedule.predicted_tokens_per_s * schedule.predicted_s))
    return option, schedule


def choose_layout(cfg: ModelConfig, profile: Profile, devices: int, tokens: int, seq_len: int) -> LayoutChoice:
    """The fastest layout on `devices` devices for steps of `tokens` tokens (module docstring)."""
    start = time.perf_counter()
    if devices < 2:
        raise ValueError("layout auto: one device has no layout to choose (leave layout unset)")
    options = [predict_layout(cfg, profile, layout, tokens, seq_len) for layout in candidates(cfg, devices)]
    if cfg.num_experts:
        options.append(dep_option(cfg, profile, devices, tokens, seq_len)[0])
    fitting = sorted((o for o in options if o.predicted_s is not None),
                     key=lambda o: o.predicted_s if o.predicted_s is not None else math.inf)
    if not fitting:
        raise ValueError("layout auto: no layout fits the devices: " + "; ".join(f"{o.spec}: {o.why}" for o in options))
    ordered = tuple(fitting + [o for o in options if o.predicted_s is None])
    return LayoutChoice(fitting[0], ordered, tokens, seq_len, f"{profile.name} ({profile.source})",
                        (time.perf_counter() - start) * 1e3)
