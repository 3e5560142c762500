"""Shared by the benchmarks: timing with CPU-contention accounting, and the record of device, versions and command."""
from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import flax
import jax
import jaxlib
import numpy as np

import moejax
from launch.bench.provenance import git_commit
from moejax.engine import Engine


def cpu_seconds() -> tuple[float, float]:
    """(CPU seconds used by every process on this machine, by this process); (0, 0) off Linux."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:8]]
    except OSError:
        return 0.0, 0.0
    own = os.times()
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK"), own.user + own.system


def time_calls(fn: Callable[[], object], repeats: int) -> tuple[float, list[float], float]:
    """(first call incl. compilation, [seconds of each timed run], share of the CPUs other processes
    used during the timed runs -- a benchmark sharing its cores reads slow)."""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    runs: list[float] = []
    (all0, own0), start = cpu_seconds(), time.perf_counter()
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    (all1, own1), wall = cpu_seconds(), time.perf_counter() - start
    return first, runs, max(0.0, (all1 - all0) - (own1 - own0)) / (wall * (os.cpu_count() or 1))


def decode_tpot(engine: Engine, prompts: list[list[int]], n: int) -> float:
    """Seconds per decode step, greedy: (s of generate(prompts, 1 + n) - s of generate(prompts, 1 + n // 2)) /
    (n - n // 2), so the prefill and the first token cancel out."""
    times = []
    for length in (1 + n // 2, 1 + n):
        t0 = time.perf_counter()
        engine.generate(prompts, length, temperature=0.0)
        times.append(time.perf_counter() - t0)
    return (times[1] - times[0]) / (n - n // 2)


def timed_call(engine: Engine, call: str, ids: np.ndarray) -> Callable[[], object]:
    """The call a benchmark times: "logits" (every position's logits back on the host) or a one-token generation
    (a prefill that returns one token per row)."""
    if call == "logits":
        return lambda: engine.logits(ids)
    rows = ids.tolist()
    return lambda: engine.generate(rows, 1)


def environment() -> dict:
    dev = jax.devices()[0]
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
    versions = dict(python=platform.python_version(), jax=jax.__version__, jaxlib=jaxlib.__version__,
                    flax=flax.__version__, numpy=np.__version__, moejax=moejax.__version__)
    for name in ("torch", "transformers"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            pass
    commit, _ = git_commit()
    try:
        dirty = subprocess.run(["git", "status", "--porcelain", "moejax"], capture_output=True,
                               text=True).stdout.split("\n")
    except OSError:
        dirty = []
    return dict(device=dict(kind=dev.device_kind, platform=dev.platform, count=jax.device_count(),
                            cpu=cpu, cpu_count=os.cpu_count()),
                versions=versions, git=dict(commit=commit, moejax_changes=[d for d in dirty if d]),
                command=shlex.join(["python", "-m", "launch.bench", *sys.argv[1:]]))  # no path of this machine


def hf_checkpoint(hf_config: dict, directory: str, seed: int) -> Any:  # a transformers model
    """Build a transformers model from an HF config dict, init it from `seed`, save it to `directory`."""
    import torch  # optional: transformers' reference only
    import transformers  # optional: transformers' reference only
    fields = {k: v for k, v in hf_config.items() if k not in ("model_type", "architectures", "transformers_version")}
    config = transformers.AutoConfig.for_model(hf_config["model_type"], **fields)
    config.initializer_range = 0.02
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    model.save_pretrained(directory)
    return model.eval()


def second_cpu_device(args: object = None) -> None:
    """Before JAX starts (XLA reads XLA_FLAGS once): two CPU devices unless a count is given, so that where the
    accelerator is a CPU, host memory work (lightning's host device: the last CPU device) has a device of its own."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=2".strip()
