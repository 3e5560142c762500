"""`--explain`: the schedule as text (batches, shapes, prefix-cache replay) and the datasheet peaks behind the
MFU estimate. Replays the exact packing the runner would do, without touching the model."""
from __future__ import annotations

import jax

from moejax import options
from moejax.engine import Engine
from moejax.sched.batch_schedule import BatchSchedule
from moejax.sched.runner import Runner

# Dense (no sparsity) 16-bit tensor-core peaks from NVIDIA datasheets, FLOP/s.
DATASHEET_PEAKS = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12, "L4": 121e12, "B200": 2250e12}


def peak_flops(dtype: str) -> float | None:
    """The datasheet peak of the first device for 16-bit math, or None when unknown (CPU, float32)."""
    kind = jax.devices()[0].device_kind
    if dtype not in ("bfloat16", "float16"):
        return None
    return next((v for k, v in DATASHEET_PEAKS.items() if k in kind), None)


def describe(schedule: BatchSchedule, runner: Runner, engine: Engine) -> str:
    lines = [f"serving options: {options.describe(runner.options)}",
             f"model {engine.name}: {engine.config.num_layers} layers, vocab {engine.config.vocab_size}",
             f"prefix KV cache: {schedule.reason}; pool {schedule.pool_blocks} blocks "
             f"({schedule.pool_blocks * 16 * engine.kv_bytes_per_token() / 2**20:.1f} MiB)",
             f"{len(schedule.batches)} batches:"]
    continuous = runner.batching == "continuous"
    if continuous and runner.kv_pool is not None:
        lines.insert(3, runner.kv_pool.describe())
    if continuous and any(b.kind != "score" for b in schedule.batches):
        lines.insert(4, "completions: continuous batching (one scheduler over the KV pool; the completion batches "
                        "below are the static schedule, listed for comparison)")
    if runner.batch_size is not None:
        lines.insert(len(lines) - 1, runner.batch_size.describe())
    shapes: set[tuple] = set()
    total, padded, cached = 0, 0, 0
    for k, batch in enumerate(schedule.batches):
        prepared = runner.prepare(k)
        if batch.kind == "score":
            rows, (arrays, _, span) = prepared
            shape: tuple = tuple(sorted((name, a.shape) for name, a in arrays.items()))
            real = sum(len(r.tokens) for r in rows)
            hits = sum(sum(r.cached.values()) for r in rows)
            B, T = arrays["tokens"].shape
            NP = arrays["prior_ids"].shape[1] if "prior_ids" in arrays else 0
            NS = sum(len(r.stores) for r in rows)
            seqs = sum(len(r) for r in batch.rows)
            lines.append(f"  {k:3d} score       rows {len(rows):3d} -> B {B:3d} x T {T:5d} | {seqs} sequences, "
                         f"{real} tokens to compute ({real / (B * T):.0%} of slots), {hits} context tokens "
                         f"from cache, prior {NP} blocks/row, {NS} blocks stored, attention head {span.head} "
                         f"window {span.window or 'causal'}")
            total, padded, cached = total + real, padded + B * T, cached + hits
        else:
            prior, stores = prepared
            reqs = batch.requests
            longest = max(len(r.prompt) for r in reqs)
            shape = ("completion", len(reqs), longest, max(r.max_tokens for r in reqs))
            hits = 16 * sum(map(len, prior))
            lines.append(f"  {k:3d} completion  rows {len(reqs):3d} | prompts up to {longest} tokens, "
                         f"max_tokens up to {max(r.max_tokens for r in reqs)}, {hits} prompt tokens from cache, "
                         f"{sum(map(len, stores))} blocks stored")
            cached += hits
        shapes.add(shape)
    lines.append(f"scoring: {total} tokens to compute in {padded} slots ({total / max(padded, 1):.0%} used); "
                 f"{cached} tokens from the prefix cache; about {len(shapes)} distinct step shapes to compile")
    return "\n".join(lines)
