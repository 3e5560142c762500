"""Layout specs: how attention and routed experts are spread over devices, e.g. "attn=dp,experts=ep".

Keys: attn in {dp, tp, pp}; experts in {replicated, tp, ep, async_ep, dep, pp}; devices=N (default: all);
exchange in {all_to_all, gather} (ep: tokens to experts by two all-to-alls, or by an all-gather of tokens and a
reduce-scatter of outputs; dep: the same, inside the expert group); for dep (FinDEP): attn_devices=A and
expert_devices=B (the first A devices run attention, the next B the routed experts; default: half each, or
whatever `devices` leaves), r1 micro-batches, r2 token chunks per expert step, order in {asas, aass, pppipe}
(pppipe: MegaScale-Infer's ping-pong pipeline, FinDEP's baseline: the shared expert runs with attention, before
the sends, and r2 = 1). Each DEP field may be "auto": moejax.load asks FinDEP's solver (moejax.plan); r1, r2 and
order left auto are also re-solved for each step's shape while the engine runs (`online`; moejax.plan.findep_online).
attn=pp,experts=pp (MoE-Prefill Table 1's PP+PP): pipeline parallelism, the decoder layers split contiguously over
the devices (stages; the first stages take one more layer when they do not divide) and each batch's rows over
microbatches=M micro-batches (default: one per stage) that flow through the stages GPipe-style
(moejax.sharding.pipeline_steps); prefill-only: full logits and token log-probabilities."""
from __future__ import annotations

import dataclasses
import math

import numpy as np

ATTN = ("dp", "tp", "pp")
EXPERTS = ("replicated", "tp", "ep", "async_ep", "dep", "pp")
EXCHANGES = ("all_to_all", "gather")
ORDERS = ("asas", "aass", "pppipe")
IMPLEMENTED = ({(a, e) for a in ("dp", "tp") for e in ("replicated", "tp", "ep", "async_ep")}
               | {("dp", "dep"), ("pp", "pp")})
_INTS = ("devices", "attn_devices", "expert_devices", "r1", "r2", "microbatches")
AUTO = ("attn_devices", "expert_devices", "r1", "r2", "order")  # experts=dep: "auto" asks FinDEP's solver
_ONLY_FOR = {"exchange": ("ep", "dep"), "attn_devices": ("dep",), "expert_devices": ("dep",), "r1": ("dep",),
             "r2": ("dep",), "order": ("dep",), "microbatches": ("pp",)}


@dataclasses.dataclass(frozen=True)
class Layout:
    attn: str = "dp"
    experts: str = "replicated"
    devices: int | None = None
    exchange: str = "all_to_all"
    attn_devices: int | None = None
    expert_devices: int | None = None
    r1: int = 1
    r2: int = 1
    order: str = "asas"
    # DEP fields (of r1, r2, order) that FinDEP re-solves per step shape (they were "auto"); the values above are
    # the load's solution, for the planned workload
    online: tuple[str, ...] = ()
    microbatches: int | None = None  # pp: how many micro-batches a step's rows split into (resolve: the stages)

    @classmethod
    def parse(cls, spec: str) -> Layout:
        """"attn=dp,experts=ep,devices=8" -> Layout (ValueError naming the bad key or value)."""
        fields = {f.name for f in dataclasses.fields(cls)} - {"online"}  # online: set by the planner, from auto
        values: dict = {}
        for part in filter(None, (p.strip() for p in str(spec).split(","))):
            key, sep, value = part.partition("=")
            key, value = key.strip(), value.strip()
            if not sep or not value:
                raise ValueError(f"layout {spec!r}: {part!r} is not key=value")
            if key not in fields:
                raise ValueError(f"layout {spec!r}: unknown key {key!r}; known: {', '.join(sorted(fields))}")
            if key in values:
                raise ValueError(f"layout {spec!r}: {key!r} given twice")
            if value == "auto" and key in AUTO:
                pass
            elif key in _INTS:
                if not value.isdigit() or int(value) < 1:
                    raise ValueError(f"layout {spec!r}: {key} must be an int >= 1, got {value!r}")
                values[key] = int(value)
                continue
            values[key] = value
        for key, allowed in (("attn", ATTN), ("experts", EXPERTS), ("exchange", EXCHANGES), ("order", ORDERS)):
            if key in values and values[key] not in allowed and not (key == "order" and values[key] == "auto"):
                raise ValueError(f"layout {spec!r}: {key} must be one of {', '.join(allowed)}, got {values[key]!r}")
        experts = values.get("experts", cls.experts)
        for key, only in _ONLY_FOR.items():
            if key in values and experts not in only:
                raise ValueError(f"layout {spec!r}: {key} applies to experts={' or '.join(only)}, not {experts}")
        return cls(**values)

    @property
    def auto_fields(self) -> tuple[str, ...]:
        """DEP fields left to the planner ("auto")."""
        return tuple(k for k in AUTO if getattr(self, k) == "auto")

    def resolve(self, num_experts: int, available: int, *, expert_width: int = 0, heads: int = 0, layers: int = 0
                ) -> Layout:
        """Check against the model and the devices present; fill in `devices` (pp: and `microbatches`). A count
        of 0 (expert_width, heads, layers) is not checked."""
        if self.auto_fields:
            raise ValueError(f"layout: {', '.join(self.auto_fields)}=auto must be planned before the layout is "
                             "resolved")
        if self.experts == "dep":
            return self._resolve_dep(num_experts, available)
        n = self.devices or available
        if n > available:
            raise ValueError(f"layout: devices={n} but only {available} are present")
        if (self.attn, self.experts) not in IMPLEMENTED:
            raise ValueError(f"layout: attn={self.attn},experts={self.experts} is not implemented yet (have: "
                             f"{', '.join(f'attn={a},experts={e}' for a, e in sorted(IMPLEMENTED))})")
        if self.attn == "pp":
            if layers and layers < n:
                raise ValueError(f"layout: attn=pp,experts=pp splits the {layers} decoder layers over {n} stages "
                                 f"(devices): each stage needs a layer, so devices must be <= {layers}")
            return dataclasses.replace(self, devices=n, microbatches=self.microbatches or n)
        if self.experts in ("ep", "async_ep") and num_experts % n:
            raise ValueError(f"layout: experts={self.experts} needs the {num_experts} experts to divide evenly over "
                             f"{n} devices")
        if self.experts == "tp" and expert_width % n:
            raise ValueError(f"layout: experts=tp needs the expert width {expert_width} to divide over {n} devices")
        if self.attn == "tp" and heads % n:
            raise ValueError(f"layout: attn=tp needs the {heads} attention heads to divide over {n} devices")
        return dataclasses.replace(self, devices=n)

    def _resolve_dep(self, num_experts: int, available: int) -> Layout:
        if self.attn != "dp":
            raise ValueError("layout: experts=dep runs attention data-parallel inside its attention group (attn=dp)")
        a, b, n = self.attn_devices, self.expert_devices, self.devices
        if a is None and b is None:
            n = n or available
            if n < 2:
                raise ValueError(f"layout: experts=dep needs 2 or more devices (an attention and an expert group), "
                                 f"{n} given")
            a, b, _ = dep_default_split(num_experts, n)
        elif a is None or b is None:
            n = n or available
            given = a if b is None else b
            assert given is not None  # one of the two is given
            if given >= n:
                raise ValueError(f"layout: experts=dep: {'attn' if b is None else 'expert'}_devices={given} leaves no "
                                 f"device of the {n} for the other group")
            a, b = (given, n - given) if b is None else (n - given, given)
        elif n is not None and n != a + b:
            raise ValueError(f"layout: devices={n} but attn_devices={a} + expert_devices={b} = {a + b}")
        if a + b > available:
            raise ValueError(f"layout: attn_devices={a} + expert_devices={b} = {a + b} devices but only {available} "
                             "are present")
        if self.order == "pppipe" and self.r2 != 1:
            raise ValueError(f"layout: order=pppipe sends each micro-batch whole (r2=1), got r2={self.r2}")
        if num_experts % b:
            raise ValueError(f"layout: experts=dep needs the {num_experts} experts to divide evenly over the "
                             f"{b} expert devices")
        return dataclasses.replace(self, devices=a + b, attn_devices=a, expert_devices=b)

    @property
    def row_multiple(self) -> int:
        """Batches are padded to a multiple of this many rows: the devices that split them (attn=dp; DEP: its
        attention devices, for each of its r1 micro-batches; pp: its micro-batches); 1 under attn=tp or before
        `resolve`."""
        if self.attn == "pp":
            return self.microbatches or 1
        if self.attn != "dp" or not self.devices:
            return 1
        if self.experts != "dep":
            return self.devices
        assert self.attn_devices is not None  # resolved: DEP's groups are set with its devices
        return self.attn_devices * (1 if "r1" in self.online else self.r1)  # online: r1 fits each step's rows

    def micro_batches(self, rows: int) -> tuple[int, ...]:
        """DEP: rows of each of the (up to) r1 micro-batches of a batch."""
        return tuple(len(c) for c in np.array_split(np.arange(rows), min(self.r1, rows)))

    def token_chunks(self, tokens: int) -> tuple[tuple[int, int], ...]:
        """DEP: a micro-batch's tokens as (up to) r2 chunks of (real rows, padded rows); padded to a multiple of
        lcm(A, B) rows so that both groups split them evenly over their devices."""
        assert self.attn_devices is not None and self.expert_devices is not None, "resolve the layout first"
        multiple = math.lcm(self.attn_devices, self.expert_devices)
        sizes = [len(c) for c in np.array_split(np.arange(tokens), min(self.r2, tokens))]
        return tuple((s, -(-s // multiple) * multiple) for s in sizes)

    def __str__(self) -> str:
        out = f"attn={self.attn},experts={self.experts},devices={self.devices}"
        if self.experts == "dep":
            out += (f",attn_devices={self.attn_devices},expert_devices={self.expert_devices},r1={self.r1},"
                    f"r2={self.r2},order={self.order}")
        if self.attn == "pp":
            out += f",microbatches={self.microbatches}"
        return out + (f",exchange={self.exchange}" if self.experts in ("ep", "dep") else "")


def dep_default_split(num_experts: int, devices: int) -> tuple[int, int, str | None]:
    """DEP's split without a plan: half the devices each, the expert group the larger half, when the experts divide
    evenly over that half; otherwise the expert group nearest to it that they divide over (ties: the larger one)
    -> (attention devices, expert devices, why it moved from half and half, or None)."""
    half = devices - devices // 2
    sizes = [b for b in range(1, devices) if num_experts % b == 0]
    if not sizes:
        raise ValueError(f"layout: experts=dep: no split of {devices} devices leaves an expert group the "
                         f"{num_experts} experts divide evenly over")
    b = min(sizes, key=lambda size: (abs(size - half), -size))
    if b == half:
        return devices - b, b, None
    return devices - b, b, (f"half and half ({devices // 2} + {half}) does not divide the {num_experts} experts "
                            f"over the expert group; the nearest split that does: {devices - b} + {b}")
