"""Lower a jitted function for CUDA on any machine: Pallas kernels become Triton IR (or Mosaic GPU IR) inside a
custom call, which checks block shapes, loads, stores and dots against the lowering (compiling it needs a GPU). The
tests use it on CPU; `launch.gpu_env` uses it to catch the warnings JAX raises while lowering the kernels."""
from collections.abc import Callable

import jax
from jax import export

TRITON = "__gpu$xla.gpu.triton"
MOSAIC_GPU = "mosaic_gpu_v2"  # the custom call a Pallas Mosaic GPU kernel lowers to


def cuda_module(fn: Callable, *shapes: jax.ShapeDtypeStruct) -> str:
    """The StableHLO text of `fn` exported for CUDA; shapes are jax.ShapeDtypeStruct."""
    exp = export.export(jax.jit(fn), platforms=["cuda"],
                        disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON)])(*shapes)
    return exp.mlir_module()
