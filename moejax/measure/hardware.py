"""Measure a hardware profile (moejax.plan.hardware.Profile) on the devices present: what the planners need and a
datasheet cannot say. This module needs devices; the planners never import it (docs/design.md: a planner never asks a
device). `python -m launch.profile_devices` is its command line.

Every figure is the median of a few timed calls after a warm-up call (which compiles), each call waited for with
`jax.block_until_ready` and timed with `time.perf_counter`.

- Compute curves (`device.matmul`, `.grouped`, `.attention`) are FLOP/s by size with the launch overhead taken
  out (rate = FLOPs / (time - launch_s)), because `Processor.op_time` adds `launch_s` back: the profile then
  predicts a measured op's time, not its time plus a second launch. `device.flops` is the best rate measured.
- Dense matmul: [m, D] x [D, F] at m rows, 2mDF FLOPs, 16-bit operands and float32 accumulation as the engine runs
  them. Grouped GEMM: E experts' [r, D] x [D, I] with the engine's grouped_matmul kernel (its `auto` backend by
  default: jax.lax.ragged_dot computes every row against every expert on CPU, so it would understate the engine),
  2ErDI FLOPs, size r = rows per expert. Attention: one causal prefill of T tokens in plain jnp
  (softmax(QK^T)V, GQA heads grouped), FLOPs by moejax.costs' convention (visible pairs x 2(d_qk + d_v) per
  head, though the plain product computes every pair), size T x T (query tokens x context).
- Links are α-β fits (least squares of seconds against bytes; α clamped at 0) over several sizes. h2d: pinned host
  memory (memory kind "pinned_host", as moejax.offload.host_store keeps experts) to device memory. d2d: a
  `device_put` from device 0 to device 1. Collectives run among all devices in a shard_map over a 1-D mesh, and
  their bytes are those SENT per device, ring convention (moejax.costs): (P-1)/P of an all-to-all's or a
  reduce-scatter's operand, (P-1)/P of an all-gather's result.
Whatever could not be measured (one device: no d2d, no collectives; CPU: no device memory figure) is substituted
and named in the profile's notes."""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P
from jax.typing import DTypeLike

from moejax.config import ModelConfig
from moejax.costs import causal_pairs
from moejax.kernels.grouped_matmul import grouped_matmul
from moejax.kernels.precision import for_operands
from moejax.plan.hardware import Curve, Link, Processor, Profile
from moejax.plan.paths import device_tag
from moejax.sharding.mesh import make_mesh

AXIS = "x"  # the mesh axis of moejax.sharding.mesh.make_mesh
COLLECTIVES = ("all_to_all", "all_gather", "reduce_scatter")
_f32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The model dimensions the measurements use."""
    hidden: int  # D
    dense_width: int  # F of a dense [D, F] matmul
    experts: int  # E
    expert_width: int  # I of one expert's [D, I]
    heads: int
    kv_heads: int
    d_qk: int
    d_v: int
    model: str = "generic"

    @classmethod
    def of(cls, cfg: ModelConfig, name: str) -> Shapes:
        mla = cfg.attention == "mla"
        return cls(cfg.hidden_size, cfg.intermediate_size or cfg.moe_intermediate_size, max(cfg.num_experts, 1),
                   cfg.moe_intermediate_size or cfg.intermediate_size, cfg.num_heads,
                   cfg.num_heads if mla else cfg.num_kv_heads, cfg.q_head_dim, cfg.v_head_dim if mla else cfg.head_dim,
                   name)

    @classmethod
    def generic(cls, quick: bool) -> Shapes:
        if quick:
            return cls(512, 2048, 8, 512, 8, 2, 64, 64)
        return cls(1024, 4096, 8, 1024, 16, 4, 128, 128)


@dataclasses.dataclass(frozen=True)
class Sweep:
    """Which sizes to time and how often."""
    rows: tuple[int, ...]  # dense matmul rows m
    rows_per_expert: tuple[int, ...]
    tokens: tuple[int, ...]  # attention prefill lengths T
    bandwidth_bytes: int  # the array one device-memory pass reads (and writes again)
    transfer_bytes: tuple[int, ...]  # of one h2d or d2d copy
    collective_bytes: tuple[int, ...]  # per device, of a collective's operand
    host_matmul: int  # n of the host's [n, n] x [n, n] float32 matmul
    host_copy_bytes: int
    repeats: int
    launch_repeats: int


QUICK = Sweep(rows=(8, 32, 128, 512), rows_per_expert=(8, 64), tokens=(128, 256, 512),
              bandwidth_bytes=32 << 20, transfer_bytes=tuple(4**i << 14 for i in range(6)),
              collective_bytes=tuple(4**i << 14 for i in range(5)), host_matmul=512,
              host_copy_bytes=32 << 20, repeats=3, launch_repeats=20)
FULL = Sweep(rows=tuple(2**i for i in range(4, 14)), rows_per_expert=(1, 4, 16, 64, 256, 1024),
             tokens=(512, 1024, 2048, 4096), bandwidth_bytes=1 << 30,
             transfer_bytes=tuple(4**i << 16 for i in range(7)), collective_bytes=tuple(4**i << 16 for i in range(7)),
             host_matmul=2048, host_copy_bytes=256 << 20, repeats=5, launch_repeats=50)
# A CPU computes ~1000x slower than a GPU: the same span of sizes, capped lower (about a minute with 2 cores).
FULL_CPU = dataclasses.replace(FULL, rows=FULL.rows[:8], rows_per_expert=FULL.rows_per_expert[:5],
                               tokens=FULL.tokens[:3], bandwidth_bytes=256 << 20,
                               transfer_bytes=FULL.transfer_bytes[:6], collective_bytes=FULL.collective_bytes[:6])


def sweep_for(platform: str, quick: bool) -> Sweep:
    return QUICK if quick else FULL_CPU if platform == "cpu" else FULL


@dataclasses.dataclass(frozen=True)
class Fit:
    """An α-β fit with what it was fitted to: (bytes, seconds) samples, R² (1 - residual / total variance of the
    seconds: dominated by the largest sizes) and the worst relative error over the samples (what the fit
    minimises, every size alike)."""
    link: Link
    r2: float
    samples: tuple[tuple[int, float], ...]
    note: str = ""

    @property
    def worst_error(self) -> float:
        return max(abs(self.link.time(n) / t - 1) for n, t in self.samples)


@dataclasses.dataclass
class Measurement:
    """A measured profile and how it was obtained (the fits and raw points, for printing)."""
    profile: Profile
    fits: dict[str, Fit]
    curves: dict[str, tuple[tuple[float, float, float], ...]]  # name -> (size, seconds, FLOP/s)
    seconds: float


# ---------------------------------------------------------------------------------------------------- timing


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of `fn()` (waited for) over `repeats` calls after one warm-up call (compilation, first
    touch of memory)."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _compute_seconds(seconds: float, launch_s: float) -> float:
    """The measured time less the launch overhead op_time adds back; at least half the measured time, so a
    launch-bound op's rate stays finite and not absurd."""
    return max(seconds - launch_s, 0.5 * seconds)


def _random(shape: tuple[int, ...], dtype: DTypeLike, seed: int = 0) -> jax.Array:
    """Normal values on the device, drawn on the host (no compilation per shape): a block of 2^20 repeated."""
    block = np.random.default_rng(seed).standard_normal(min(math.prod(shape), 1 << 20), np.float32)
    return jnp.asarray(np.resize(block, shape)).astype(dtype)  # converted on the device: numpy's bfloat16 is slow


# ---------------------------------------------------------------------------------------------------- device compute


def launch_overhead(repeats: int) -> float:
    """Seconds of a tiny jitted op, dispatch to result: the fixed cost of every op."""
    x = jnp.zeros((8,), _f32)
    tiny = jax.jit(lambda a: a + 1)
    return median_seconds(lambda: tiny(x), repeats)


@functools.partial(jax.jit, static_argnums=2)
def _matmul(x: jax.Array, w: jax.Array, dtype: DTypeLike) -> jax.Array:
    return jnp.dot(x, w, preferred_element_type=_f32, precision=for_operands(dtype)).astype(dtype)


def matmul_seconds(rows: int, hidden: int, width: int, dtype: DTypeLike, repeats: int) -> float:
    """Median seconds of one [rows, hidden] x [hidden, width] matmul, float32 accumulation, result in `dtype`."""
    x, w = _random((rows, hidden), dtype, 1), _random((hidden, width), dtype, 2)
    return median_seconds(lambda: _matmul(x, w, dtype), repeats)


def matmul_points(shapes: Shapes, sweep: Sweep, dtype: DTypeLike, launch_s: float
                  ) -> tuple[tuple[float, float, float], ...]:
    D, F = shapes.hidden, shapes.dense_width
    return _points(sweep.rows, lambda m: 2 * m * D * F, lambda m: matmul_seconds(m, D, F, dtype, sweep.repeats),
                   launch_s)


@functools.partial(jax.jit, static_argnums=3)
def _grouped(x: jax.Array, w: jax.Array, group_sizes: jax.Array, backend: str) -> jax.Array:
    return grouped_matmul(x, w, group_sizes, backend=backend)


@functools.partial(jax.jit, static_argnums=(2, 3))
def _batched(x: jax.Array, w: jax.Array, experts: int, rows: int) -> jax.Array:
    """The einsum fallback: every expert's rows as one batch dimension."""
    return jnp.einsum("erd,edi->eri", x.reshape(experts, rows, -1), w, preferred_element_type=_f32).astype(x.dtype)


def grouped_seconds(rows_per_expert: int, shapes: Shapes, dtype: DTypeLike, repeats: int, backend: str) -> float:
    """Median seconds of a grouped GEMM: every expert gets `rows_per_expert` rows of [D] times its [D, I]."""
    E, D, I = shapes.experts, shapes.hidden, shapes.expert_width
    x, w = _random((E * rows_per_expert, D), dtype, 3), _random((E, D, I), dtype, 4)
    if backend == "einsum":
        return median_seconds(lambda: _batched(x, w, E, rows_per_expert), repeats)
    group_sizes = jnp.full((E,), rows_per_expert, jnp.int32)
    return median_seconds(lambda: _grouped(x, w, group_sizes, backend), repeats)


def grouped_backend_refused(backend: str, platform: str) -> str | None:
    """Why the grouped GEMM curve is not measured with `backend` on `platform`, or None. On a GPU, XLA runs
    jax.lax.ragged_dot as a dense masked product (JAX 0.10-0.11): every row against every expert, through a
    [rows, experts, hidden] intermediate; the first H200 run measured 5.7 TFLOP/s at every size and ran out of memory
    at 262144 rows. The planners would then plan for a kernel the engine never runs (its auto never picks it)."""
    if platform == "gpu" and backend == "ragged_dot":
        return ("grouped GEMM backend ragged_dot on a GPU: XLA runs it as a dense masked product (every row times "
                "every expert), not what the engine runs; measure with auto (the engine's choice) or pallas")
    return None


def grouped_points(shapes: Shapes, sweep: Sweep, dtype: DTypeLike, launch_s: float, backend: str
                   ) -> tuple[tuple[float, float, float], ...]:
    E, D, I = shapes.experts, shapes.hidden, shapes.expert_width
    return _points(sweep.rows_per_expert, lambda r: 2 * E * r * D * I,
                   lambda r: grouped_seconds(r, shapes, dtype, sweep.repeats, backend), launch_s)


@jax.jit
def _causal_attention(q_TKGd: jax.Array, k_TKd: jax.Array, v_TKd: jax.Array) -> jax.Array:
    """Plain causal prefill attention, GQA: query heads grouped as [kv heads K, G per kv head]."""
    scores = jnp.einsum("qkgd,tkd->kgqt", q_TKGd, k_TKd, preferred_element_type=_f32) * q_TKGd.shape[-1] ** -0.5
    T = q_TKGd.shape[0]
    visible = jnp.arange(T)[:, None] >= jnp.arange(T)[None, :]
    probs = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1).astype(v_TKd.dtype)
    return jnp.einsum("kgqt,tkd->qkgd", probs, v_TKd, preferred_element_type=_f32).astype(v_TKd.dtype)


def attention_flops(tokens: int, shapes: Shapes) -> int:
    """moejax.costs' convention: visible (query, key) pairs x heads x 2(d_qk + d_v)."""
    return causal_pairs(tokens) * shapes.heads * 2 * (shapes.d_qk + shapes.d_v)


def attention_seconds(tokens: int, shapes: Shapes, dtype: DTypeLike, repeats: int) -> float:
    K, G = shapes.kv_heads, shapes.heads // shapes.kv_heads
    q = _random((tokens, K, G, shapes.d_qk), dtype, 5)
    k, v = _random((tokens, K, shapes.d_qk), dtype, 6), _random((tokens, K, shapes.d_v), dtype, 7)
    return median_seconds(lambda: _causal_attention(q, k, v), repeats)


def attention_points(shapes: Shapes, sweep: Sweep, dtype: DTypeLike, launch_s: float
                     ) -> tuple[tuple[float, float, float], ...]:
    points = _points(sweep.tokens, lambda T: attention_flops(T, shapes),
                     lambda T: attention_seconds(T, shapes, dtype, sweep.repeats), launch_s)
    return tuple((T * T, s, rate) for T, s, rate in points)  # size: query tokens x context


def _points(sizes: Sequence[int], flops_of: Callable[[int], float], seconds_of: Callable[[int], float], launch_s: float
            ) -> tuple[tuple[float, float, float], ...]:
    """(size, seconds, FLOP/s with the launch overhead taken out) for each size."""
    out = []
    for size in sizes:
        seconds = seconds_of(size)
        out.append((size, seconds, flops_of(size) / _compute_seconds(seconds, launch_s)))
    return tuple(out)


def curve_of(points: Sequence[tuple[float, float, float]]) -> Curve:
    return Curve(tuple(float(p[0]) for p in points), tuple(float(p[2]) for p in points))


def device_bandwidth(nbytes: int, repeats: int, launch_s: float) -> float:
    """Bytes/s of one pass over a large float32 array (x + 1: each byte read once and written once)."""
    x = jnp.zeros((nbytes // 4,), _f32)
    add_one = jax.jit(lambda a: a + 1)
    seconds = median_seconds(lambda: add_one(x), repeats)
    return 2 * x.nbytes / _compute_seconds(seconds, launch_s)


def host_memory_bytes() -> float:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def device_memory_bytes(device: jax.Device) -> tuple[float, str]:
    """(bytes, note): the allocator's limit where the device reports one, else the host's RAM (CPU devices)."""
    try:
        stats = device.memory_stats() or {}
    except Exception:  # backends without memory statistics raise rather than return None
        stats = {}
    if stats.get("bytes_limit"):
        return float(stats["bytes_limit"]), ""
    return host_memory_bytes(), "device memory: the host's RAM (the device reports no memory limit)"


# ---------------------------------------------------------------------------------------------------- links


def fit_alpha_beta(samples: Sequence[tuple[int, float]]) -> Fit:
    """time = alpha + bytes / bandwidth over (bytes, seconds) samples, least squares of the RELATIVE error (the
    sizes span orders of magnitude: plain least squares would fit the largest and ignore the latency). A negative
    intercept is refitted through the origin (α = 0); a time that does not grow with size (overhead swamps every
    size) keeps the largest transfer's bytes/s as the bandwidth, with α = 0, and says so."""
    n = np.array([s[0] for s in samples], float)
    t = np.array([s[1] for s in samples], float)
    (alpha, slope), *_ = np.linalg.lstsq(np.stack([1 / t, n / t], axis=1), np.ones_like(t), rcond=None)
    note = ""
    if alpha < 0:
        alpha, slope = 0.0, float((n / t).sum() / ((n / t) ** 2).sum())
    if slope * n.max() < 0.01 * t.max():
        largest = int(np.argmax(n))
        alpha, slope, note = 0.0, t[largest] / n[largest], "time did not grow with size: the largest's bytes/s"
    predicted = alpha + slope * n
    total = float(((t - t.mean()) ** 2).sum())
    r2 = 1.0 - float(((t - predicted) ** 2).sum()) / total if total > 0 else 1.0
    return Fit(Link(float(alpha), float(1.0 / slope)), r2, tuple((int(a), float(b)) for a, b in samples), note)


def _f32_elements(nbytes: int, multiple: int = 1) -> int:
    """Elements of a float32 array of about `nbytes`, a multiple of `multiple` (rows split over devices)."""
    return max(multiple, nbytes // 4 // multiple * multiple)


def pinned_host_available(device: jax.Device) -> bool:
    try:
        return "pinned_host" in {m.kind for m in device.addressable_memories()}
    except Exception:  # a backend without memory spaces
        return False


def host_to_device(sizes: Sequence[int], repeats: int) -> tuple[Fit, str]:
    """α-β fit of copies from pinned host memory to device 0 (from numpy arrays where there is no pinned_host
    memory kind), as moejax.offload.host_store moves experts."""
    device = jax.local_devices()[0]
    pinned = pinned_host_available(device)
    to_device = SingleDeviceSharding(device, memory_kind="device") if pinned else device
    samples = []
    for nbytes in sizes:
        array = np.ones(_f32_elements(nbytes), np.float32)
        source = jax.device_put(array, SingleDeviceSharding(device, memory_kind="pinned_host")) if pinned else array
        samples.append((array.nbytes, median_seconds(functools.partial(jax.device_put, source, to_device), repeats)))
    return fit_alpha_beta(samples), "" if pinned else "h2d: from numpy arrays (no pinned_host memory kind)"


def device_to_device(sizes: Sequence[int], repeats: int) -> Fit | None:
    """α-β fit of `device_put` from device 0 to device 1 (DEP's transfers between groups); None with one device."""
    devices = jax.local_devices()  # a process can only put onto its own devices
    if len(devices) < 2:
        return None
    samples = []
    for nbytes in sizes:
        source = jax.device_put(jnp.ones((_f32_elements(nbytes),), _f32), devices[0])
        samples.append((source.nbytes, median_seconds(functools.partial(jax.device_put, source, devices[1]), repeats)))
    return fit_alpha_beta(samples)


def _collective_body(kind: str) -> Callable[[jax.Array], jax.Array]:
    if kind == "all_to_all":
        return lambda x: jax.lax.all_to_all(x, AXIS, 0, 0, tiled=True)
    if kind == "all_gather":
        return lambda x: jax.lax.all_gather(x, AXIS, tiled=True)
    return lambda x: jax.lax.psum_scatter(x, AXIS, scatter_dimension=0, tiled=True)


def sent_bytes(kind: str, operand_bytes: int, devices: int) -> float:
    """Bytes each device sends, ring convention (moejax.costs): (P-1)/P of the operand, or of the result of an
    all-gather (P operands)."""
    ring = (devices - 1) / devices
    return ring * operand_bytes * (devices if kind == "all_gather" else 1)


def collective(kind: str, sizes: Sequence[int], repeats: int) -> Fit | None:
    """α-β fit of one collective among all devices against the bytes each sends; None with one device."""
    n = jax.device_count()
    if n < 2:
        return None
    mesh = make_mesh(n)
    run = jax.jit(jax.shard_map(_collective_body(kind), mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS),
                                check_vma=False))
    samples = []
    for nbytes in sizes:
        local = _f32_elements(nbytes, n)  # every device's operand, split n ways by all-to-all and reduce-scatter
        ones = np.ones(n * local, np.float32)  # from a callback: every process makes its own devices' blocks
        x = jax.make_array_from_callback(ones.shape, NamedSharding(mesh, P(AXIS)), ones.__getitem__)
        samples.append((int(sent_bytes(kind, 4 * local, n)), median_seconds(functools.partial(run, x), repeats)))
    return fit_alpha_beta(samples)


# ---------------------------------------------------------------------------------------------------- host


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        name = ""
    return f"{name or platform.processor() or 'unknown CPU'}, {os.cpu_count()} cores"


def _numpy_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def host_processor(sweep: Sweep) -> tuple[Processor, dict]:
    """The host's CPUs together: numpy float32 matmul rate, numpy copy bandwidth (read + write), RAM, and the
    cost of a tiny numpy op as its launch overhead."""
    rng = np.random.default_rng(0)
    n = sweep.host_matmul
    a, b = rng.standard_normal((n, n), np.float32), rng.standard_normal((n, n), np.float32)
    matmul_s = _numpy_seconds(lambda: a @ b, sweep.repeats)
    src = np.ones(sweep.host_copy_bytes // 4, np.float32)
    dst = np.empty_like(src)
    copy_s = _numpy_seconds(lambda: np.copyto(dst, src), sweep.repeats)
    tiny = np.zeros(8, np.float32)
    launch_s = _numpy_seconds(lambda: np.add(tiny, 1, out=tiny), sweep.launch_repeats)
    flops, bandwidth = 2 * n**3 / matmul_s, 2 * src.nbytes / copy_s
    return Processor(cpu_name(), host_memory_bytes(), flops, bandwidth, launch_s=launch_s), \
        dict(matmul_n=n, matmul_s=matmul_s, copy_bytes=src.nbytes, copy_s=copy_s)


# ---------------------------------------------------------------------------------------------------- profile


def measure_profile(shapes: Shapes, sweep: Sweep, *, dtype: str = "bfloat16", grouped_backend: str = "auto",
                    log: Callable[[str], None] = lambda _: None) -> Measurement:
    """Measure everything a Profile holds on the devices present (see the module docstring)."""
    start = time.perf_counter()
    dt = jnp.dtype(dtype)
    device = jax.local_devices()[0]
    refused = grouped_backend_refused(grouped_backend, device.platform)
    if refused:
        raise ValueError(refused)
    notes = [f"measured in {dtype} with {shapes.model} shapes (D={shapes.hidden}, F={shapes.dense_width}, "
             f"E={shapes.experts}, I={shapes.expert_width}, heads={shapes.heads}/{shapes.kv_heads})",
             f"grouped GEMM: grouped_matmul backend {grouped_backend}",
             "attention size: query tokens x context of a causal prefill, FLOPs by visible pairs"]
    log(f"measuring on {jax.device_count()} x {device.device_kind} ({device.platform})")

    launch_s = launch_overhead(sweep.launch_repeats)
    log(f"launch overhead {launch_s * 1e6:.1f} us")
    curves = {"matmul": matmul_points(shapes, sweep, dt, launch_s)}
    log("dense matmul done")
    curves["grouped"] = grouped_points(shapes, sweep, dt, launch_s, grouped_backend)
    log("grouped GEMM done")
    curves["attention"] = attention_points(shapes, sweep, dt, launch_s)
    log("attention done")
    bandwidth = device_bandwidth(sweep.bandwidth_bytes, sweep.repeats, launch_s)
    memory, memory_note = device_memory_bytes(device)
    notes += [memory_note] if memory_note else []
    best = max(rate for points in curves.values() for _, _, rate in points)
    proc = Processor(device.device_kind, memory, best, bandwidth, launch_s=launch_s,
                     **{name: curve_of(points) for name, points in curves.items()})

    fits, link_notes = _measure_links(sweep, log)
    notes += link_notes
    host, _ = host_processor(sweep)
    log("host done")
    if device.platform == "cpu" and jax.device_count() > 1:
        notes.append(f"{jax.device_count()} simulated CPU devices share the host's {os.cpu_count()} cores")
    profile = Profile(name=device_tag(device.device_kind), source="measured", device=proc, host=host,
                      gpus=jax.device_count(), h2d=fits["h2d"].link, d2d=fits["d2d"].link,
                      all_to_all=fits["all_to_all"].link, all_gather=fits["all_gather"].link,
                      reduce_scatter=fits["reduce_scatter"].link, network=fits["network"].link,
                      gpus_per_node=jax.local_device_count(), dtype_bytes=dt.itemsize,
                      notes="; ".join(n for n in notes if n))
    return Measurement(profile, fits, curves, time.perf_counter() - start)


def _measure_links(sweep: Sweep, log: Callable[[str], None]) -> tuple[dict[str, Fit], list[str]]:
    """The links' fits (one per Profile link field) and notes on what stands in for what could not be measured."""
    h2d, h2d_note = host_to_device(sweep.transfer_bytes, sweep.repeats)
    notes = [h2d_note] if h2d_note else []
    fits = {"h2d": h2d}
    d2d = device_to_device(sweep.transfer_bytes, sweep.repeats)
    if d2d is None:
        d2d = h2d
        notes.append("one device: d2d and the collectives are the h2d fit")
    fits["d2d"] = d2d
    log("transfers done")
    for kind in COLLECTIVES:
        fits[kind] = collective(kind, sweep.collective_bytes, sweep.repeats) or d2d
    log("collectives done")
    if jax.process_count() > 1:  # the collectives among all devices cross machines
        fits["network"] = fits["all_to_all"]
        notes.append(f"{jax.process_count()} processes: network is the all-to-all fit among all devices")
    else:
        fits["network"] = d2d
        notes.append("one process: network is the d2d fit")
    notes += [f"{name}: {fit.note}" for name, fit in fits.items() if fit.note and name != "network"]
    return fits, notes
