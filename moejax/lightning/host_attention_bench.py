"""A micro-benchmark of decode attention on the host (not a test): one step's attention for a batch against the bytes
of KV cache it reads, as GB/s (MoE-Lightning §6.2 compares its CPU attention with the KV transfer it replaces).
`measure` times the same jitted host stage as moejax.lightning.host_attention (store the new KV, then
AttentionCore.attend) over a contiguous cache; `measure_paged` times moejax.kernels.attention.paged_attention over a
block pool (continuous batching's decode); `python -m moejax.lightning.host_attention_bench` prints the paged table."""
from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from moejax.kernels.attention.paged import BACKENDS, paged_attention
from moejax.kernels.platform import resolve
from moejax.lightning.host_attention import HOST_BACKENDS, attend_on_host
from moejax.lightning.host_kv import host_device
from moejax.models.attention import AttentionCore


def measure(kind: str = "gqa", *, batch: int = 16, context: int = 1024, heads: int = 32, kv_heads: int = 8,
            head_dim: int = 128, rank: int = 512, rope_dim: int = 64, dtype: str = "float32", repeats: int = 5,
            backend: str = "xla", host: jax.Device | None = None) -> dict:
    """Median seconds of one decode step's attention for `batch` rows whose cache holds `context` tokens (every slot
    read), cache bytes / seconds, and beside it the GB/s of a plain sum over the same arrays (what a streaming read
    reaches on this host now). kind "gqa": heads, kv_heads, head_dim (Mixtral 8x7B's by default); "mla": heads
    over a latent of `rank` and a shared roped key of `rope_dim` (DeepSeek-V2/V3's). backend: as HostAttention's."""
    if backend not in HOST_BACKENDS:
        raise ValueError(f"measure: backend {backend!r} does not run on the host; use one of {HOST_BACKENDS}")
    if kind not in ("gqa", "mla") or min(batch, context, repeats) < 1:
        raise ValueError(f"measure: kind must be 'gqa' or 'mla' and batch, context, repeats >= 1; got {kind!r}, "
                         f"{batch}, {context}, {repeats}")
    host = host or host_device()
    arr = _random_arrays(host, dtype, np.random.default_rng(0))
    if kind == "gqa":
        cache = {"k": arr(batch, context, kv_heads, head_dim), "v": arr(batch, context, kv_heads, head_dim)}
        q, width = arr(batch, 1, heads, head_dim), head_dim
    else:
        cache = {"latent": arr(batch, context, rank), "k_rope": arr(batch, context, rope_dim)}
        q, width = arr(batch, 1, heads, rank + rope_dim), rank + rope_dim
    new = {name: arr(batch, 1, *a.shape[2:]) for name, a in cache.items()}
    positions = jax.device_put(jnp.full((batch, 1), context - 1, jnp.int32), host)
    core = AttentionCore(kind, 1.0 / width ** 0.5)
    nbytes = sum(a.nbytes for a in cache.values())
    attend = lambda c: attend_on_host(c, q, new, positions, core, backend=backend)  # noqa: E731
    seconds, cache = _median_seconds(attend, cache, repeats)
    read, _ = _median_seconds(lambda c: (read_all(c), c), cache, repeats)  # the host's streaming read, for scale
    return dict(kind=kind, backend=backend, batch=batch, context=context, dtype=dtype, device=str(host),
                cache_bytes=nbytes, seconds=seconds, gb_per_s=nbytes / seconds / 1e9, read_gb_per_s=nbytes / read / 1e9,
                jax=jax.__version__)


def _random_arrays(host: jax.Device, dtype: str, rng: np.random.Generator) -> Callable[..., jax.Array]:
    """arr(*shape): standard normal values from `rng`, as `dtype`, on `host`."""
    return lambda *shape: jax.device_put(jnp.asarray(rng.standard_normal(shape, np.float32), dtype), host)


def _median_seconds(step: Callable, cache: dict, repeats: int) -> tuple[float, dict]:
    """step(cache) -> (out, cache) (the cache may be donated), run once to compile, then `repeats` times -> (median
    seconds, the last cache)."""
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        out, cache = step(cache)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - start)
    return float(np.median(times[1:])), cache


@jax.jit
def read_all(cache: dict) -> list[jax.Array]:
    """A float32 sum of each array: a streaming read of all of them (what the host's memory reaches)."""
    return [jnp.sum(a, dtype=jnp.float32) for a in cache.values()]


PAGED_BACKENDS = ("xla", "reference", "cpu")  # the paged attention kernels that run on a CPU


def measure_paged(kind: str = "gqa", *, batch: int = 16, context: int = 1024, heads: int = 32, kv_heads: int = 8,
                  head_dim: int = 128, rank: int = 512, rope_dim: int = 64, dtype: str = "float32",
                  block_size: int = 16, repeats: int = 5, backend: str = "cpu", host: jax.Device | None = None) -> dict:
    """Median seconds of one decode step's paged attention (one query per row at position context - 1) for `batch`
    rows of `context` tokens, each row's blocks scattered through a pool of exactly their blocks; the pool's bytes
    / seconds, and beside it the GB/s of a plain sum over the same pools, timed alternately with the attention (the
    host's cores are shared: both see the same load). kind and shapes as `measure`'s; MLA's pools are the latent
    [N, P, 1, rank] (the value and the first key part) and the roped key [N, P, 1, rope_dim]."""
    if backend not in PAGED_BACKENDS:
        raise ValueError(f"measure_paged: backend {backend!r} does not run on the host; use one of {PAGED_BACKENDS}")
    if kind not in ("gqa", "mla") or min(batch, context, repeats, block_size) < 1:
        raise ValueError(f"measure_paged: kind must be 'gqa' or 'mla' and batch, context, block_size, repeats >= 1; "
                         f"got {kind!r}, {batch}, {context}, {block_size}, {repeats}")
    host = host or host_device()
    pools, q, table, offsets, width = _paged_inputs(kind, batch, context, heads, kv_heads, head_dim, rank, rope_dim,
                                                    dtype, block_size, host)
    attend = jax.jit(functools.partial(_paged_step, kind=kind, scale=1.0 / width ** 0.5, backend=backend))
    times = median_seconds_each([lambda: attend(pools, q, table, offsets), lambda: read_all(pools)], repeats)
    nbytes = sum(a.nbytes for a in pools.values())
    return dict(kind=kind, backend=backend, batch=batch, context=context, block_size=block_size, dtype=dtype,
                device=str(host), cache_bytes=nbytes, seconds=times[0], gb_per_s=nbytes / times[0] / 1e9,
                read_gb_per_s=nbytes / times[1] / 1e9, jax=jax.__version__)


def _paged_inputs(kind: str, batch: int, context: int, heads: int, kv_heads: int, head_dim: int, rank: int,
                  rope_dim: int, dtype: str, block_size: int, host: jax.Device
                  ) -> tuple[dict[str, jax.Array], jax.Array, jax.Array, jax.Array, int]:
    """On `host`: a block pool of exactly `batch` rows of `context` tokens (random values, each row's blocks scattered
    through it), one query per row, the block table, the query offsets (context - 1) -> (pools, q, table, offsets,
    the query's width)."""
    rng = np.random.default_rng(0)
    columns = -(-context // block_size)
    blocks = batch * columns
    arr = _random_arrays(host, dtype, rng)
    if kind == "gqa":
        pools = {"k": arr(blocks, block_size, kv_heads, head_dim), "v": arr(blocks, block_size, kv_heads, head_dim)}
        q, width = arr(batch, 1, heads, head_dim), head_dim
    else:
        pools = {"latent": arr(blocks, block_size, 1, rank), "k_rope": arr(blocks, block_size, 1, rope_dim)}
        q, width = arr(batch, 1, heads, rank + rope_dim), rank + rope_dim
    table = jax.device_put(jnp.asarray(rng.permutation(blocks).reshape(batch, columns), jnp.int32), host)
    offsets = jax.device_put(jnp.full((batch,), context - 1, jnp.int32), host)
    return pools, q, table, offsets, width


def measure_against_transfer(kind: str = "gqa", *, batch: int = 4, context: int = 1024, heads: int = 32,
                             kv_heads: int = 8, head_dim: int = 128, rank: int = 512, rope_dim: int = 64,
                             dtype: str = "bfloat16", block_size: int = 16, repeats: int = 5,
                             host_backend: str = "cpu", device_backend: str = "auto",
                             host: jax.Device | None = None, device: jax.Device | None = None) -> dict:
    """MoE-Lightning Fig. 9 at one context length: one decode step's attention for `batch` rows whose KV block pool
    is in host memory, (a) on the host, as CGOPipe runs it (the query copied there, paged attention with
    `host_backend`, the output copied back), against (b) the pool copied to the device and attention there with
    `device_backend` (what a schedule that keeps attention on the device pays each step for KV it cannot hold).
    Median seconds of (a), of (b) and of (b)'s copy alone, timed alternately; the pool's bytes, GB/s of each, and the
    attention's FLOPs (2 per multiply-add: q.k over `context` keys and p.v). device: default the accelerator
    (jax.devices()[0]); on a CPU with one device it is the host itself and the copy moves nothing
    (`copy_crosses_devices` False)."""
    if host_backend not in PAGED_BACKENDS:
        raise ValueError(f"measure_against_transfer: host_backend {host_backend!r} does not run on the host; use one "
                         f"of {PAGED_BACKENDS}")
    if kind not in ("gqa", "mla") or min(batch, context, repeats, block_size) < 1:
        raise ValueError(f"measure_against_transfer: kind must be 'gqa' or 'mla' and batch, context, block_size, "
                         f"repeats >= 1; got {kind!r}, {batch}, {context}, {block_size}, {repeats}")
    host, device = host or host_device(), device or jax.devices()[0]
    pools, q, table, offsets, width = _paged_inputs(kind, batch, context, heads, kv_heads, head_dim, rank, rope_dim,
                                                    dtype, block_size, host)
    step = functools.partial(_paged_step, kind=kind, scale=1.0 / width ** 0.5)
    on_host = jax.jit(functools.partial(step, backend=host_backend))
    on_device = jax.jit(functools.partial(step, backend=device_backend))
    q_device, table_device, offsets_device = jax.device_put((q, table, offsets), device)

    def host_attention() -> jax.Array:
        return jax.device_put(on_host(pools, jax.device_put(q_device, host), table, offsets), device)

    def move_and_attend() -> jax.Array:
        return on_device(jax.device_put(pools, device), q_device, table_device, offsets_device)

    def copy() -> dict[str, jax.Array]:
        return jax.device_put(pools, device)

    host_s, move_s, copy_s = median_seconds_each([host_attention, move_and_attend, copy], repeats)
    nbytes = sum(a.nbytes for a in pools.values())
    value_width = head_dim if kind == "gqa" else rank
    flops = 2 * batch * heads * context * (width + value_width)
    return dict(kind=kind, batch=batch, context=context, block_size=block_size, dtype=dtype, heads=heads,
                kv_heads=kv_heads, head_dim=head_dim, host=str(host), device=str(device),
                copy_crosses_devices=host != device, host_backend=host_backend,
                device_backend=resolve("paged attention", device_backend, BACKENDS),
                kv_bytes=nbytes, flops=flops, host_s=host_s, move_s=move_s, copy_s=copy_s,
                device_attention_s=max(move_s - copy_s, 0.0), host_gb_per_s=nbytes / host_s / 1e9,
                copy_gb_per_s=nbytes / copy_s / 1e9, move_over_host=move_s / host_s)


def _paged_step(pools: dict[str, jax.Array], q: jax.Array, table: jax.Array, offsets: jax.Array, *, kind: str,
                scale: float, backend: str) -> jax.Array:
    parts: tuple[jax.Array, ...]
    if kind == "mla":
        parts, v = (pools["latent"], pools["k_rope"]), pools["latent"]
    else:
        parts, v = (pools["k"],), pools["v"]
    return paged_attention(q, parts, v, table, offsets, scale=scale, backend=backend)


def median_seconds_each(calls: Sequence[Callable[[], object]], repeats: int) -> list[float]:
    """Each call once to compile, then `repeats` rounds of all of them in turn -> each one's median seconds."""
    for call in calls:
        jax.block_until_ready(call())
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(repeats):
        for call, seen in zip(calls, times, strict=True):
            start = time.perf_counter()
            jax.block_until_ready(call())
            seen.append(time.perf_counter() - start)
    return [float(np.median(t)) for t in times]


def main(argv: Sequence[str] | None = None) -> None:
    """The paged table: GB/s of each backend and of the streaming read, per kind, dtype and context."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--kinds", default="gqa,mla")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--contexts", default="256,1024,2048")
    ap.add_argument("--backends", default=",".join(PAGED_BACKENDS))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    backends = args.backends.split(",")
    print(f"batch {args.batch}, median of {args.repeats}, GB/s of pool bytes (read: a plain sum over the pools, timed "
          f"alternately with each backend; its median over the backends' runs); jax {jax.__version__}, "
          f"{host_device()}")
    print("| kind | dtype | context | MB | " + " | ".join(backends) + " | read |")
    print("|---" * (5 + len(backends)) + "|")
    for kind in args.kinds.split(","):
        for dtype in args.dtypes.split(","):
            for context in map(int, args.contexts.split(",")):
                rows = [measure_paged(kind, batch=args.batch, context=context, dtype=dtype, repeats=args.repeats,
                                      backend=b) for b in backends]
                read = float(np.median([r["read_gb_per_s"] for r in rows]))
                print(f"| {kind} | {dtype} | {context} | {rows[0]['cache_bytes'] / 1e6:.0f} | "
                      + " | ".join(f"{r['gb_per_s']:.2f}" for r in rows) + f" | {read:.1f} |", flush=True)


if __name__ == "__main__":
    main()
