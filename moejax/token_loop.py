"""The decode steps' token loop: up to `steps` iterations of a body that ends rows, stopping early once none is left.

XLA evaluates a while loop's condition on the device, and on a GPU its runtime copies that predicate to the host
before every iteration: a loop whose exit depends on the tokens blocks the dispatching thread until the loop is done
(the call no longer returns before the device has finished) and leaves the GPU idle while the host launches each
iteration's kernels. A loop with a trip count fixed at trace time needs no such copy. So the early exit is checked
only every `check_every` iterations, the iterations between run as a fixed loop, and a dead row's iterations change
nothing (the bodies mask them). `check_every` comes from MOEJAX_TOKEN_LOOP_CHECK (read at trace time), else the
platform's default: every iteration on a CPU, where the check costs nothing and ending early saves work; on a GPU,
never inside a call (the iterations after every row has ended are the price)."""
from __future__ import annotations

import os
from typing import Callable, TypeVar

import jax

State = TypeVar("State")
CHECK_VARIABLE = "MOEJAX_TOKEN_LOOP_CHECK"


def check_every(iterations: int) -> int:
    """How many iterations run between two early-exit checks: a divisor of `iterations` (so that no chunk runs past
    it), the largest one not above what MOEJAX_TOKEN_LOOP_CHECK asks for."""
    chosen = os.environ.get(CHECK_VARIABLE)
    if chosen is None:
        return iterations if jax.default_backend() == "gpu" else 1
    if not chosen.isdigit() or int(chosen) < 1:
        raise ValueError(f"{CHECK_VARIABLE}={chosen!r}: expected a whole number of iterations >= 1")
    return max(d for d in range(1, min(int(chosen), iterations) + 1) if iterations % d == 0)


def token_loop(go_on: Callable[[State], jax.Array], body: Callable[[State], State], state: State,
               iterations: int) -> State:
    """Run body on state while go_on(state), at most `iterations` times (go_on must turn false after that many):
    go_on is checked before the first iteration and then every check_every(iterations) iterations. A body must leave
    a state on which further iterations change no result once go_on is false. Checked never (every == iterations),
    the loop runs all its iterations: no conditional either, since XLA:GPU reads a conditional's predicate on the
    host as it does a loop's."""
    if iterations < 1:
        return state
    every = check_every(iterations)
    if every == 1:
        return jax.lax.while_loop(go_on, body, state)

    def chunk(s: State) -> State:
        return jax.lax.fori_loop(0, every, lambda _, t: body(t), s)
    return chunk(state) if every == iterations else jax.lax.while_loop(go_on, chunk, state)
