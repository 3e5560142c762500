"""The decode steps' token loop: up to `iterations` runs of a body that ends rows, stopping once none is left.

How often the loop checks whether any row is left was measured on an H200 (bench/README.md, fifth check). There, a
program with any loop in it returns from its dispatch only when the device has finished (launch.dispatch_probe), and
an exit that depends on the tokens also has XLA:GPU read the loop's predicate back on the host before every
iteration. A fixed trip count skips those reads but runs the iterations left after every row has ended. The
continuous scheduler's decode call makes at most a few tokens (decode_steps, 8 by default), and the fixed count won
there (3,272 against 3,000 output tokens/s on the embedded model); static batching's one call runs to the batch's
longest request, where the wasted iterations lost (2,380 against 3,052), so it checks every token. On a CPU a check
costs nothing: every token, both. MOEJAX_TOKEN_LOOP_CHECK=N (read when a step is traced) makes every loop check
every N iterations (rounded down to a divisor of its count), for such comparisons."""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

import jax

State = TypeVar("State")
CHECK_VARIABLE = "MOEJAX_TOKEN_LOOP_CHECK"


def check_every(iterations: int, few: bool) -> int:
    """How many iterations run between two early-exit checks, a divisor of `iterations` (no chunk runs past it): on
    a GPU none inside the call for a loop of `few` iterations, else every one; MOEJAX_TOKEN_LOOP_CHECK overrides."""
    chosen = os.environ.get(CHECK_VARIABLE)
    if chosen is None:
        return iterations if few and jax.default_backend() == "gpu" else 1
    if not chosen.isdigit() or int(chosen) < 1:
        raise ValueError(f"{CHECK_VARIABLE}={chosen!r}: expected a whole number of iterations >= 1")
    return max(d for d in range(1, min(int(chosen), iterations) + 1) if iterations % d == 0)


def token_loop(go_on: Callable[[State], jax.Array], body: Callable[[State], State], state: State,
               iterations: int, *, few: bool) -> State:
    """Run body on state while go_on(state), at most `iterations` times (go_on must turn false after that many):
    go_on is checked before the first iteration and then every check_every(iterations, few) iterations. A body must
    leave a state on which further iterations change no result once go_on is false. Checked never (every == iterations),
    the loop runs all its iterations, with no conditional around it either (XLA:GPU reads a conditional's predicate
    on the host too)."""
    if iterations < 1:
        return state
    every = check_every(iterations, few)
    if every == 1:
        return jax.lax.while_loop(go_on, body, state)

    def chunk(s: State) -> State:
        return jax.lax.fori_loop(0, every, lambda _, t: body(t), s)
    return chunk(state) if every == iterations else jax.lax.while_loop(go_on, chunk, state)
