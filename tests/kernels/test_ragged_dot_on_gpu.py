"""ragged_dot only where it fits: on JAX 0.10-0.11, XLA GPU runs jax.lax.ragged_dot as a dense masked product (the
first H200 run: 5.7 TFLOP/s at every size, 128 GiB asked for at 32K tokens). `bench kernels` skips a backend whose
working memory would not fit instead of crashing; no `auto` choice and no planner measurement reaches ragged_dot
on a GPU (checked here on CPU, with the platform test answering "gpu")."""
import importlib

import jax
import jax.numpy as jnp
import pytest

from launch.bench.kernel_memory import GiB, expert_ffn_bytes, grouped_matmul_bytes, too_large
from launch.bench.kernels import NOT_TIMED_ON_GPU, timed_backends
from moejax.kernels import EXPERT_BACKENDS, GROUPED_MATMUL_BACKENDS, expert_ffn, grouped_matmul, platform
from moejax.kernels.grouped_matmul import auto
from moejax.measure.hardware import grouped_backend_refused

QWEN3 = dict(K=2048, N=1536, G=128, itemsize=2)  # the gate/up projection of qwen3-30b-a3b's experts, bf16


def test_ragged_dot_at_32k_tokens_is_skipped_where_the_h200_ran_out_and_runs_at_8k():
    free = 100 * GiB  # about what the H200 had free under the benchmark's data
    at_32k = grouped_matmul_bytes("ragged_dot", 32768 * 8, **QWEN3)
    assert at_32k >= 128 * GiB  # XLA's bf16[262144, 128, 2048]
    assert too_large(at_32k, free).startswith("needs 130 GiB")
    assert too_large(grouped_matmul_bytes("pallas", 32768 * 8, **QWEN3), free) is None
    assert too_large(grouped_matmul_bytes("ragged_dot", 8192 * 8, **QWEN3), free) is None  # ran in the first run
    ffn = dict(top_k=8, D=2048, I=768, G=128, itemsize=2)
    assert too_large(expert_ffn_bytes("ragged_dot", 32768, **ffn), free) is not None
    assert too_large(expert_ffn_bytes("pallas", 32768, **ffn), free) is None
    assert too_large(at_32k, None) is None  # a device that reports nothing (CPU): every backend runs


def test_bench_kernels_times_every_compiled_backend_the_kernels_list():
    assert timed_backends(("pallas", "pallas_interpret", "mosaic", "xla", "ragged_dot", "reference", "next"),
                          gpu=True) == ["pallas", "mosaic", "ragged_dot", "next"]  # a new backend appears by itself
    for listed in (GROUPED_MATMUL_BACKENDS, EXPERT_BACKENDS):
        on_gpu = timed_backends(listed, gpu=True)
        assert "pallas" in on_gpu and not set(on_gpu) & set(NOT_TIMED_ON_GPU)
        assert "pallas" not in timed_backends(listed, gpu=False) and "xla" in timed_backends(listed, gpu=False)


class Resolved(Exception):
    pass


@pytest.mark.parametrize("pallas_missing", [False, True])
def test_auto_never_resolves_to_ragged_dot_on_a_gpu(monkeypatch, pallas_missing):
    for module in (platform, auto):  # resolve's module and expert_auto's
        monkeypatch.setattr(module, "on_gpu", lambda: True)
        monkeypatch.setattr(module, "pallas_unavailable", lambda: "no Triton here" if pallas_missing else None)
    picked = []
    for name in ("grouped_matmul", "expert_ffn"):  # the name each op resolves through: stop there, before running
        module = importlib.import_module(f"moejax.kernels.{name}")  # the package's attribute is the function
        real = module.resolve

        def resolve(*args, real=real, **kwargs):
            picked.append(real(*args, **kwargs))
            raise Resolved
        monkeypatch.setattr(module, "resolve", resolve)
    shape = jax.ShapeDtypeStruct
    for rows in (8, 8192, 262144):
        for groups in (8, 128):
            for dtype in (jnp.bfloat16, jnp.float32):
                with pytest.raises(Resolved):
                    jax.eval_shape(lambda x, w, s: grouped_matmul(x, w, s), shape((rows, 64), dtype),
                                   shape((groups, 64, 32), dtype), shape((groups,), jnp.int32))
                with pytest.raises(Resolved):
                    jax.eval_shape(lambda x, i, p, a, b: expert_ffn(x, i, p, a, b), shape((rows, 64), dtype),
                                   shape((rows, 2), jnp.int32), shape((rows, 2), jnp.float32),
                                   shape((groups, 64, 64), dtype), shape((groups, 32, 64), dtype))
    assert len(picked) == 24 and not {"ragged_dot", "ragged_dot_cudnn"} & set(picked), picked
    assert ("pallas" not in picked) == pallas_missing, picked  # the GPU's choices, not the CPU's (dense, xla)


def test_planner_measurements_refuse_ragged_dot_on_a_gpu():
    assert "dense masked product" in grouped_backend_refused("ragged_dot", "gpu")
    assert grouped_backend_refused("auto", "gpu") is None and grouped_backend_refused("pallas", "gpu") is None
    assert grouped_backend_refused("ragged_dot", "cpu") is None  # on CPU it is a baseline like any other
