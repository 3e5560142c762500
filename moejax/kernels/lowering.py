"""Lower a jitted function for CUDA on any machine: Pallas kernels become Triton IR inside a custom call, which
checks block shapes, loads, stores and dots against the Triton lowering (compiling that IR needs a GPU). The
tests use it on CPU; `launch.gpu_env` uses it to catch the warnings JAX raises while lowering the kernels."""
import jax
from jax import export

TRITON = "__gpu$xla.gpu.triton"


def cuda_module(fn, *shapes) -> str:
    """The StableHLO text of `fn` exported for CUDA; shapes are jax.ShapeDtypeStruct."""
    exp = export.export(jax.jit(fn), platforms=["cuda"],
                        disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON)])(*shapes)
    return exp.mlir_module()
