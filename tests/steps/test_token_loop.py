"""moejax.steps.token_loop: however often the early exit is checked, the decode loops make the same tokens (the GPU's
fixed trip count and the chunked checks are run here on the CPU through MOEJAX_TOKEN_LOOP_CHECK)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scheduling import run_scheduler

import moejax
from moejax.steps import token_loop

TINY = "tiny-qwen3-moe"


def _count_until(stop_at: int, iterations: int):
    """A loop that adds 1 to `total` while it is below stop_at, and counts the iterations it ran in `ran`."""
    def go_on(s):
        return (s["i"] < iterations) & (s["total"] < stop_at)

    def body(s):
        live = s["total"] < stop_at  # past the exit an iteration changes no result, as token_loop requires
        return dict(i=s["i"] + 1, total=s["total"] + live.astype(jnp.int32), ran=s["ran"] + 1)
    start = dict(i=jnp.int32(0), total=jnp.int32(0), ran=jnp.int32(0))
    return jax.jit(lambda: token_loop.token_loop(go_on, body, start, iterations, few=True))()


@pytest.mark.parametrize("check, ran", [("1", 4), ("2", 4), ("4", 6), ("5", 6), ("6", 6)])
def test_the_exit_is_checked_every_n_iterations(monkeypatch, check, ran):
    monkeypatch.setenv(token_loop.CHECK_VARIABLE, check)  # 4 and 5 round down to 3, a divisor of 6
    out = _count_until(4, 6)
    assert int(out["total"]) == 4 and int(out["ran"]) == ran
    assert int(_count_until(9, 6)["total"]) == 6  # never past `iterations`


def test_the_platform_default_and_bad_values(monkeypatch):
    monkeypatch.delenv(token_loop.CHECK_VARIABLE, raising=False)
    gpu = jax.default_backend() == "gpu"
    assert token_loop.check_every(8, few=True) == (8 if gpu else 1) and token_loop.check_every(8, few=False) == 1
    monkeypatch.setenv(token_loop.CHECK_VARIABLE, "0")
    with pytest.raises(ValueError, match="MOEJAX_TOKEN_LOOP_CHECK='0'"):
        token_loop.check_every(8, few=True)


@pytest.mark.slow  # 25 s: two engines compiled under each setting
def test_engines_make_the_same_tokens_however_often_they_check(monkeypatch):
    prompts = [list(np.random.default_rng(s).integers(1, 1024, size=n)) for s, n in ((0, 7), (1, 15), (2, 4))]
    reference = moejax.load(TINY, dtype="float32")
    free = reference.generate(prompts, 13)
    stop = free[0][4]  # a token greedy decoding makes: rows ending early leave iterations the fixed loops still run
    expected = [f[: f.index(stop) + 1] if stop in f else f for f in free]
    for check in ("64", "3"):  # fixed trip counts; chunks of 3 (the scheduler's 6 tokens a call)
        monkeypatch.setenv(token_loop.CHECK_VARIABLE, check)
        engine = moejax.load(TINY, dtype="float32")  # its own jitted steps, traced under this setting
        out, _ = run_scheduler(engine, prompts, 13, num_blocks=12, stop_ids=(stop,), decode_steps=6)
        assert out == expected, check
        assert engine.generate(prompts, 13, stop_token_ids=(stop,)) == expected, check
