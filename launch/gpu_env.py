"""`python -m launch.gpu_env --out FILE`: what a GPU check runs on, and what JAX says while lowering the kernels.

Records the device (JAX's view, and nvidia-smi's name, driver and memory where nvidia-smi exists), the versions
of python, jax, jaxlib and its CUDA plugin, flax and the other packages moejax needs, whether this JAX can run
the Pallas kernels (`moejax.kernels.platform.pallas_unavailable`), and lowers each Pallas kernel for CUDA with
every warning recorded: JAX 0.11 deprecates the Triton lowering they use and says so at each lowering, and any
other deprecation the kernels trip shows up here first. Lowering for CUDA needs no GPU, so the dry run on CPU
checks the same thing.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import subprocess
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from moejax.kernels import expert_ffn, grouped_matmul
from moejax.kernels.attention import attention
from moejax.kernels.lowering import TRITON, cuda_module
from moejax.kernels.platform import pallas_unavailable

PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "flax", "optax", "orbax-checkpoint", "numpy",
            "ml_dtypes", "safetensors", "tokenizers", "jinja2", "tqdm", "pytest", "hypothesis", "torch", "transformers",
            "triton")
WARNING_KINDS = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)


def versions() -> dict[str, str]:
    out = dict(python=platform.python_version())
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def nvidia_smi() -> list | dict | None:
    """One dict per GPU; {"error": ...} when nvidia-smi fails; None where there is no nvidia-smi."""
    query = "name,driver_version,memory.total,clocks.max.sm,clocks.max.mem,power.limit,compute_cap"
    try:
        run = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if run.returncode != 0:
        return dict(error=run.stderr.strip()[-500:])
    return [dict(zip(query.split(","), (v.strip() for v in line.split(",")), strict=True))
            for line in run.stdout.splitlines()]


def _kernel_cases() -> dict[str, tuple[Callable[..., object], tuple[jax.ShapeDtypeStruct, ...]]]:
    """One call of each Pallas kernel family at a real model's shape (Qwen3-30B-A3B experts, GQA attention,
    GPT-OSS sinks + sliding window, DeepSeek's absorbed MLA decode), bf16."""
    S, bf, i32, f32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32, jnp.float32
    T, D, I, E, k = 512, 2048, 768, 128, 8

    def attn(B: int, T: int, S_: int, Hq: int, Hkv: int, D: int, Dv: int, **kw: Any
             ) -> tuple[Callable[..., object], tuple[jax.ShapeDtypeStruct, ...]]:
        sinks = jnp.zeros(Hq, f32) if kw.pop("sinks", False) else None
        fn = lambda q, kk, v, off, n: attention(q, kk, v, q_offset=off, kv_lengths=n, sinks=sinks,  # noqa: E731
                                                backend="pallas", **kw)
        return fn, (S((B, T, Hq, D), bf), S((B, S_, Hkv, D), bf), S((B, S_, Hkv, Dv), bf), S((B,), i32),
                    S((B,), i32))
    return {
        "grouped_matmul": (lambda x, w, g: grouped_matmul(x, w, g, backend="pallas"),
                           (S((T * k, D), bf), S((E, D, 2 * I), bf), S((E,), i32))),
        "expert_ffn": (lambda x, i, w, a, b: expert_ffn(x, i, w, a, b, backend="pallas"),
                       (S((T, D), bf), S((T, k), i32), S((T, k), f32), S((E, D, 2 * I), bf), S((E, I, D), bf))),
        "attention_prefill": attn(2, 256, 256, 32, 4, 128, 128, return_lse=True),
        "attention_decode_sinks_window": attn(8, 1, 1024, 64, 8, 64, 64, sinks=True, sliding_window=128),
        "attention_mla_absorbed_decode": attn(4, 1, 512, 16, 1, 576, 512),
    }


def kernel_lowering() -> dict:
    """Lower each kernel for CUDA; count its Triton calls and collect every warning raised meanwhile."""
    lowered: dict[str, int] = {}
    errors: dict[str, str] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name, (fn, shapes) in _kernel_cases().items():
            try:
                lowered[name] = cuda_module(fn, *shapes).count(TRITON)
            except Exception as e:  # one kernel failing to lower must not hide the others
                errors[name] = f"{type(e).__name__}: {e}"[:2000]
    seen: set[tuple[str, str]] = set()
    found: list[dict] = []
    for w in caught:
        key = (w.category.__name__, str(w.message))
        if key not in seen:
            seen.add(key)
            found.append(dict(category=key[0], message=key[1], source=f"{w.filename}:{w.lineno}",
                              deprecation=issubclass(w.category, WARNING_KINDS)))
    return dict(triton_calls=lowered, errors=errors, warnings=found)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.gpu_env", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    args = parser.parse_args(argv)
    devices = jax.devices()
    record: dict[str, Any] = dict(  # the JSON record
        device=dict(kind=devices[0].device_kind, platform=devices[0].platform, count=len(devices),
                    compute_capability=getattr(devices[0], "compute_capability", None),
                    memory=(devices[0].memory_stats() or {}).get("bytes_limit") if devices[0].platform == "gpu"
                    else None),
        backend=jax.default_backend(), nvidia_smi=nvidia_smi(), versions=versions(),
        pallas_unavailable=pallas_unavailable(), lowering=kernel_lowering())
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    low = record["lowering"]
    print(f"device {record['device']['kind']} ({record['backend']}), jax {record['versions'].get('jax')}, "
          f"jaxlib {record['versions'].get('jaxlib')}; Pallas: {record['pallas_unavailable'] or 'available'}")
    for name, calls in low["triton_calls"].items():
        print(f"  {name}: lowered for CUDA, {calls} Triton call(s)")
    for name, err in low["errors"].items():
        print(f"  {name}: FAILED to lower: {err}")
    for w in low["warnings"]:
        print(f"  warning while lowering: {w['category']}: {w['message']}")
    return 1 if low["errors"] or any(v == 0 for v in low["triton_calls"].values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
