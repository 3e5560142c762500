"""Backend names shared by the kernels, and what `auto` means on each platform."""
from __future__ import annotations

import dataclasses
import importlib

import jax


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
    from jax._src import deprecations
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


# On a CPU, the expert FFN of a batch of at most this many tokens runs dense (every token through every expert)
# where experts are at most CPU_DENSE_MAX_RATIO x top-k: its run time is the weights' read either way, and it
# compiles in half the time of the XLA path's capacity tiers (2026-11-26, a decode step program of 8 tokens,
# float32; dense against xla: micro-qwen3-moe (8 experts, top-2) at 16 rows 0.97 against 0.84 ms a token-step,
# compile 1.2 against 2.1 s; pycode-moe (16, top-2) at 16 rows 10.9 against 14.4 ms, at 32 rows 26.4 against
# 26.1 ms, compile 1.4-2.0 against 2.7-4.0 s; at 64 rows dense ran 5-10% slower).
CPU_DENSE_MAX_TOKENS, CPU_DENSE_MAX_RATIO = 32, 8


def expert_auto(rows: int, groups: int, dtype, fused: bool, top_k: int | None = None) -> str:
    """`auto` for the grouped expert products on this platform and shape (rows: tokens x top_k where top_k is
    given): on a CPU the XLA path, or dense for a few tokens (CPU_DENSE_MAX_TOKENS); on a GPU, the backend the
    last GPU run measured fastest for the shape class (grouped_matmul/tuning.json), else Pallas; Mosaic GPU only
    for 16-bit operands (it would run float32 as TF32); never ragged_dot (XLA GPU runs it as a dense masked
    product)."""
    if not on_gpu():
        few = top_k is not None and rows <= CPU_DENSE_MAX_TOKENS * top_k and groups <= CPU_DENSE_MAX_RATIO * top_k
        return "dense" if few else "xla"
    if pallas_unavailable() is not None:
        return "mosaic" if _mosaic_usable(dtype) else "xla"
    from moejax.kernels.grouped_matmul import tuning
    fastest = tuning.fastest_backend(rows, groups, fused)
    if fastest == "mosaic" and _mosaic_usable(dtype):
        return "mosaic"
    return "pallas"


def _mosaic_usable(dtype) -> bool:
    from moejax.kernels.grouped_matmul.mosaic import mosaic_unavailable
    import jax.numpy as jnp
    return mosaic_unavailable() is None and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)


@dataclasses.dataclass(frozen=True)
class Kernels:
    """Which backend each op of the model uses; hashable, so jit can take it as a static argument."""
    experts: str = "auto"
    attention: str = "auto"

    def unavailable(self) -> str | None:
        """Why a backend asked for by name cannot run on this platform (before anything loads), or None."""
        pallas = [f"{op}={name}" for op, name in dataclasses.asdict(self).items() if name.startswith("pallas")]
        why = pallas_unavailable() if pallas else None
        if why:
            return f"{', '.join(pallas)} needs Pallas's Triton backend, but {why}; use auto or xla"
        from moejax.kernels.grouped_matmul.mosaic import mosaic_unavailable
        why = mosaic_unavailable() if self.experts == "mosaic" else None
        if why:
            return f"experts=mosaic needs Pallas's Mosaic GPU backend, but {why}; use auto, pallas or xla"
        if on_gpu():
            return None
        wrong = [f"{op}={name}" for op, name in dataclasses.asdict(self).items() if name in GPU_ONLY]
        if not wrong:
            return None
        return (f"{', '.join(wrong)} needs an NVIDIA GPU and JAX runs on {jax.default_backend()} here; use auto, "
                "xla (or pallas_interpret to run the Pallas kernels interpreted)")

    def describe(self) -> str:
        """These choices and what `auto` resolves by, for records of what decided a run's results: on a CPU the
        experts' auto is the XLA path; on a GPU it follows the tuning table, named by the run it came from."""
        if self.experts != "auto":
            return str(self)
        if not on_gpu():
            return (f"{self}; experts auto: xla on {jax.default_backend()}, dense for at most "
                    f"{CPU_DENSE_MAX_TOKENS} tokens and {CPU_DENSE_MAX_RATIO} x top-k experts")
        from moejax.kernels.grouped_matmul import tuning
        source = tuning.device_entry().get("source", {})
        return f"{self}; experts auto: tuning table {source.get('commit') or 'none (pallas)'}"

    @classmethod
    def parse(cls, spec: "str | dict | Kernels | None") -> "Kernels":
        """None/"auto"; one backend name for every op ("xla", "pallas", "pallas_interpret"); or per op as a dict or
        "experts=ragged_dot,attention=xla". Names are checked against each op's backends."""
        from moejax.kernels.attention import BACKENDS as ATTENTION
        from moejax.kernels.expert_ffn import BACKENDS as EXPERTS
        if isinstance(spec, Kernels):
            return spec
        if spec is None:
            spec = "auto"
        if isinstance(spec, str):
            if "=" in spec:
                pairs = [part.split("=", 1) for part in spec.split(",") if part.strip()]
                spec = {k.strip(): v.strip() for k, v in pairs}
            else:
                spec = {"experts": spec, "attention": spec}
        if not isinstance(spec, dict):
            raise ValueError(f"kernels: expected a backend name, 'op=backend,...' or a dict, got {spec!r}")
        unknown = sorted(set(spec) - {"experts", "attention"})
        if unknown:
            raise ValueError(f"kernels: unknown op(s) {unknown}; ops are experts, attention")
        for op, choices in (("experts", EXPERTS), ("attention", ATTENTION)):
            name = spec.get(op, "auto")
            if name != "auto" and name not in choices:
                raise ValueError(f"kernels: {op} backend {name!r} is not one of auto, {', '.join(choices)}")
        return cls(**spec)
