"""How much device memory one grouped-GEMM or expert-FFN call needs beyond its inputs, and how much is free, so that
`bench kernels` skips a backend that cannot fit ("skipped: needs N GiB") instead of crashing the run.

The estimates count the arrays a call must hold at once. `ragged_dot` is the one that grows past the device: on
JAX 0.10-0.11, XLA lowers `jax.lax.ragged_dot` to a dense masked product, each row broadcast to every group and
masked, [M, G, K] in the operand dtype before a [M, G*K] x [G*K, N] dot (the first H200 run: x bf16[262144, 2048]
and 128 groups asked for bf16[262144, 128, 2048], 128 GiB). The all-experts baselines (`reference`, `dense`) hold
every expert's product, [G, M, N] in float32."""
from __future__ import annotations

import jax

GiB = 1 << 30
FREE_FRACTION = 0.8  # of the free memory a call may plan for: XLA's autotuner and scratch buffers take the rest
F32 = 4


def grouped_matmul_bytes(backend: str, M: int, K: int, N: int, G: int, itemsize: int) -> int:
    """x [M, K] times w [G, K, N] -> [M, N]: the output, float32 accumulated, and what the backend adds."""
    out = M * N * (F32 + itemsize)
    if backend == "ragged_dot":
        return out + M * G * K * itemsize
    if backend == "reference":
        return out + G * M * N * F32
    return out


def expert_ffn_bytes(backend: str, N_tokens: int, top_k: int, D: int, I: int, G: int, itemsize: int) -> int:
    """x [T, D] routed to top_k of G experts, gate/up [G, D, 2I], down [G, I, D]: dispatched rows [M, D], the [M, 2I]
    float32 projection and its [M, I] activation, the [M, D] float32 output, and what the backend adds: the larger
    of the two projections' masked operands for ragged_dot (they are not live at once), every expert on every
    token for dense."""
    M = N_tokens * top_k
    rows = M * D * itemsize + M * 2 * I * F32 + M * I * itemsize + M * D * F32
    if backend == "ragged_dot":
        return rows + M * G * max(D, I) * itemsize
    if backend == "dense":
        return rows + G * N_tokens * (2 * I + D) * F32
    return rows


def free_bytes(device: jax.Device | None = None) -> int | None:
    """The device's free memory (bytes_limit - bytes_in_use), or None where it does not say (CPU)."""
    device = device or jax.devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:  # backends without memory statistics raise rather than return None
        return None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def too_large(needs: int, free: int | None) -> str | None:
    """Why a call that needs `needs` bytes is not run, or None when it fits (or nothing is known of the device)."""
    if free is None or needs <= FREE_FRACTION * free:
        return None
    return f"needs {_size(needs)}, {_size(free)} free"


def _size(n: int) -> str:
    return f"{n / GiB:.3g} GiB" if n >= GiB / 10 else f"{n / (1 << 20):.3g} MiB"
