"""`bench generate --overhead`: the continuous-batching scheduler's host time per step, with the model's forward
replaced by a no-op of the same shapes (`NoopSteps`). The steps' inputs are converted and dispatched as the real
steps' are; the pool comes back unchanged and every token made is one that no request stops at, so each sequence
runs to its max_tokens (a decode row makes its whole budget). What the scheduler's step times (its Stats: chunk_s,
decode_s) then hold is host work: bookkeeping, tables and sampling inputs, copies, dispatch, reading results,
delivering finished requests; so is its whole loop's time."""
from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp

from moejax.engine import Engine
from moejax.models.kv_pool import Layer
from moejax.steps import paged_phases
from moejax.steps.rows import ChunkRows, PagedDecodeRows

TARGET_MS = 2.0  # the target for host overhead per scheduler step, no-op model, CPU


# keep_unused: every input is passed to the program, as to the real step. The pool goes in but not out: an output
# pool would be a copy each step (the real steps donate it and write it in place). The carry is kept as the real
# steps keep it, so chained rows make tokens only where their sequence goes on.
@functools.partial(jax.jit, static_argnames=("fresh", "token"), keep_unused=True)
def _chunk(pool: list[Layer], carry: jax.Array, rows: ChunkRows, *, fresh: bool, token: int
           ) -> tuple[jax.Array, jax.Array]:
    tok = jnp.full(rows.tokens.shape[:1], token, jnp.int32)
    return carry.at[rows.slot].set(tok, mode="drop"), tok


@functools.partial(jax.jit, static_argnames=("steps", "token"), keep_unused=True)
def _decode(pool: list[Layer], carry: jax.Array, rows: PagedDecodeRows, *, steps: int, token: int
            ) -> tuple[jax.Array, jax.Array]:
    live = paged_phases.decode_start(carry, rows, steps).live
    made = (jnp.arange(steps, dtype=jnp.int32)[None, :] < rows.budget[:, None]) & live[:, None]  # its whole budget
    out = jnp.where(made, token, -1).astype(jnp.int32)
    return paged_phases.decode_finish(carry, rows.slot, out), out


class NoopSteps:
    """`engine` with paged_chunk and paged_decode (moejax.engine.Engine's, same signatures and results) replaced by
    no-ops making `token`; every other attribute is the engine's."""

    def __init__(self, engine: Engine, token: int) -> None:
        self._engine, self._token = engine, int(token)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def paged_chunk(self, pool: list[Layer], carry: jax.Array, rows: ChunkRows, *, fresh: bool
                    ) -> tuple[list[Layer], jax.Array, jax.Array]:
        # the host rows straight into the jitted call, as Engine.paged_chunk passes them
        return pool, *_chunk(pool, carry, rows, fresh=fresh, token=self._token)

    def paged_decode(self, pool: list[Layer], carry: jax.Array, rows: PagedDecodeRows, *, steps: int
                     ) -> tuple[list[Layer], jax.Array, jax.Array]:
        return pool, *_decode(pool, carry, rows, steps=steps, token=self._token)


def free_token(reqs: list[dict], eos_ids: Iterable[int], vocab: int) -> int:
    """The smallest token id no request stops at (nor the model's eos)."""
    stops = {t for r in reqs for t in r["stop_token_ids"]} | set(eos_ids)
    return next(t for t in range(vocab) if t not in stops)


def per_step(stats: dict) -> dict:
    """From the scheduler's stats: host microseconds per chunk step, per decode step (Stats counts each decode
    call), per step of either kind and per loop iteration (the scheduler's whole run: admission, retiring and
    delivery included), and per iteration outside the steps' own times (what the scheduler does between them)."""
    steps = stats["chunk_steps"] + stats["decode_steps"]
    loop = dict(run_s=stats["run_s"], iterations=stats["breakdown"]["loop"]["steps"])
    us = lambda seconds, count: seconds / count * 1e6 if count else None  # noqa: E731
    between = loop["run_s"] - stats["chunk_s"] - stats["decode_s"]
    out = dict(chunk_us=us(stats["chunk_s"], stats["chunk_steps"]), decode_us=us(stats["decode_s"],
               stats["decode_steps"]), step_us=us(loop["run_s"], steps),
               iteration_us=us(loop["run_s"], loop["iterations"]),
               between_steps_us_per_iteration=us(between, loop["iterations"]), chunk_steps=stats["chunk_steps"],
               decode_steps=stats["decode_steps"], iterations=loop["iterations"], scheduler_run_s=loop["run_s"],
               shapes=stats["shapes"], target_ms=TARGET_MS)
    measured = [v for k, v in out.items() if k in ("chunk_us", "decode_us", "step_us") and v is not None]
    out["target_met"] = max(measured, default=0.0) <= TARGET_MS * 1e3
    return out


def describe(o: dict) -> str:
    fmt = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
    return (f"host us per chunk step {fmt(o['chunk_us'])} ({o['chunk_steps']}), per decode step "
            f"{fmt(o['decode_us'])} ({o['decode_steps']}), per step {fmt(o['step_us'])}, per loop iteration "
            f"{fmt(o['iteration_us'])} ({o['iterations']}; {fmt(o['between_steps_us_per_iteration'])} of it between "
            f"steps); target <= {o['target_ms'] * 1e3:.0f} us per step: {'met' if o['target_met'] else 'NOT met'}")
