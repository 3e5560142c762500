"""Hardware profiles: what the planners know about a machine, measured (`python -m launch.profile_devices`) or taken
from datasheets (`DATASHEETS`), and saying which. Pure data: a planner reads a profile, never a device.

Units are SI throughout: seconds, bytes, bytes/s, FLOP/s. A link moves n bytes in `alpha_s + n / bandwidth`
(the α-β model FinDEP fits, its β = 1 / bandwidth). Compute follows a roofline: an op of f FLOPs touching b bytes
takes `launch_s + max(f / rate, b / bandwidth)`, where `rate` is the peak or, in a measured profile, the rate
interpolated from the measured points nearest in size (so a small GEMM is as slow as it measured)."""
from __future__ import annotations

import bisect
import dataclasses
import json
import math
from typing import TYPE_CHECKING, Any, TypeVar, cast

if TYPE_CHECKING:
    from _typeshed import DataclassInstance  # typeshed's, for type checkers only

D = TypeVar("D", bound="DataclassInstance")  # a profile or one of its groups of fields

GB = 1e9
GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Link:
    """A transfer path: time(n bytes) = alpha_s + n / bandwidth."""
    alpha_s: float
    bandwidth: float  # bytes/s

    def time(self, nbytes: float) -> float:
        return self.alpha_s + nbytes / self.bandwidth if nbytes > 0 else 0.0

    @property
    def beta_s_per_byte(self) -> float:
        return 1.0 / self.bandwidth


@dataclasses.dataclass(frozen=True)
class Curve:
    """Achieved FLOP/s against a size (rows of a GEMM, rows per expert of a grouped GEMM, tokens x context of
    attention): measured points, interpolated in log(size), clamped at the ends. Empty: the peak applies."""
    sizes: tuple = ()
    rates: tuple = ()

    def rate(self, size: float, peak: float) -> float:
        if not self.sizes:
            return peak
        xs = [math.log(max(s, 1.0)) for s in self.sizes]
        x = math.log(max(size, 1.0))
        i = bisect.bisect_left(xs, x)
        if i == 0:
            return self.rates[0]
        if i == len(xs):
            return self.rates[-1]
        w = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
        return self.rates[i - 1] * (1 - w) + self.rates[i] * w


@dataclasses.dataclass(frozen=True)
class Processor:
    """One compute device (a GPU, or a host's CPUs together): its memory and roofs."""
    name: str
    memory_bytes: float
    flops: float  # dense 16-bit peak (datasheet) or best measured matmul rate
    bandwidth: float  # memory bytes/s
    launch_s: float = 0.0  # fixed cost per op (kernel launch, dispatch)
    matmul: Curve = Curve()  # measured: FLOP/s by GEMM rows (m of [m, k] x [k, n])
    grouped: Curve = Curve()  # measured: FLOP/s by rows per expert of a grouped GEMM
    attention: Curve = Curve()  # measured: FLOP/s by query tokens x context of a prefill attention

    def op_time(self, flops: float, nbytes: float, curve: str = "matmul", size: float | None = None) -> float:
        """Roofline time of one op: launch + max(compute at the rate measured for `size`, memory traffic)."""
        rate = getattr(self, curve).rate(size, self.flops) if size is not None else self.flops
        return self.launch_s + max(flops / rate, nbytes / self.bandwidth)


@dataclasses.dataclass(frozen=True)
class DepTaskFits:
    """FinDEP's α-β (Eq. 7-11) of DEP's four tasks for one split of the devices (A attention, B expert devices),
    fitted by least squares on micro-benchmarks of the tasks themselves (`python -m launch.profile --dep`,
    moejax.measure.dep), in work units that carry over to other shapes of the same model family:
    attention t_a = alpha_a + beta_gm x + beta_attn y (x: the projections' and router's m k n, y: causal pairs x
    heads x (d_qk + d_v)); shared expert t_s = alpha_s + beta_s x_s (its GEMMs' m k n); routed experts on one
    expert device t_e = alpha_e + beta_e w (w: rows that device runs x the m k n of one row through an expert);
    A2E and E2A one line t_c = alpha_c + beta_c z (z: bytes one expert device receives, A2E, or sends, E2A).
    `points`: the measurements, (task, work units..., seconds), for checks; `model`: the shapes measured."""
    attn_devices: int
    expert_devices: int
    alpha_a: float
    beta_gm: float
    beta_attn: float
    alpha_s: float
    beta_s: float
    alpha_e: float
    beta_e: float
    alpha_c: float
    beta_c: float
    model: str = ""
    a2e: str = ""  # the route measured (moejax.sharding.dep.A2E_ROUTES)
    points: tuple = ()

    @classmethod
    def from_dict(cls, d: dict) -> DepTaskFits:
        return cls(**{**d, "points": tuple(tuple(p) for p in d.get("points", ()))})


@dataclasses.dataclass(frozen=True)
class Profile:
    """A machine as the planners see it: `gpus` devices like `device`, a `host`, the links between them and the
    α-β fits of the collectives among the devices."""
    name: str
    source: str  # "datasheet" or "measured"
    device: Processor
    host: Processor
    gpus: int  # devices of this kind in the machine
    h2d: Link  # pinned host -> one device
    d2d: Link  # one device -> another (point to point: DEP's device_put between groups)
    all_to_all: Link  # per device: its bytes sent in one all-to-all among the devices
    all_gather: Link
    reduce_scatter: Link
    network: Link  # per device, between machines (what DEP's groups use once they span more than one machine)
    gpus_per_node: int = 8
    dtype_bytes: int = 2
    notes: str = ""
    dep: tuple[DepTaskFits, ...] = ()  # measured DEP task fits per (A, B) split (`launch.profile --dep`)

    def dep_fits(self, attn_devices: int, expert_devices: int) -> DepTaskFits | None:
        """The measured fits of the split (A, B), None where it was not measured."""
        return next((f for f in self.dep if (f.attn_devices, f.expert_devices) == (attn_devices, expert_devices)),
                    None)

    def with_overrides(self, overrides: dict[str, str | float]) -> Profile:
        """FIELD=VALUE what-ifs, dotted into nested fields: {"h2d.bandwidth": 100e9, "device.flops": 5e14}.
        ValueError naming a field that does not exist or a value that is not a number."""
        out = self
        for path, value in overrides.items():
            out = _replace_path(out, path.split("."), value, path)
        if overrides:
            out = dataclasses.replace(out, notes=(out.notes + "; " if out.notes else "") + "overridden: " +
                                      ", ".join(f"{k}={v}" for k, v in overrides.items()))
        return out

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Profile:
        def curve(c: dict) -> Curve:
            return Curve(tuple(c.get("sizes", ())), tuple(c.get("rates", ())))

        def proc(p: dict) -> Processor:
            return Processor(**{**p, **{k: curve(p[k]) for k in ("matmul", "grouped", "attention") if k in p}})
        links: dict[str, Any] = {k: Link(**d[k]) for k in LINKS}  # with `rest`: the JSON's other fields
        rest = {k: v for k, v in d.items() if k not in links and k not in ("device", "host", "dep")}
        rest["dep"] = tuple(DepTaskFits.from_dict(f) for f in d.get("dep", ()))
        return cls(device=proc(d["device"]), host=proc(d["host"]), **links, **rest)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.as_dict(), f, indent=1)

    def describe(self) -> str:
        d, h = self.device, self.host
        return (f"profile {self.name} ({self.source}): {self.gpus} x {d.name} ({d.memory_bytes / GiB:.0f} GiB, "
                f"{_rate(d.flops)}, {d.bandwidth / GB:.3g} GB/s); host {h.name} ({h.memory_bytes / GiB:.0f} GiB, "
                f"{_rate(h.flops)}, {h.bandwidth / GB:.3g} GB/s); host->device {self.h2d.bandwidth / GB:.3g} GB/s, "
                f"device->device {self.d2d.bandwidth / GB:.3g} GB/s" + (f"; {self.notes}" if self.notes else ""))


    def link_between(self, devices: int) -> Link:
        """Point-to-point path among `devices` devices: the node's (d2d) or, past one node, the network's."""
        return self.d2d if devices <= self.gpus_per_node else self.network


def _rate(flops: float) -> str:
    return f"{flops / 1e12:.3g} TFLOP/s" if flops >= 1e12 else f"{flops / 1e9:.3g} GFLOP/s"


LINKS = ("h2d", "d2d", "all_to_all", "all_gather", "reduce_scatter", "network")


def _replace_path(obj: D, parts: list[str], value: str | float, full: str) -> D:
    names = {f.name: f for f in dataclasses.fields(obj)}
    if parts[0] not in names:
        raise ValueError(f"--override {full}: {type(obj).__name__} has no field {parts[0]!r} (fields: "
                         f"{', '.join(names)})")
    current = getattr(obj, parts[0])
    if len(parts) > 1:
        if not dataclasses.is_dataclass(current):
            raise ValueError(f"--override {full}: {parts[0]!r} is a value, not a group of fields")
        group = cast("DataclassInstance", current)  # a field's value: an instance, not a class
        return dataclasses.replace(obj, **{parts[0]: _replace_path(group, parts[1:], value, full)})
    if dataclasses.is_dataclass(current):
        raise ValueError(f"--override {full}: {parts[0]!r} is a group of fields; name one, e.g. {full}."
                         f"{dataclasses.fields(current)[0].name}")
    if isinstance(current, str):
        return dataclasses.replace(obj, **{parts[0]: str(value)})
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"--override {full}: {value!r} is not a number") from None
    if not math.isfinite(number) or number < 0 or (number == 0 and parts[0] in ("bandwidth", "flops")):
        raise ValueError(f"--override {full}: {value!r} must be a positive number")
    return dataclasses.replace(obj, **{parts[0]: int(number) if isinstance(current, int) else number})
