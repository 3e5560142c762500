"""The kernel choices of a model (`Kernels`: a backend per op) and what `auto` means on each platform. The platform
checks live in moejax.kernels.platform and the experts' `auto` in moejax.kernels.grouped_matmul.auto, which the op
packages import; this module imports the op packages, never the other way."""
from __future__ import annotations

import dataclasses

import jax

from moejax.kernels.attention import BACKENDS as ATTENTION
from moejax.kernels.expert_ffn import BACKENDS as EXPERTS
from moejax.kernels.grouped_matmul import ragged_cudnn, tuning
from moejax.kernels.grouped_matmul.auto import CPU_DENSE_MAX_RATIO, CPU_DENSE_MAX_TOKENS
from moejax.kernels.grouped_matmul.mosaic_plan import mosaic_unavailable
from moejax.kernels.platform import GPU_ONLY, on_gpu, pallas_unavailable


@dataclasses.dataclass(frozen=True)
class Kernels:
    """Which backend each op of the model uses; hashable, so jit can take it as a static argument."""
    experts: str = "auto"
    attention: str = "auto"
    # batch-invariant steps (moejax.kernels.invariant): load's batch_invariant; out of the repr, so records of runs
    # without it read as before
    invariant: bool = dataclasses.field(default=False, repr=False)

    def unavailable(self) -> str | None:
        """Why a backend asked for by name cannot run on this platform (before anything loads), or None."""
        if self.invariant:
            return invariant_unavailable(self)
        pallas = [f"{op}={name}" for op, name in self.ops().items() if name.startswith("pallas")]
        why = pallas_unavailable() if pallas else None
        if why:
            return f"{', '.join(pallas)} needs Pallas's Triton backend, but {why}; use auto or xla"
        why = mosaic_unavailable() if self.experts == "mosaic" else None
        if why:
            return f"experts=mosaic needs Pallas's Mosaic GPU backend, but {why}; use auto, pallas or xla"
        why = ragged_cudnn.unavailable() if self.experts == "ragged_dot_cudnn" else None
        if why:
            return f"experts=ragged_dot_cudnn: {why}"
        if on_gpu():
            return None
        wrong = [f"{op}={name}" for op, name in self.ops().items() if name in GPU_ONLY]
        if not wrong:
            return None
        return (f"{', '.join(wrong)} needs an NVIDIA GPU and JAX runs on {jax.default_backend()} here; use auto, "
                "xla (or pallas_interpret to run the Pallas kernels interpreted)")

    def ops(self) -> dict[str, str]:
        """{op: backend}."""
        return {"experts": self.experts, "attention": self.attention}

    def describe(self) -> str:
        """These choices and what `auto` resolves by, for records of what decided a run's results: on a CPU the
        experts' auto is the XLA path; on a GPU it follows the tuning table, named by the run it came from."""
        if self.invariant:
            return f"{self}; batch_invariant: fixed row tiles and key blocks (moejax.kernels.invariant)"
        if self.experts != "auto":
            return str(self)
        if not on_gpu():
            return (f"{self}; experts auto: xla on {jax.default_backend()}, dense for at most "
                    f"{CPU_DENSE_MAX_TOKENS} tokens and {CPU_DENSE_MAX_RATIO} x top-k experts")
        source = tuning.device_entry().get("source", {})
        return f"{self}; experts auto: tuning table {source.get('commit') or 'none (pallas)'}"

    @classmethod
    def parse(cls, spec: str | dict | Kernels | None) -> Kernels:
        """None/"auto"; one backend name for every op ("xla", "pallas", "pallas_interpret"); or per op as a dict or
        "experts=ragged_dot,attention=xla". Names are checked against each op's backends."""
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


AUTO_KERNELS = Kernels()  # every op `auto`: the default of what takes kernels (frozen, so one instance serves)


def invariant_unavailable(kernels: Kernels) -> str | None:
    """Why batch_invariant cannot run with these kernel choices, or None: its own fixed-tile XLA kernels replace
    the experts' and attention's backends, so it takes only auto or xla (a Pallas tile, a cuDNN call or the GPU
    tuning table would choose by shape)."""
    named = [f"{op}={name}" for op, name in kernels.ops().items() if name not in ("auto", "xla")]
    if named:
        return (f"{', '.join(named)} with batch_invariant: the mode runs its own fixed-tile kernels; use auto or "
                "xla")
    return None
