"""The collectives of a compiled XLA module, read from its HLO text, with the bytes each device sends.

Compiled (post-SPMD-partitioning) HLO shapes are per device. Bytes sent per device follow the ring conventions
of moejax.costs (group of P devices): all-gather of a result of R bytes (P-1)/P*R; reduce-scatter of an operand
of O = P*result bytes (P-1)/P*O; all-reduce of S bytes 2(P-1)/P*S; all-to-all of an operand of O bytes
(P-1)/P*O (operand and result are the same size); collective-permute its operand.

Async forms count once, at their `-start` (GPU: `all-gather-start`, `all-reduce-start`, sugared `all-to-all-start`
...); `-done` halves are skipped. An async collective printed as `async-start(..., calls=%c)` is counted where its
collective appears, inside %c. A collective inside a while loop's body (or anything it calls) is flagged
`in_loop`: it runs once per iteration. Where XLA knows the loop's trip count (`known_trip_count` in its
backend_config; nested loops multiply) `runs` says how often, and totals count it that many times; otherwise
`runs` is None and totals refuse it. Any other instruction counts once however often it runs."""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<type>[^%\"]*?)\s+"
                    r"(?P<kind>" + "|".join(KINDS) + r")(?P<start>-start)?\((?P<rest>.*)$")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*(?:\(.*\)\s*->.*)?\{\s*$")
_ARRAY = re.compile(r"(?P<dtype>pred|token|[a-z]+\d+[a-z0-9]*)\[(?P<dims>[^\]]*)\](?:\{[^}]*\})?")
_CALLS = re.compile(r"\b(?:body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_LOOP = re.compile(r"\b(?:body|condition)=%?([\w.\-]+)")
_BODY = re.compile(r"\bbody=%?([\w.\-]+)")
_TRIPS = re.compile(r'known_trip_count"?\s*:\s*\{\s*"?n"?\s*:\s*"?(\d+)')
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str  # one of KINDS (the `-start` of an async pair reads as its kind)
    name: str  # the instruction's name in the module
    result: tuple  # per-device result arrays as (dtype, dims); a tuple result lists every element
    group: int  # devices in each replica group (collective-permute: 0, not needed)
    bytes_sent: float  # per device, ring convention (module docstring)
    op_name: str  # metadata op_name ("" when absent): where JAX traced it, e.g. ".../shard_map/all_to_all"
    computation: str
    in_loop: bool  # inside a while loop: runs once per iteration
    runs: int | None = 1  # executions per run of the module: known trip counts multiplied (None: a loop's is unknown)

    @property
    def in_shard_map(self) -> bool:
        """Traced inside a jax.shard_map (the routed experts' programs): from metadata, so best effort."""
        return "shard_map" in self.op_name


def dtype_bits(dtype: str) -> int:
    """HLO element type -> bits: pred 8 (a byte per element), f32 32, bf16 16, f8e4m3fn 8, s4 4, c64 64."""
    if dtype == "pred":
        return 8
    if dtype == "token":
        return 0
    m = re.match(r"[a-z]+?(\d+)", dtype)
    if not m:
        raise ValueError(f"HLO element type {dtype!r} not understood")
    return int(m.group(1))


def array_bytes(dtype: str, dims: tuple) -> int:
    return math.ceil(math.prod(dims) * dtype_bits(dtype) / 8)


def parse_type(text: str) -> Any:
    """An HLO result type -> an array (dtype, dims) or a (nested) list of them for a tuple.
    `(f32[8,16]{1,0}, /*index=5*/s32[8]{0})` -> [("f32", (8, 16)), ("s32", (8,))]."""
    text = re.sub(r"/\*.*?\*/", "", text)
    pos = 0

    def parse() -> Any:  # as parse_type gives it
        nonlocal pos
        while text[pos] in " ,":
            pos += 1
        if text[pos] == "(":
            pos += 1
            items: list = []
            while True:
                while text[pos] in " ,":
                    pos += 1
                if text[pos] == ")":
                    pos += 1
                    return items
                items.append(parse())
        m = _ARRAY.match(text, pos)
        if not m:
            raise ValueError(f"HLO type {text!r}: cannot read an array at {text[pos:pos + 20]!r}")
        pos = m.end()
        dims = tuple(int(d.lstrip("<=")) for d in m.group("dims").split(",") if d.strip())
        return m.group("dtype"), dims
    out = parse()
    if text[pos:].strip():
        raise ValueError(f"HLO type {text!r}: trailing {text[pos:]!r}")
    return out


def _leaves(t: Any) -> list:  # an HLO type as parse_type gives it
    return [t] if isinstance(t, tuple) else [leaf for item in t for leaf in _leaves(item)]


def group_size(attrs: str, devices: int | None) -> int:
    """Devices per replica group from `replica_groups=...`: explicit `{{0,1,2,3},{4,5,6,7}}`, iota
    `[2,4]<=[8]` (groups x size), mesh-axis `mesh['a'=2,'b'=4] {'b'}`, or `{}` (all `devices`)."""
    m = re.search(r"replica_groups=(\{\{[^}]*\}|\[\d+,\d+\]<=|mesh\[[^\]]*\]\s*\{[^}]*\}|\{\})", attrs)
    if not m:
        raise ValueError(f"no replica_groups in {attrs[:200]!r}")
    spec = m.group(1)
    if spec.startswith("{{"):
        return len(spec[2:].split(","))
    if spec.startswith("["):
        return int(spec[1:].split(",")[1].split("]")[0])
    if spec.startswith("mesh"):
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", spec))
        size = 1
        axes = re.search(r"\{([^}]*)\}", spec.split("]", 1)[1])
        assert axes is not None  # the replica_groups pattern above matched mesh[...]{...}
        for axis in axes.group(1).split(","):
            name, _, sub = axis.strip().partition(":")  # a sub-axis reads 'a':(pre)size
            sub_size = re.search(r"\)(\d+)", sub)
            if not sub_size and name.strip("'") not in sizes:
                raise ValueError(f"replica_groups {spec!r}: axis {name} is not in the mesh")
            size *= int(sub_size.group(1)) if sub_size else int(sizes[name.strip("'")])
        return size
    if devices is None:
        raise ValueError("replica_groups={} means every device, but the module names no num_partitions")
    return devices


def _results(kind: str, start: bool, result: Any) -> list:  # result: its type, as parse_type gives it
    """The result arrays of a collective; a `-start`'s tuple also holds its operands (and, for collective-permute,
    context scalars): (operand(s), result(s), ...) -> result(s). all-reduce-start keeps the plain result."""
    if start and kind != "all-reduce" and isinstance(result, list) and len(result) >= 2:
        return _leaves(result[1])
    return _leaves(result)


def bytes_sent(kind: str, result_bytes: int, group: int) -> float:
    """Per-device bytes sent by one collective under the ring conventions."""
    P = group
    if kind == "all-gather":
        return (P - 1) / P * result_bytes
    if kind == "reduce-scatter":  # the operand is P results
        return (P - 1) * result_bytes
    if kind == "all-reduce":
        return 2 * (P - 1) / P * result_bytes
    if kind == "all-to-all":
        return (P - 1) / P * result_bytes
    if kind == "collective-permute":
        return float(result_bytes)
    raise ValueError(f"unknown collective kind {kind!r}")


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective instruction in an HLO module's text (all computations), in text order."""
    header = re.search(r"num_partitions=(\d+)", hlo_text)
    devices = int(header.group(1)) if header else None
    found: list[Collective] = []
    calls: dict[str, set[str]] = {}
    loops: list[str] = []
    trips: dict[str, int | None] = {}  # a while body -> its known trip count (None: unknown); conditions: None
    entry, computation = None, ""
    for line in hlo_text.splitlines():
        head = _COMPUTATION.match(line)
        if head:
            computation = head.group("name")
            entry = computation if line.startswith("ENTRY") else entry
            continue
        called = _CALLS.findall(line) + [c.strip().lstrip("%") for b in _BRANCHES.findall(line) for c in b.split(",")]
        if called:
            calls.setdefault(computation, set()).update(called)
        if " while(" in line:
            loops += _LOOP.findall(line)
            n = _TRIPS.search(line)
            trips.update({c: None for c in _LOOP.findall(line)})
            trips.update({c: int(n.group(1)) if n else None for c in _BODY.findall(line)})
        m = _INSTR.match(line)
        if not m:
            continue
        kind, start = m.group("kind"), bool(m.group("start"))
        arrays = _results(kind, start, parse_type(m.group("type")))
        size = sum(array_bytes(dt, dims) for dt, dims in arrays)
        group = 0 if kind == "collective-permute" else group_size(m.group("rest"), devices)
        op_name = re.search(r'op_name="([^"]*)"', m.group("rest"))
        found.append(Collective(kind, m.group("name"), tuple(arrays), group, bytes_sent(kind, size, group),
                                op_name.group(1) if op_name else "", computation, False))
    looped = _reachable(loops, calls)
    runs = _runs(entry, calls, trips) if entry is not None else {}
    return [dataclasses.replace(c, in_loop=c.computation in looped,
                                runs=runs.get(c.computation, 1) if c.computation in looped else 1) for c in found]


def _runs(entry: str, calls: dict, trips: dict) -> dict[str, int | None]:
    """How often each computation reachable from `entry` runs per run of the module: a loop body's trip count times
    its caller's (summed over the computations that call it), None where some loop's count is unknown."""
    callers: dict[str, set[str]] = {}
    for caller, called in calls.items():
        for c in called:
            callers.setdefault(c, set()).add(caller)
    memo: dict[str, int | None] = {entry: 1}
    reachable = _reachable([entry], calls)

    def runs(c: str, seen: frozenset = frozenset()) -> int | None:
        if c not in memo:
            total: int | None = 0
            for caller in callers.get(c, ()):
                if caller not in reachable or caller in seen:
                    continue
                r = runs(caller, seen | {c})
                factor = trips[c] if c in trips else 1
                total = None if total is None or r is None or factor is None else total + r * factor
            memo[c] = total
        return memo[c]
    return {c: runs(c) for c in reachable}


def _reachable(roots: list, calls: dict) -> set:
    """The computations in `roots` and whatever they call, transitively."""
    todo, seen = list(roots), set()
    while todo:
        c = todo.pop()
        if c not in seen:
            seen.add(c)
            todo.extend(calls.get(c, ()))
    return seen


def bytes_by_kind(found: list[Collective], *, in_shard_map: bool | None = None) -> dict[str, float]:
    """Total bytes sent per device by kind (kinds with none left out), each collective as often as it runs;
    optionally only those inside (True) or outside (False) shard_map programs. Refuses collectives in loops whose
    trip count XLA does not know."""
    unknown = [c.name for c in found if c.runs is None]
    if unknown:
        raise ValueError(f"collectives inside while loops of unknown trip count run once per iteration: {unknown[:5]}")
    out: dict[str, float] = {}
    for c in found:
        if in_shard_map is None or c.in_shard_map == in_shard_map:
            assert c.runs is not None  # refused above
            out[c.kind] = out.get(c.kind, 0.0) + c.bytes_sent * c.runs
    return out
