"""A lightning engine's decode measured against its policy's prediction: one decode call of `rows` rows whose caches
hold `context` tokens each (a synthetic pool: attention's cost depends on how much it reads, not on what), twice to
warm up and once traced (moejax.lightning.trace). What `--explain` prints beside the HRM's per-layer time, what
`--plot` draws as a Gantt chart, and what launch.bench's lightning mode reports."""
from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from moejax.engine import Engine
from moejax.lightning.cgopipe_steps import LightningSteps
from moejax.lightning.host_attention_bench import median_seconds_each, read_all
from moejax.lightning.trace import MeasuredEvent, Timeline, busy
from moejax.models.kv_pool import BLOCK
from moejax.plan.lightning import LightningPolicy, predict_policy
from moejax.plan.resolve import profile_for
from moejax.sampling import Sampling, SamplingParams
from moejax.steps.rows import PagedDecodeRows


@dataclasses.dataclass(frozen=True)
class Probe:
    rows: int
    context: int
    tokens: int  # decode steps in the traced call (passes over the layers)
    layers: int
    seconds: float  # the traced call's wall time
    busy_s: dict  # per resource, over the call
    events: tuple[MeasuredEvent, ...]
    host_kv_bytes: int = 0  # KV bytes the host's attention read over the call (each step reads each row's context)
    host_read_gb_per_s: float = 0.0  # a plain jitted sum over the host pool: what a streaming read reaches there

    @property
    def layer_s(self) -> float:
        """Measured seconds per layer per decode step (the pipeline's makespan over its layers)."""
        return self.seconds / (self.tokens * self.layers)

    @property
    def tokens_per_s(self) -> float:
        return self.rows * self.tokens / self.seconds

    @property
    def host_attention_gb_per_s(self) -> float:
        """KV bytes read over the host's busy time (its tasks: attention and the stores of the new KV)."""
        host = self.busy_s.get("host", 0.0)
        return self.host_kv_bytes / host / 1e9 if host else 0.0

    def as_dict(self) -> dict:
        return dict(rows=self.rows, context=self.context, tokens=self.tokens, layers=self.layers, seconds=self.seconds,
                    layer_s=self.layer_s, tokens_per_s=self.tokens_per_s, busy_s=self.busy_s,
                    busy_share={r: b / self.seconds for r, b in self.busy_s.items()}, host_kv_bytes=self.host_kv_bytes,
                    host_attention_gb_per_s=self.host_attention_gb_per_s,
                    host_read_gb_per_s=self.host_read_gb_per_s)

    def gantt_events(self) -> list[tuple[str, str, float, float]]:
        """(resource, label, start, end) for moejax.plan.plots.gantt."""
        return [(e.resource, e.label, e.start, e.end) for e in self.events]


def probe_decode(engine: Engine, rows: int, context: int, tokens: int = 2) -> Probe:
    """Three decode calls of `tokens` tokens per row at `context` tokens of cache; the last is traced."""
    steps = engine.steps
    if not isinstance(steps, LightningSteps):
        raise ValueError(f"probe_decode: the engine's placement is {engine.placement.name}, not lightning")
    if min(rows, context, tokens) < 1:
        raise ValueError(f"probe_decode: rows, context and tokens must be >= 1, got {rows}, {context}, {tokens}")
    per_row = -(-(context + tokens) // BLOCK)
    pool = engine.init_pool(rows * per_row, decode=True)
    table = np.arange(rows * per_row, dtype=np.int32).reshape(rows, per_row)
    sampling = Sampling.of([SamplingParams()] * rows, np.zeros((rows, 2), np.uint32), np.zeros(rows, np.int32))
    inputs = PagedDecodeRows(np.zeros(rows, np.int32), np.zeros(rows, bool), np.full(rows, context, np.int32),
                             np.full(rows, tokens, np.int32), table, np.arange(rows, dtype=np.int32),
                             np.full((rows, 1), -1, np.int32), sampling)
    carry = jax.device_put(np.full(rows, -1, np.int32))
    for _ in range(2):  # the first call compiles; the second meets arrays the first returned (a few more compile)
        pool, carry, out = engine.paged_decode(pool, carry, inputs, steps=tokens)
        jax.block_until_ready(out)
    steps.trace(False)  # a trace in progress ends here (its counts kept); this call gets its own
    steps.timeline = timeline = Timeline().start()
    try:
        start = time.perf_counter()
        pool, carry, out = engine.paged_decode(pool, carry, inputs, steps=tokens)
        jax.block_until_ready((pool, out))
        seconds = time.perf_counter() - start
    finally:
        steps.timeline = None
        events = timeline.stop()
    host_layers = [layer for i, layer in enumerate(pool) if i >= steps.settings.device_kv_layers]
    per_token = sum(a.nbytes // (a.shape[0] * a.shape[1]) for layer in host_layers for a in layer.values())
    read = rows * per_token * sum(context + i + 1 for i in range(tokens))  # step i reads context + i + 1 keys
    return Probe(rows, context, tokens, len(steps.layers), seconds, busy(events), tuple(events), read,
                 _streaming_read_gb_per_s(host_layers))


def _streaming_read_gb_per_s(pool: list[dict[str, jax.Array]], repeats: int = 5) -> float:
    """GB/s of a streaming read of the host's KV pool (host_attention_bench.read_all; the median of `repeats`)."""
    arrays = {f"{i}/{n}": a for i, layer in enumerate(pool) for n, a in layer.items()}
    if not arrays:
        return 0.0
    seconds = median_seconds_each([lambda: read_all(arrays)], repeats)[0]
    return sum(a.nbytes for a in arrays.values()) / seconds / 1e9


def explain_lines(probe: Probe, predicted: LightningPolicy | None, why_not: str = "") -> list[str]:
    """The measured decode beside the HRM's prediction (None: no profile to predict with; why_not says why)."""
    share = ", ".join(f"{r} {b / probe.seconds:.0%}" for r, b in sorted(probe.busy_s.items()))
    lines = [f"lightning decode measured here: {probe.rows} rows at {probe.context} tokens of context, {probe.tokens} "
             f"tokens: {probe.layer_s * 1e3:.2f} ms per layer per step, {probe.tokens_per_s:.1f} tok/s; busy: {share}"]
    if probe.host_kv_bytes:
        lines.append(f"  host attention read the KV at {probe.host_attention_gb_per_s:.2f} GB/s of its busy time; a "
                     f"streaming read of the host pool reaches {probe.host_read_gb_per_s:.2f} GB/s")
    if predicted is None:
        lines.append(f"  predicted: none ({why_not or 'no hardware profile'})")
    else:
        d = predicted.decode
        lines.append(f"  predicted by the HRM on {predicted.hardware}: {d.total_s * 1e3:.2f} ms per layer (link "
                     f"{d.comm_s * 1e3:.2f}, CPU {d.cpu_s * 1e3:.2f}, GPU {d.gpu_s * 1e3:.2f}; {d.bound}-bound); "
                     f"measured / predicted = {probe.layer_s / d.total_s:.2f}")
    return lines


def explain_engine(engine: Engine, profile: str | None = None
                   ) -> tuple[list[str], Probe, LightningPolicy | None]:
    """--explain's lines for a lightning engine: its policy's decode probed at N rows and the workload's average
    decode context (prompt + half the generation), against the HRM's per-layer time for the policy run on the
    hardware profile (`profile`: a name or file, else the devices' own; none found: no prediction, the lines say
    why) -> (lines, the probe, the prediction or None)."""
    plan = engine.memory_budget.lightning
    assert engine.plan is not None  # moejax.load gives every engine its plan
    workload = engine.plan.workload
    probe = probe_decode(engine, plan.N, workload.seq_len + workload.gen_len // 2)
    try:
        hardware = profile_for(jax.devices()[0].device_kind, len(jax.devices()), profile)
    except ValueError as e:
        return explain_lines(probe, None, str(e)), probe, None
    # the executed policy's prediction (options may have changed the search's choice)
    predicted = predict_policy(engine.config, hardware, N=plan.N, mu=plan.mu, A_g=plan.A_g, F_g=plan.F_g,
                               r_w=plan.r_w, r_c=plan.r_c, prompt_len=workload.seq_len, gen_len=workload.gen_len)
    return explain_lines(probe, predicted), probe, predicted
