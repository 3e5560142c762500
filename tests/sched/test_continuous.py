"""Continuous batching (moejax.sched.continuous) against Engine.generate: shared prefix blocks, sampling that does
not depend on batch composition or preemption, serving (continuous vs static), an offloaded placement. Every
family fixture runs under the scheduler in test_parity (greedy against transformers' tokens)."""
import json

import numpy as np
import pytest
from scheduling import row_key, run_scheduler

import moejax
from moejax.sched.batch import serve_lines
from moejax.sched.block_pool import BlockPool, PoolExhausted
from moejax.sched.continuous import GenRequest, Scheduler
from moejax.sched.serving_options import ServingOptions

TINY = "tiny-qwen3-moe"  # no tokenizer, vocab 1024


@pytest.fixture(scope="module")
def tiny():
    return moejax.load(TINY, dtype="float32")


def prompts_of(lengths, seed=0, vocab=1024):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, size=n).tolist() for n in lengths]


def test_block_pool_shares_published_blocks_and_accounts_for_every_block():
    pool = BlockPool(4)
    a = pool.allocate(2)
    pool.publish(a[0], b"h0")
    pool.publish(a[1], b"h1")
    assert pool.match([b"h0", b"h1", b"h2"]) == a and pool.refs[a[0]] == 2  # a second holder, no copy
    with pytest.raises(RuntimeError, match="published"):
        pool.check_writable([a[1]])  # shared KV is written once
    pool.release(a)
    pool.release(a)
    assert pool.in_use() == 0 and pool.available() == 4
    assert pool.match([b"h0"]) == [a[0]]  # released but still indexed: matched again
    pool.release([a[0]])
    with pytest.raises(PoolExhausted):
        pool.allocate(5)
    got = pool.allocate(4)  # takes the never-used blocks first, then evicts the indexed ones
    assert sorted(got) == [0, 1, 2, 3] and pool.evictions == 2 and pool.match([b"h0"]) == []
    pool.release(got)
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release([got[0]])


@pytest.mark.slow  # four scheduler runs (about 19 s)
def test_shared_prefix_blocks_are_read_not_recomputed(tiny):
    """Three prompts share a 40-token prefix (two full blocks): the first computes and publishes them, the others
    wait for them and read them (the scheduler refuses any write into a published block), with Engine.generate's
    tokens."""
    prefix = prompts_of([40], seed=1)[0]
    prompts = [prefix + tail for tail in prompts_of([3, 9, 17], seed=2)]
    expected = tiny.generate(prompts, 6)
    out, sched = run_scheduler(tiny, prompts, 6, num_blocks=16, chunk_tokens=64, row_tokens=16, decode_steps=4)
    assert out == expected
    assert sched.stats.shared_tokens == 2 * 32 and sched.blocks.shared_hits == 4
    assert sched.stats.prefill_tokens == sum(map(len, prompts)) - 2 * 32
    assert sched.stats.chunk_steps < len(prompts) * 2  # a prompt fills several rows of one step


@pytest.mark.slow  # three scheduler runs (about 28 s)
def test_sampling_does_not_depend_on_batch_or_preemption(tiny):
    """Sampled tokens are Engine.generate's (key of row i, token t: fold_in(fold_in(key(seed), i), t)) whether a
    sequence runs alone or is admitted mid-run into a crowded pool, preempted and resumed."""
    prompts = prompts_of([7, 30, 12, 21, 5], seed=3)
    maxn = [20, 9, 26, 14, 17]
    reference = tiny.generate(prompts, max(maxn), temperature=1.0, seed=11)
    expected = [r[:m] for r, m in zip(reference, maxn, strict=True)]
    crowded, sched = run_scheduler(tiny, prompts, maxn, num_blocks=4, seed=11, temperature=1.0, max_rows=3,
                                   chunk_tokens=16, decode_steps=4)
    assert crowded == expected
    assert sched.stats.preemptions > 0 and sched.stats.chunk_steps > len(prompts)
    alone, _ = run_scheduler(tiny, prompts[3:4], maxn[3:4], num_blocks=4, seed=11, temperature=1.0,
                             chunk_tokens=16, decode_steps=4, rows=[3])
    assert alone == expected[3:4]


def test_stop_tokens_end_sequences_and_free_their_rows(tiny):
    prompts = prompts_of([6, 6, 6, 6], seed=4)
    free = tiny.generate(prompts, 12)
    stop = free[1][3]  # a token greedy decoding makes: rows making it end there, inclusively
    out, sched = run_scheduler(tiny, prompts, 12, num_blocks=8, stop_ids=(stop,), decode_steps=5)
    expected = [f[: f.index(stop) + 1] if stop in f else f for f in free]
    assert out == expected and len(out[1]) <= 4
    assert sched.stats.decode_rows_useful < sched.stats.decode_rows_computed


@pytest.mark.slow  # a cached engine compiled (about 19 s); tests/offload checks cached decoding fast
def test_offloaded_placement_decodes_under_the_scheduler(tiny):
    cached = moejax.load(TINY, dtype="float32", placement="cached", cache_slots=6)
    prompts = prompts_of([9, 20], seed=5)
    out, _ = run_scheduler(cached, prompts, [7, 11], num_blocks=3, chunk_tokens=16, decode_steps=3)
    reference = tiny.generate(prompts, 11)
    assert out == [reference[0][:7], reference[1]]
    assert cached.stats()["total"]["misses"] > 0  # the experts did come through the cache


def completion_line(cid, prompt, max_tokens, **extra):
    return json.dumps({"custom_id": cid, "url": "/v1/completions",
                       "body": {"prompt": prompt, "max_tokens": max_tokens, **extra}})


def test_serving_continuous_equals_static(tiny, tmp_path):
    """The same lines served both ways give the same results (n > 1, echo with log-probabilities, stop tokens,
    seeds); a request that cannot fit the pool fails alone, with a message that says so."""
    p = prompts_of([5, 40, 13, 22], seed=6)
    lines = [completion_line("a", p[0], 9, seed=1),
             completion_line("b", p[1], 14, n=2, temperature=0.9, seed=2),
             completion_line("c", p[2], 6, logprobs=2, echo=True, seed=3),
             completion_line("d", p[3], 11, stop_token_ids=[7, 8, 9], seed=4),
             completion_line("e", p[0] + p[2], 3, temperature=1.0, top_p=0.5, seed=5)]
    results = {}
    for batching in ("static", "continuous"):
        out = tmp_path / f"{batching}.jsonl"
        summary = serve_lines(tiny, lines, str(out), ServingOptions(batching=batching), seed_nonce=0)
        assert summary["requests_ok"] == len(lines) and summary["batching"] == batching
        results[batching] = [_comparable(json.loads(x)) for x in out.read_text().splitlines()]
    assert results["continuous"] == results["static"]
    assert summary["scheduler"]["shapes"] <= 6

    too_long = completion_line("too-long", p[1] * 3, 200)
    out = tmp_path / "small.jsonl"
    summary = serve_lines(tiny, lines[:1] + [too_long], str(out), ServingOptions(kv_pool_mb=0.05), seed_nonce=0)
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert _comparable(rows[0]) == results["static"][0]
    assert rows[1]["response"]["status_code"] == 500
    assert "raise the KV pool size (launch.serve --kv-pool-mb)" in rows[1]["error"]["message"]


def _comparable(row: dict) -> dict:
    body = dict(row["response"]["body"])
    body.pop("created", None)
    return {"custom_id": row["custom_id"], **body}


@pytest.mark.slow  # a serve run with a failing step (about 15 s); test_serve's failing batch is fast
def test_a_failing_step_fails_only_its_sequences(tiny, tmp_path, monkeypatch):
    """A decode step that raises fails the requests in flight (500, retried by a rerun); the scheduler starts a
    fresh pool and serves the rest."""
    real, calls = tiny.paged_decode, []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise MemoryError("no room")
        return real(*args, **kwargs)
    monkeypatch.setattr(tiny, "paged_decode", flaky)
    p = prompts_of([5, 9, 7], seed=7)
    lines = [completion_line(f"c{i}", prompt, 4, seed=i) for i, prompt in enumerate(p)]
    out = tmp_path / "out.jsonl"
    summary = serve_lines(tiny, lines, str(out), ServingOptions(max_rows=2), seed_nonce=0)
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    # the two longest prompts are admitted first (the plan's order), decode together and fail together
    assert [r["response"]["status_code"] for r in rows] == [200, 500, 500]
    assert rows[1]["error"]["message"] == "step failed: MemoryError: no room"
    assert rows[0]["response"]["body"]["choices"][0]["token_ids"] == tiny.generate(p[:1], 4)[0]
    assert summary["requests_ok"] == 1 and summary["requests_batch_failed"] == 2


def test_steps_run_one_behind_the_host(tiny):
    """Decode steps are dispatched before the tokens they start from are read (a prompt's first token from the
    chunk step, the last of the decode step before): the tokens are Engine.generate's, cut at stop tokens and at a
    stop string (which only the host sees, so its sequence's next step is made and dropped), separate or mixed."""
    prompts = prompts_of([6, 19, 11, 8], seed=8)
    free = tiny.generate(prompts, 10)
    stop_id = free[0][2]  # a greedy token: sequences making it stop there
    expected = [f[: f.index(stop_id) + 1] if stop_id in f else f for f in free]
    stop_text = f"<{free[2][0]}>"  # sequence 2's first token (from the chunk step) ends it: the decode step
    expected[2] = free[2][:1]  # dispatched behind the chunk for it makes tokens that are dropped
    reqs = [GenRequest(p, 10, row_key(0, i), (stop_id,), (stop_text,) if i == 2 else (), tag=i)
            for i, p in enumerate(prompts)]
    for mixed in (False, True):
        out = {}
        sched = Scheduler(tiny, 16, max_rows=4, chunk_tokens=32, row_tokens=16, decode_steps=3, mixed=mixed,
                          decode_text=lambda tokens: "".join(f"<{t}>" for t in tokens))
        sched.run(reqs[:2] if mixed else reqs, lambda r, tokens, cached, out=out: out.__setitem__(r.tag, tokens),
                  lambda r, message: pytest.fail(message))
        assert [out[i] for i in sorted(out)] == expected[: len(out)]
        assert sched.stats.chained_rows > 0 and sched.blocks.in_use() == 0


def test_each_decode_step_is_read_after_the_next_step_is_dispatched(tiny, monkeypatch):
    """Async scheduling, checked on the order of events: every decode step's tokens are read on the host only after
    the scheduler has dispatched the step after it (a decode or a chunk step), so the device has the next step
    queued while the host works; only the run's last decode step is read with nothing behind it."""
    events = []
    for name in ("paged_decode", "paged_chunk"):
        real = getattr(tiny, name)

        def dispatch(pool, carry, rows, _real=real, _name=name, **static):
            pool, carry, out = _real(pool, carry, rows, **static)
            events.append(("dispatch", _name, id(out)))
            return pool, carry, out
        monkeypatch.setattr(tiny, name, dispatch)
    real_wait = Scheduler._wait

    def wait(self, x, kind):
        events.append(("read", kind, id(x)))
        return real_wait(self, x, kind)
    monkeypatch.setattr(Scheduler, "_wait", wait)
    prompts = prompts_of([40, 9, 33, 12, 50, 7], seed=11)  # prompts arriving while others decode: chunk steps
    reqs = [GenRequest(p, 12, row_key(0, i), tag=i) for i, p in enumerate(prompts)]  # between decode steps
    out = {}
    sched = Scheduler(tiny, 32, max_rows=3, chunk_tokens=32, row_tokens=16, decode_steps=2)
    sched.run(reqs, lambda r, tokens, cached: out.__setitem__(r.tag, tokens), lambda r, m: pytest.fail(m))
    assert [out[i] for i in range(len(prompts))] == tiny.generate(prompts, 12)
    dispatched = [(i, e) for i, e in enumerate(events) if e[0] == "dispatch"]
    decodes = [(i, e) for i, e in dispatched if e[1] == "paged_decode"]
    assert len(decodes) > 4 and any(e[1] == "paged_chunk" for _, e in dispatched[dispatched.index(decodes[0]):])
    for n, (at, (_, step, key)) in enumerate(dispatched[:-1]):
        if step == "paged_decode":  # its read: the first after its dispatch (an id is reused once it is freed)
            read = next(i for i in range(at, len(events)) if events[i] == ("read", "decode", key))
            assert read > dispatched[n + 1][0], f"decode step {n} was read before the step after it was dispatched"
    assert dispatched[-1] == decodes[-1]  # the last step is a decode step, read with nothing behind it
