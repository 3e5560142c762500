"""Micro-benchmarks of DEP's four tasks on the devices present, and FinDEP's α-β (Eq. 7-11) fitted to them
(`python -m launch.profile --dep`; moejax.plan.findep_costs.fit_dep_tasks). Needs devices: the planners never
import it. The engines come from the `load` passed in (moejax.load: it sits above this module).

Per split (A attention, B expert devices; A + B the devices present, the experts dividing over B) an engine of the
model runs DEP with that split (r1 = r2 = 1) and one forward per token count, which gives the first MoE layer's
real inputs; then each task runs alone, waited for, the fastest of `repeats` after a warm-up (compilation):
attention (the attention group's attention + router + the chunk's cut, moejax.sharding.dep.attend_chunks), the
shared expert, A2E (the chunk's `device_put` onto the expert group, as the executor's route sends it), the routed
experts (the expert group's program) and E2A (the outputs' `device_put` back). Token counts: `sequences` per
attention device x `seq_lens`; two sequence lengths at least, so that the attention fit can tell its GEMM work
(linear in tokens) from its attention work (quadratic in the length)."""
from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from moejax.config import ModelConfig
from moejax.engine import Engine
from moejax.layout import Layout
from moejax.models.checkpoint import read_config
from moejax.plan.findep_costs import (
    a2e_bytes,
    attention_work,
    e2a_bytes,
    expert_device_rows,
    expert_row_work,
    fit_dep_tasks,
    shared_work,
)
from moejax.plan.hardware import DepTaskFits
from moejax.presets import preset_config, resolve_embedded
from moejax.sharding.dep import DisaggregatedSteps, shared_expert


def _seconds(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """The fastest of `repeats` calls after a warm-up (which compiles): other processes on the machine (simulated
    devices share its cores) only ever add time."""
    out = jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return min(times), out


def dep_splits(num_experts: int, devices: int) -> list[tuple[int, int]]:
    """(A, B) with A + B = devices and the experts dividing evenly over B."""
    return [(devices - b, b) for b in range(1, devices) if num_experts % b == 0]


def measure_split(load: Callable[..., Engine], model: str, attn_devices: int, expert_devices: int, *,
                  sequences: Sequence[int] = (1, 2, 4), seq_lens: Sequence[int] = (32, 128), dtype: str = "bfloat16",
                  repeats: int = 3, log: Callable[[str], None] = lambda _: None) -> DepTaskFits:
    """The four tasks' points of one split at each token count, and their fits; `load` is moejax.load."""
    A, B = attn_devices, expert_devices
    engine = load(model, dtype=dtype, compilation_cache=False,
                         layout=f"attn=dp,experts=dep,attn_devices={A},expert_devices={B},r1=1,r2=1")
    cfg, steps = engine.config, engine.layered_steps
    assert isinstance(steps, DisaggregatedSteps), "a DEP layout runs DisaggregatedSteps"
    placement = steps.placement
    layer_index = steps.moe_layers[0]
    layer = steps.layers[layer_index]
    captured: dict = {}
    pipeline = steps._pipeline

    def grab(parts: list[dict], read_cache: bool, lay: Layout) -> list[dict]:  # the layers' inputs of one forward
        captured.update(parts[0], read_cache=read_cache)
        return pipeline(parts, read_cache, lay)
    steps._pipeline = grab  # type: ignore[method-assign]  # this engine's only: deleted below
    points: list[tuple] = []
    try:
        for seq in seq_lens:
            for m in sequences:
                ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (A * m, seq))
                engine.logits(ids)
                x, at, rc = captured["x"], captured["at"], captured["read_cache"]
                m_a, S = x.shape[0] / A, x.shape[1]
                tokens = x.shape[0] * S
                chunks = placement.layout.token_chunks(tokens)
                t_a, (_, y, _, sends) = _seconds(functools.partial(layer, steps.attend, x, at, None, None,
                                                                   kernels=steps.kernels, read_cache=rc,
                                                                   chunks=chunks), repeats)
                points.append(("attention", *attention_work(cfg, m_a * S, m_a, S), t_a))
                if placement.has_shared:
                    t_s, _ = _seconds(functools.partial(layer, shared_expert, y), repeats)
                    points.append(("shared", shared_work(cfg, m_a * S), t_s))
                send = sends[0]
                rows = send[0].shape[0]
                b = send[0].dtype.itemsize
                target, program, home = placement.route()
                t_in, sent = _seconds(functools.partial(jax.device_put, send, target), repeats)
                experts = placement.store.fetch(layer_index)
                t_e, out = _seconds(functools.partial(program, *sent, experts), repeats)
                t_out, _ = _seconds(functools.partial(jax.device_put, out, home), repeats)
                points += [("experts", expert_device_rows(cfg, rows) * expert_row_work(cfg), t_e),
                           ("a2e", a2e_bytes(cfg, rows, b, B, placement.a2e), t_in),
                           ("e2a", e2a_bytes(cfg, rows, b, B, placement.a2e), t_out)]
                log(f"A={A} B={B} {A * m} x {S} tokens: attention {t_a * 1e3:.2f} ms, experts {t_e * 1e3:.2f} ms, "
                    f"A2E {t_in * 1e3:.2f} ms, E2A {t_out * 1e3:.2f} ms")
    finally:
        del steps._pipeline  # the class's method again
    return fit_dep_tasks(points, attn_devices=A, expert_devices=B, model=model, a2e=placement.a2e)


def measure_dep(load: Callable[..., Engine], model: str, *, devices: int | None = None,
                splits: Sequence[tuple[int, int]] | None = None, **kw: Any) -> tuple[DepTaskFits, ...]:
    """measure_split for every split of the devices present (or `splits`); `load` is moejax.load."""
    n = devices or jax.device_count()
    if splits is None:
        path = resolve_embedded(model)
        config = read_config(path) if os.path.isdir(path) else preset_config(model)
        splits = dep_splits(ModelConfig.from_hf(config).num_experts, n)
    return tuple(measure_split(load, model, a, b_, **kw) for a, b_ in splits)
