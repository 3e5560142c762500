"""`python -m launch.gpu_ceilings --out FILE`: the device's ceilings, against which every benchmark is read.

Three numbers, each the median of several timed runs after warm-up, on fresh random data (never zeros):
- a large bf16 matrix product's TFLOP/s (2·n³ per product);
- a large device-to-device stream's GB/s (y = x + 1 over uint32: bytes read plus bytes written);
- a pinned host -> device copy's GB/s (`jax.device_put` from a `pinned_host` array).

Each is measured through JAX (what moejax's programs can reach; JAX exposes no device events, so a run is timed
on the host clock around `block_until_ready`, with several products per program so the sync costs under 1%) and,
where torch sees a CUDA device, also through torch with CUDA events (the hardware's own ceiling: cuBLAS, a copy
kernel, cudaMemcpyAsync from pinned memory). `--small` shrinks every size for the CPU dry run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

SIZES = dict(full=dict(n=8192, batch=4, stream_mib=2048, h2d_mib=1024, repeats=10),
             small=dict(n=128, batch=2, stream_mib=8, h2d_mib=8, repeats=3))


def _host_seconds(fn: Callable[..., object], make_inputs: Callable[[], tuple], repeats: int) -> list[float]:
    """Seconds of each run of fn on inputs made fresh for it (not timed), after two warm-up runs."""
    for _ in range(2):
        jax.block_until_ready(fn(*make_inputs()))
    runs = []
    for _ in range(repeats):
        args = jax.block_until_ready(make_inputs())
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        runs.append(time.perf_counter() - t0)
    return runs


def _record(what: float, unit: str, runs: list[float], method: str, **extra: object) -> dict:
    median = statistics.median(runs)
    return dict(value=what / median, unit=unit, seconds_median=median, seconds=runs, method=method, **extra)


CEILINGS = ("matmul_bf16", "device_stream", "h2d_pinned")


def jax_ceilings(size: dict, only: tuple[str, ...] = CEILINGS) -> dict:
    """The ceilings named in `only` (all by default), through JAX."""
    device = jax.devices()[0]
    keys = iter(jax.random.split(jax.random.key(0), 10_000))
    n, b, reps = size["n"], size["batch"], size["repeats"]

    def matrices() -> tuple[jax.Array, jax.Array]:
        ka, kb = jax.random.split(next(keys))
        return (jax.random.normal(ka, (b, n, n), jnp.bfloat16), jax.random.normal(kb, (b, n, n), jnp.bfloat16))
    matmul = jax.jit(lambda a, c: jnp.einsum("bij,bjk->bik", a, c, preferred_element_type=jnp.float32
                                             ).astype(jnp.bfloat16))
    out: dict[str, dict] = {}
    if "matmul_bf16" in only:
        out["matmul_bf16"] = _record(2 * b * n ** 3 / 1e12, "TFLOP/s", _host_seconds(matmul, matrices, reps),
                                     "jax, host clock around block_until_ready", shape=[b, n, n])
    if "device_stream" in only:
        out["device_stream"] = _stream(size, keys)
    if "h2d_pinned" in only:
        out["h2d_pinned"] = _h2d(size, device)
    return out


def _stream(size: dict, keys: Iterator[jax.Array]) -> dict:
    words = (size["stream_mib"] << 20) // 4
    stream = jax.jit(lambda x: x + 1)
    return _record(
        2 * words * 4 / 1e9, "GB/s",
        _host_seconds(stream, lambda: (jax.random.bits(next(keys), (words,), jnp.uint32),), size["repeats"]),
        "jax, host clock around block_until_ready; y = x + 1, bytes read + written", bytes=words * 4)


def _h2d(size: dict, device: jax.Device) -> dict:
    rng = np.random.default_rng(0)
    host_kind = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    to_device = jax.sharding.SingleDeviceSharding(device, memory_kind="device")
    h2d_words = (size["h2d_mib"] << 20) // 4
    sources = [jax.device_put(rng.integers(0, 2 ** 32, h2d_words, dtype=np.uint32), host_kind) for _ in range(2)]
    turn = iter(range(10_000))
    return _record(
        h2d_words * 4 / 1e9, "GB/s",
        _host_seconds(lambda x: jax.device_put(x, to_device), lambda: (sources[next(turn) % 2],), size["repeats"]),
        "jax.device_put pinned_host -> device, host clock around block_until_ready", bytes=h2d_words * 4)


def measured(name: str, given: float | None = None) -> dict:
    """One ceiling for a benchmark's utilisation figure: `given` (a value the caller measured, e.g. by the GPU
    check's ceilings step) or measured now through JAX, at full size on a GPU and small elsewhere."""
    unit = "TFLOP/s" if name == "matmul_bf16" else "GB/s"
    if given is not None:
        return dict(value=given, unit=unit, method="given on the command line")
    size = SIZES["full" if jax.default_backend() == "gpu" else "small"]
    return dict(jax_ceilings(size, (name,))[name], sizes=size)


def torch_ceilings(size: dict) -> dict | str:
    """The same three through torch with CUDA events, or why not."""
    try:
        import torch  # optional: torch's own ceilings, beside JAX's
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    dev = torch.device("cuda")

    def timed(fn: Callable[..., object], make_inputs: Callable[[], tuple], reps: int) -> list[float]:
        for _ in range(2):
            fn(*make_inputs())
        runs = []
        for _ in range(reps):
            args = make_inputs()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(*args)
            end.record()
            end.synchronize()
            runs.append(start.elapsed_time(end) / 1e3)
        return runs
    n, reps = size["n"], size["repeats"]
    mats = lambda: (torch.randn(n, n, device=dev, dtype=torch.bfloat16),  # noqa: E731
                    torch.randn(n, n, device=dev, dtype=torch.bfloat16))
    out = dict(matmul_bf16=_record(2 * n ** 3 / 1e12, "TFLOP/s", timed(torch.matmul, mats, reps),
                                   "torch, CUDA events", shape=[n, n]))
    nbytes = size["stream_mib"] << 20
    dst = torch.empty(nbytes // 4, dtype=torch.int32, device=dev)
    src = lambda: (torch.randint(-2 ** 31, 2 ** 31 - 1, (nbytes // 4,), dtype=torch.int32, device=dev),)  # noqa: E731
    out["device_copy"] = _record(2 * nbytes / 1e9, "GB/s", timed(dst.copy_, src, reps),
                                 "torch copy_, CUDA events; bytes read + written", bytes=nbytes)
    hbytes = size["h2d_mib"] << 20
    pinned = [torch.randint(-2 ** 31, 2 ** 31 - 1, (hbytes // 4,), dtype=torch.int32).pin_memory() for _ in range(2)]
    hdst = torch.empty(hbytes // 4, dtype=torch.int32, device=dev)
    turn = iter(range(10_000))
    out["h2d_pinned"] = _record(hbytes / 1e9, "GB/s",
                                timed(lambda s: hdst.copy_(s, non_blocking=True), lambda: (pinned[next(turn) % 2],),
                                      reps), "torch copy_ from pinned memory, CUDA events", bytes=hbytes)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.gpu_ceilings", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--small", action="store_true", help="tiny sizes (the CPU dry run)")
    args = parser.parse_args(argv)
    size = SIZES["small" if args.small else "full"]
    record: dict[str, Any] = dict(sizes=size, jax=jax_ceilings(size), torch=torch_ceilings(size))  # JSON
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    for source in ("jax", "torch"):
        if isinstance(record[source], str):
            print(f"{source}: skipped ({record[source]})")
            continue
        for name, r in record[source].items():
            print(f"{source:5s} {name:12s} {r['value']:10.1f} {r['unit']:8s} (median of {len(r['seconds'])}, "
                  f"{r['method']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
