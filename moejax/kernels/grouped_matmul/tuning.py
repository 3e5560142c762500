"""Tile configurations of the grouped GEMM kernels, by shape class, read from a committed table that a GPU run of
`python -m launch.tune_gmm` wrote (tuning.json beside this file); where the table has no entry for the device or
the class, today's hand-picked choice.

A shape class is the op ("gemm": one product; "glu": the fused gate/up product, two accumulators) and the mean
rows per group rounded up to a power of two (16 .. 2048): what decides the row tile. The table also records,
per class, which backend the run measured fastest; `auto` follows it (grouped_matmul.auto.expert_auto).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
from collections.abc import Iterator

import jax

from moejax.kernels.grouped_matmul.mosaic_plan import MosaicConfig
from moejax.kernels.platform import shared_memory_bytes

TABLE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tuning.json")
ROW_CLASSES = (16, 32, 64, 128, 256, 512, 1024, 2048)


@dataclasses.dataclass(frozen=True)
class PallasConfig:
    bm: int  # rows per tile
    bn: int  # columns per block (of each half, for glu)
    bk: int  # depth per loop step
    warps: int
    stages: int
    cols_minor: bool = False  # grid (column blocks, row tiles): the column blocks of one row tile run together


def rows_class(rows: int, groups: int) -> int:
    mean = rows / max(groups, 1)
    return next((c for c in ROW_CLASSES if mean <= c), ROW_CLASSES[-1])


def class_key(op: str, rows: int, groups: int) -> str:
    return f"{op}/{rows_class(rows, groups)}"


@functools.cache
def _table(path: str = TABLE_PATH) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


_override: list[dict] = []


@contextlib.contextmanager
def using(entry: dict) -> Iterator[None]:
    """Trace kernels with this device entry instead of the committed table's (launch.tune_gmm times the whole
    expert FFN with the configurations it just measured best)."""
    _override.append(entry)
    try:
        yield
    finally:
        _override.pop()


def device_entry(kind: str | None = None, table: dict | None = None) -> dict:
    """The table's entry for this device kind: exact, else one of the same family (an H100's table serves an
    H200: same chip, same tiles), else empty."""
    if _override and kind is None and table is None:
        return _override[-1]
    table = _table() if table is None else table
    devices = table.get("devices", {})
    if kind is None:
        dev = jax.devices()[0]
        kind = dev.device_kind if dev.platform == "gpu" else ""
    if kind in devices:
        return devices[kind]
    hopper = "NVIDIA H"  # H100, H200, H800, H20: one chip design
    return next((v for k, v in devices.items() if kind.startswith(hopper) and k.startswith(hopper)), {})


def _divisor(n: int, largest: int, smallest: int = 16) -> int:
    b = largest
    while b > smallest and n % b:
        b //= 2
    return b


def default_pallas(rows: int, groups: int, k: int, n: int, fused: bool) -> PallasConfig:
    """The choice before any GPU tuning: 128-row tiles when groups average >= 128 rows, else 64 (16 for decode-
    sized batches); 8 warps for 128x128 accumulators (x2 when fused)."""
    mean = rows / max(groups, 1)
    bm = 128 if mean >= 128 else 64 if rows >= 64 else 16
    bn, bk = _divisor(n, 128), _divisor(k, 64)
    return PallasConfig(bm, bn, bk, 8 if bm * bn * (2 if fused else 1) >= 128 * 128 else 4, 3)


def fit_shared_memory(cfg: PallasConfig, itemsize: int, fused: bool, limit: int) -> PallasConfig:
    """The software pipeline keeps up to `stages` copies of one loop step's tiles (x [bm, bk] and w [bk, bn], per
    half when fused) in shared memory. The table was tuned in bfloat16: a float32 model's tiles are twice the
    bytes (on an H200 the tuned 64-row glu asked 240 KiB of 227), so fewer stages, then a shallower bk."""
    def need(c: PallasConfig) -> int:
        return c.stages * (c.bm * c.bk + (2 if fused else 1) * c.bk * c.bn) * itemsize

    while need(cfg) > limit and cfg.stages > 2:
        cfg = dataclasses.replace(cfg, stages=cfg.stages - 1)
    while need(cfg) > limit and cfg.bk > 16:
        cfg = dataclasses.replace(cfg, bk=cfg.bk // 2)
    return cfg


def pallas_config(rows: int, groups: int, k: int, n: int, fused: bool, entry: dict | None = None,
                  itemsize: int = 2, shared_bytes: int | None = None) -> PallasConfig:
    """For M = rows grouped rows, w [groups, k, n] (n: one half's width when fused) of `itemsize` bytes."""
    entry = device_entry() if entry is None else entry
    tuned = entry.get("pallas", {}).get(class_key("glu" if fused else "gemm", rows, groups))
    if not tuned:
        cfg = default_pallas(rows, groups, k, n, fused)
    else:
        cfg = PallasConfig(**tuned)
        # A tile larger than the operand (small models, tests) shrinks to one that divides it.
        cfg = dataclasses.replace(cfg, bn=_divisor(n, cfg.bn), bk=_divisor(k, cfg.bk),
                                  bm=cfg.bm if rows >= cfg.bm else 64 if rows >= 64 else 16)
    return fit_shared_memory(cfg, itemsize, fused, shared_memory_bytes() if shared_bytes is None else shared_bytes)


def mosaic_config(rows: int, groups: int, n: int, entry: dict | None = None) -> MosaicConfig:
    """For M = rows grouped rows against weights of n columns. One class key ("gemm/..") serves both products of
    the expert FFN: the Mosaic kernel has no fused variant."""
    entry = device_entry() if entry is None else entry
    tuned = entry.get("mosaic", {}).get(class_key("gemm", rows, groups))
    if tuned:
        return MosaicConfig(**tuned)
    return MosaicConfig(bm=128 if rows / max(groups, 1) >= 128 else 64, bn=128 if n > 64 else 64)


def fastest_backend(rows: int, groups: int, fused: bool, entry: dict | None = None) -> str | None:
    """The backend the last GPU run measured fastest for this class, or None (no run for this device)."""
    entry = device_entry() if entry is None else entry
    return entry.get("fastest", {}).get(class_key("glu" if fused else "gemm", rows, groups))
