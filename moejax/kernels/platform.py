"""What a platform can run: GPU or not, whether this JAX runs moejax's Pallas kernels, and what `auto` resolves to
for an op. The op packages import this module and nothing above them (moejax.kernels.backends imports them)."""
from __future__ import annotations

import importlib

import jax
from jax._src import deprecations

TRITON_DEPRECATION_ID = "jax-pallas-triton"  # JAX 0.11 warns under this id at every Triton lowering


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def pallas_unavailable() -> str | None:
    """Why this JAX cannot run moejax's Pallas kernels, which use Pallas's Triton lowering, or None. JAX 0.11
    deprecates that lowering (a DeprecationWarning at every lowering); a JAX that removes it, or turns the
    deprecation into an error, must still import moejax and run the "auto" kernels (on XLA)."""
    try:
        importlib.import_module("jax.experimental.pallas.triton")
    except ImportError as e:
        return f"this JAX ({jax.__version__}) has no Pallas Triton backend ({e})"
    try:
        accelerated = deprecations.is_accelerated(TRITON_DEPRECATION_ID)
    except (ValueError, AttributeError):  # not registered: a JAX from before the deprecation
        accelerated = False
    if accelerated:
        return f"this JAX ({jax.__version__}) turns the Pallas Triton deprecation into an error"
    return None


def resolve(op: str, backend: str, choices: tuple[str, ...], auto: str | None = None) -> str:
    """`auto` -> `auto` argument, else "pallas" on GPU (XLA where this JAX cannot run Pallas kernels) and "xla"
    elsewhere; unknown names are a ValueError."""
    if backend == "auto":
        return auto or ("pallas" if on_gpu() and pallas_unavailable() is None else "xla")
    if backend not in choices:
        raise ValueError(f"{op}: backend {backend!r} is not one of auto, {', '.join(choices)}")
    return backend


GPU_ONLY = ("pallas", "cudnn", "mosaic")  # compiled for NVIDIA GPUs; pallas_interpret runs the Pallas kernels anywhere


# Shared memory per thread block, bytes, by compute capability (CUDA's limits): H100/H200, A100; the rest (sm_86,
# sm_89) 99 KiB.
SHARED_MEMORY = {(9, 0): 232448, (8, 0): 166912}
SHARED_MEMORY_OTHER = 101376


def shared_memory_bytes() -> int:
    """What one thread block may use: Hopper's 227 KiB; off a GPU (interpreted kernels), Hopper's too."""
    dev = jax.devices()[0]
    if dev.platform != "gpu":
        return SHARED_MEMORY[(9, 0)]
    major, minor = (int(v) for v in str(getattr(dev, "compute_capability", "9.0")).split(".")[:2])
    return SHARED_MEMORY.get((major, minor), SHARED_MEMORY_OTHER)
