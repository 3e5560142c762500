"""Settings XLA reads once, when JAX starts its backend: they must be in the environment before the first
`jax.devices()` or computation, so each command that offers them applies them right after parsing its flags.

--command-buffers  XLA:GPU runs a program's thunks as CUDA graphs, loops and conditionals included (WHILE,
                   CONDITIONAL): on an H200 a decode call holding a loop then returned before the device finished
                   (bench/README.md, fifth check), where without them any loop made the call wait
--mem-fraction     the share of GPU memory JAX preallocates (75% by default: weights and KV of a large batch need
                   more). XLA_CLIENT_MEM_FRACTION, the name jaxlib 0.10-0.11 reads (XLA_PYTHON_CLIENT_MEM_FRACTION
                   is its deprecated alias; both set is jaxlib's error)
--tfrt-gpu-client  XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT=1: the CUDA plugin's TFRT GPU client instead of the
                   stream-executor one (an option jaxlib 0.10-0.11 passes to the plugin)

Off a GPU the flags are accepted and change nothing."""
from __future__ import annotations

import argparse
import os

from jax._src import xla_bridge

COMMAND_BUFFERS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE"
COMMAND_BUFFER_FLAG = "--xla_gpu_enable_command_buffer"
MEM_FRACTION = "XLA_CLIENT_MEM_FRACTION"
DEPRECATED_MEM_FRACTION = "XLA_PYTHON_CLIENT_MEM_FRACTION"
TFRT_GPU_CLIENT = "XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT"


def add_arguments(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument("--command-buffers", action="store_true",
                   help=f"XLA:GPU command buffers with loops and conditionals ({COMMAND_BUFFER_FLAG}="
                        f"{COMMAND_BUFFERS}), set before JAX starts")
    p.add_argument("--mem-fraction", type=float, default=None,
                   help=f"share of GPU memory JAX preallocates ({MEM_FRACTION}; JAX's default 0.75), set before "
                        "JAX starts")
    p.add_argument("--tfrt-gpu-client", action="store_true",
                   help=f"the CUDA plugin's TFRT GPU client ({TFRT_GPU_CLIENT}=1), set before JAX starts")


def environment(command_buffers: bool = False, mem_fraction: float | None = None, tfrt_gpu_client: bool = False,
                base: dict | None = None) -> dict:
    """The variables to set on top of `base` (default os.environ) for these settings: {name: value}."""
    base = dict(os.environ) if base is None else base
    out = {}
    if command_buffers:
        kept = [f for f in base.get("XLA_FLAGS", "").split() if not f.startswith(COMMAND_BUFFER_FLAG + "=")]
        out["XLA_FLAGS"] = " ".join(kept + [f"{COMMAND_BUFFER_FLAG}={COMMAND_BUFFERS}"])
    if mem_fraction is not None:
        if not 0 < mem_fraction <= 1:
            raise SystemExit(f"--mem-fraction must be in (0, 1]; got {mem_fraction}")
        if base.get(DEPRECATED_MEM_FRACTION):
            raise SystemExit(f"--mem-fraction sets {MEM_FRACTION}, and {DEPRECATED_MEM_FRACTION} is set too (jaxlib "
                             "refuses both): unset it")
        out[MEM_FRACTION] = f"{mem_fraction:g}"
    if tfrt_gpu_client:
        out[TFRT_GPU_CLIENT] = "1"
    return out


def apply(args: argparse.Namespace) -> dict:
    """Set the parsed flags' variables (add_arguments) in os.environ before JAX's backend starts; -> what the
    record keeps: the settings and the variables as the backend reads them. SystemExit once the backend has
    started (a setting would silently not apply)."""
    wanted = environment(getattr(args, "command_buffers", False), getattr(args, "mem_fraction", None),
                         getattr(args, "tfrt_gpu_client", False))
    if wanted:
        if xla_bridge.backends_are_initialized():
            raise SystemExit(f"{', '.join(wanted)}: JAX's backend has started already; these must be set before")
        os.environ.update(wanted)
    names = ("XLA_FLAGS", MEM_FRACTION, DEPRECATED_MEM_FRACTION, TFRT_GPU_CLIENT)
    return dict(command_buffers=bool(getattr(args, "command_buffers", False)),
                mem_fraction=getattr(args, "mem_fraction", None),
                tfrt_gpu_client=bool(getattr(args, "tfrt_gpu_client", False)),
                variables={n: os.environ[n] for n in names if os.environ.get(n)})
