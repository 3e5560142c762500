"""A micro-benchmark of decode attention on the host (not a test): one step's attention for a batch against the bytes
of KV cache it reads, as GB/s (MoE-Lightning §6.2 compares its CPU attention with the KV transfer it replaces). It
times the same jitted host stage as moejax.lightning.host_attention (store the new KV, then AttentionCore.attend)."""
from __future__ import annotations

import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

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
    rng = np.random.default_rng(0)

    def arr(*shape: int) -> jax.Array:
        return jax.device_put(jnp.asarray(rng.standard_normal(shape, np.float32), dtype), host)

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
    read, _ = _median_seconds(lambda c: (_read_all(c), c), cache, repeats)  # the host's streaming read, for scale
    return dict(kind=kind, backend=backend, batch=batch, context=context, dtype=dtype, device=str(host),
                cache_bytes=nbytes, seconds=seconds, gb_per_s=nbytes / seconds / 1e9, read_gb_per_s=nbytes / read / 1e9,
                jax=jax.__version__)


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
def _read_all(cache: dict) -> list[jax.Array]:
    return [jnp.sum(a, dtype=jnp.float32) for a in cache.values()]
