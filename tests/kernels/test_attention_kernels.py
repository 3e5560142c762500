"""Attention backends and cascade attention against a float64 numpy oracle.

Error = ||out - oracle|| / ||oracle||. Tolerances: float32 inputs 1e-5 for every CPU backend (the interpreted
Pallas kernel runs float32 dots exactly on CPU, like the others); bfloat16 inputs 2e-2 (the backends round
the softmax weights to bfloat16 before the PV matmul, ~2^-8 relative each). lse: same -inf entries, and
|lse - oracle| <= tol * max(1, |oracle|) elsewhere.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moejax.kernels.attention import BACKENDS, attention, cascade_attention, cudnn, pallas, pick_backend, xla
from moejax.kernels.lowering import TRITON, cuda_module

ON_GPU = jax.default_backend() == "gpu"
CPU_BACKENDS = ("reference", "xla", "pallas_interpret")
HERE = CPU_BACKENDS + (("pallas",) if ON_GPU else ())  # the compiled Triton kernel where it can run
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def oracle(q, k, v, *, causal=True, window=None, sinks=None, q_offset=None, kv_lengths=None, scale=None):
    """Loop over (row, head) in float64 -> (out [B,T,Hq,Dv], lse [B,T,Hq] without sinks)."""
    q, k, v = (np.asarray(a).astype(np.float64) for a in (q, k, v))
    B, T, Hq, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    scale = 1 / np.sqrt(D) if scale is None else scale
    q_offset = np.full(B, S - T) if q_offset is None else np.asarray(q_offset)
    kv_lengths = np.full(B, S) if kv_lengths is None else np.asarray(kv_lengths)
    out = np.zeros((B, T, Hq, v.shape[-1]))
    lse = np.full((B, T, Hq), -np.inf)
    j = np.arange(S)[None, :]
    for b in range(B):
        pos = (q_offset[b] + np.arange(T))[:, None]
        vis = (j < kv_lengths[b]) & np.ones((T, 1), bool)
        if causal:
            vis &= j <= pos
        if window is not None:
            vis &= j > pos - window
        for h in range(Hq):
            kv = h // (Hq // Hkv)
            s = q[b, :, h] @ k[b, :, kv].T * scale
            for t in range(T):
                st_ = s[t][vis[t]]
                extra = [] if sinks is None else [float(sinks[h])]
                if st_.size == 0 and not extra:
                    continue
                m = max(list(st_) + extra)
                e = np.exp(st_ - m)
                denom = e.sum() + sum(np.exp(x - m) for x in extra)
                out[b, t, h] = e @ v[b, vis[t], kv] / denom
                if st_.size:
                    lse[b, t, h] = m + np.log(e.sum())
    return out, lse


def rel_err(out, ref):
    out = np.asarray(out).astype(np.float64)
    assert np.all(np.isfinite(out)), "non-finite output"
    return np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)


def check_lse(lse, ref, tol):
    lse = np.asarray(lse, np.float64)
    assert lse.shape == ref.shape
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref))
    fin = np.isfinite(ref)
    assert np.all(np.abs(lse[fin] - ref[fin]) <= tol * np.maximum(1, np.abs(ref[fin])))


def make(rng, B, T, S, Hkv, G, D, Dv, dtype):
    q = rng.standard_normal((B, T, Hkv * G, D))
    k = rng.standard_normal((B, S, Hkv, D))
    v = rng.standard_normal((B, S, Hkv, Dv))
    return tuple(jnp.asarray(a, dtype) for a in (q, k, v))


@st.composite
def problems(draw):
    decode = draw(st.integers(0, 3)) == 0
    B, Hkv, G = draw(st.integers(1, 3)), draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2, 4]))
    D = draw(st.sampled_from([8, 16, 32, 20]))
    Dv = draw(st.sampled_from([D, D, 8, 24]))
    T = 1 if decode else draw(st.integers(1, 40))
    S = draw(st.integers(100, 300)) if decode else draw(st.integers(T, 80))
    causal = draw(st.booleans())
    window = draw(st.one_of(st.none(), st.integers(1, 20))) if causal else None
    sinks = draw(st.booleans())
    offsets = draw(st.one_of(st.none(), st.lists(st.integers(0, S - T), min_size=B, max_size=B)))
    lengths = draw(st.one_of(st.none(), st.lists(st.integers(0, S), min_size=B, max_size=B)))
    dtype = draw(st.sampled_from([jnp.float32, jnp.float32, jnp.bfloat16]))
    return dict(B=B, T=T, S=S, Hkv=Hkv, G=G, D=D, Dv=Dv, causal=causal, window=window, sinks=sinks,
                offsets=offsets, lengths=lengths, dtype=dtype, lse=not sinks and draw(st.booleans()),
                seed=draw(st.integers(0, 2**31 - 1)))


@pytest.mark.parametrize("backend", HERE)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_backend_matches_float64_oracle(backend, p):
    rng = np.random.default_rng(p["seed"])
    q, k, v = make(rng, p["B"], p["T"], p["S"], p["Hkv"], p["G"], p["D"], p["Dv"], p["dtype"])
    sinks = jnp.asarray(rng.standard_normal(p["Hkv"] * p["G"]), jnp.float32) if p["sinks"] else None
    offsets = None if p["offsets"] is None else jnp.asarray(p["offsets"], jnp.int32)
    lengths = None if p["lengths"] is None else jnp.asarray(p["lengths"], jnp.int32)
    kw = dict(causal=p["causal"], sinks=sinks, q_offset=offsets, kv_lengths=lengths)
    got = attention(q, k, v, sliding_window=p["window"], return_lse=p["lse"], backend=backend, **kw)
    ref_out, ref_lse = oracle(q, k, v, window=p["window"], **kw)
    out = got[0] if p["lse"] else got
    assert out.shape == ref_out.shape and out.dtype == q.dtype
    tol = TOL[p["dtype"]]
    assert rel_err(out, ref_out) <= tol
    if p["lse"]:
        check_lse(got[1], ref_lse, tol)


@pytest.mark.parametrize("backend", HERE)
def test_explicit_edges(backend):
    rng = np.random.default_rng(1)
    # T*G = 1 row, far below a row block; S = 37 and 100 not multiples of the KV block
    for B, T, S, Hkv, G, D, Dv in [(1, 1, 37, 1, 1, 16, 16), (2, 3, 100, 2, 2, 20, 8)]:
        q, k, v = make(rng, B, T, S, Hkv, G, D, Dv, jnp.float32)
        out, lse = attention(q, k, v, return_lse=True, backend=backend)
        ref_out, ref_lse = oracle(q, k, v)
        assert rel_err(out, ref_out) <= 1e-5
        check_lse(lse, ref_lse, 1e-5)
    # every key masked: kv_lengths 0, and a window that starts past kv_length -> exactly 0, lse -inf
    q, k, v = make(rng, 2, 4, 30, 2, 2, 16, 16, jnp.float32)
    for kw in [dict(kv_lengths=jnp.zeros(2, jnp.int32)),
               dict(kv_lengths=jnp.array([3, 5]), q_offset=jnp.array([20, 26]), sliding_window=4)]:
        out, lse = attention(q, k, v, return_lse=True, backend=backend, **kw)
        assert np.all(np.asarray(out) == 0) and np.all(np.isneginf(np.asarray(lse)))
        out = attention(q, k, v, sinks=jnp.ones(4), backend=backend, **kw)
        assert np.all(np.asarray(out) == 0)


@pytest.mark.parametrize("T,S", [(300, 300), (260, 420)])
def test_xla_blocked_path_runs_several_query_blocks(T, S):
    """Causal attention over a call's own keys (no offsets, no lengths): query blocks reading only the keys up to
    their end, with windows, sinks and lse, in float32 and bfloat16."""
    from moejax.kernels.attention import blocked
    assert T > 2 * blocked.BLOCK
    rng = np.random.default_rng(3)
    sinks = jnp.asarray(rng.standard_normal(4), jnp.float32)
    for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)):
        q, k, v = make(rng, 2, T, S, 2, 2, 16, 8, dtype)
        for w, s in ((None, None), (150, None), (None, sinks), (37, sinks)):
            out = attention(q, k, v, sliding_window=w, sinks=s, backend="xla")
            assert rel_err(out, oracle(q, k, v, window=w, sinks=s)[0]) <= tol
        out, lse = attention(q, k, v, return_lse=True, backend="xla")
        ref_out, ref_lse = oracle(q, k, v)
        assert rel_err(out, ref_out) <= tol
        check_lse(lse, ref_lse, tol)


def test_xla_chunked_path_runs_several_chunks():
    rng = np.random.default_rng(2)
    S = 2 * xla.CHUNK + 276  # three chunks, the last one overlapping its predecessor
    q, k, v = make(rng, 2, xla.FEW_QUERIES + 2, S, 2, 2, 16, 8, jnp.float32)  # more queries than few_queries takes
    sinks = jnp.asarray(rng.standard_normal(4), jnp.float32)
    cases = [dict(),  # queries are the last keys (the blocked path)
             dict(q_offset=jnp.array([100, 700]), kv_lengths=jnp.array([S, 650])),  # later chunks skipped
             dict(q_offset=jnp.array([1200, 900]), sliding_window=300, sinks=sinks),  # early chunks skipped
             dict(causal=False, kv_lengths=jnp.array([0, 1100]))]
    for kw in cases:
        w = kw.pop("sliding_window", None)
        out = attention(q, k, v, sliding_window=w, backend="xla", **kw)
        assert rel_err(out, oracle(q, k, v, window=w, **kw)[0]) <= 1e-5
    # decode against a long cache, bfloat16, with lse
    q, k, v = make(rng, 3, 1, S, 1, 4, 32, 32, jnp.bfloat16)
    lengths = jnp.array([S, 513, 7])
    out, lse = attention(q, k, v, q_offset=lengths - 1, kv_lengths=lengths, return_lse=True, backend="xla")
    ref_out, ref_lse = oracle(q, k, v, q_offset=lengths - 1, kv_lengths=lengths)
    assert rel_err(out, ref_out) <= 2e-2
    check_lse(lse, ref_lse, 2e-2)


@st.composite
def cascades(draw):
    N, T, P = draw(st.integers(1, 5)), draw(st.integers(1, 12)), draw(st.integers(0, 40))
    Hkv, G = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2, 4]))
    D = draw(st.sampled_from([8, 16, 20]))
    return dict(N=N, T=T, P=P, Hkv=Hkv, G=G, D=D, Dv=draw(st.sampled_from([D, 8])),
                lengths=draw(st.one_of(st.none(), st.lists(st.integers(0, T), min_size=N, max_size=N))),
                sinks=draw(st.booleans()), window=draw(st.one_of(st.none(), st.integers(1, 30))),
                seed=draw(st.integers(0, 2**31 - 1)))


@pytest.mark.parametrize("backend", HERE)
@settings(max_examples=9, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cascades())
def test_cascade_matches_attention_over_concatenation(backend, c):
    rng = np.random.default_rng(c["seed"])
    N, T, P, Hkv, G, D, Dv = (c[x] for x in ("N", "T", "P", "Hkv", "G", "D", "Dv"))
    q, ks, vs = make(rng, N, T, T, Hkv, G, D, Dv, jnp.float32)
    _, kp, vp = make(rng, 1, 1, P, Hkv, G, D, Dv, jnp.float32)
    sinks = jnp.asarray(rng.standard_normal(Hkv * G), jnp.float32) if c["sinks"] else None
    lengths = None if c["lengths"] is None else jnp.asarray(c["lengths"], jnp.int32)
    out = cascade_attention(q, kp[0], vp[0], ks, vs, suffix_lengths=lengths, sinks=sinks,
                            sliding_window=c["window"], backend=backend)
    out = np.asarray(out)
    assert out.shape == (N, T, Hkv * G, Dv) and np.all(np.isfinite(out))
    for n in range(N):
        L = T if lengths is None else int(lengths[n])
        if L == 0:
            continue
        k_all = np.concatenate([np.asarray(kp[0]), np.asarray(ks[n, :L])])[None]
        v_all = np.concatenate([np.asarray(vp[0]), np.asarray(vs[n, :L])])[None]
        ref, _ = oracle(np.asarray(q)[n:n + 1, :L], k_all, v_all, window=c["window"], sinks=sinks, q_offset=[P])
        assert rel_err(out[n:n + 1, :L], ref) <= 1e-5


def _lowers_to_triton(fn, *shapes):
    return TRITON in cuda_module(fn, *(jax.ShapeDtypeStruct(s, d) for s, d in shapes))


@pytest.mark.parametrize("B,T,S,Hq,Hkv,D,Dv,extra", [
    (2, 64, 256, 8, 2, 128, 128, dict(sliding_window=64, return_lse=True)),  # prefill, GQA
    (4, 1, 1024, 8, 2, 128, 128, dict(sinks=True)),  # decode
    (2, 16, 96, 4, 4, 192, 128, dict()),  # DeepSeek MLA (not absorbed)
    (2, 1, 512, 16, 1, 576, 512, dict()),  # DeepSeek MLA absorbed decode
])
def test_pallas_lowers_to_triton_for_cuda(B, T, S, Hq, Hkv, D, Dv, extra):
    bf16, i32 = jnp.bfloat16, jnp.int32
    sinks = jnp.zeros(Hq, jnp.float32) if extra.pop("sinks", False) else None

    def fn(q, k, v, offsets, lengths):
        return attention(q, k, v, q_offset=offsets, kv_lengths=lengths, sinks=sinks, backend="pallas", **extra)
    assert _lowers_to_triton(fn, ((B, T, Hq, D), bf16), ((B, S, Hkv, D), bf16), ((B, S, Hkv, Dv), bf16),
                             ((B,), i32), ((B,), i32))


def test_cascade_pallas_lowers_to_triton_for_cuda():
    N, T, P, Hq, Hkv, D, bf16 = 4, 8, 512, 8, 2, 128, jnp.bfloat16

    def fn(q, kp, vp, ks, vs, lengths):
        return cascade_attention(q, kp, vp, ks, vs, suffix_lengths=lengths, sinks=jnp.zeros(Hq),
                                 sliding_window=128, backend="pallas")
    assert _lowers_to_triton(fn, ((N, T, Hq, D), bf16), ((P, Hkv, D), bf16), ((P, Hkv, D), bf16),
                             ((N, T, Hkv, D), bf16), ((N, T, Hkv, D), bf16), ((N,), jnp.int32))


def test_pallas_block_sizes_are_triton_friendly():
    for d in (16, 64, 128, 192, 576):
        for rows in (1, 8, 100, 4096):
            br, bk, warps, stages = pallas.block_sizes(d, rows, 1000)
            assert br >= 16 and bk >= 16 and br & (br - 1) == 0 and bk & (bk - 1) == 0
    assert pallas._pieces(576) == [(0, 512), (512, 64)] and pallas._pieces(192) == [(0, 128), (128, 64)]


def test_bad_inputs_name_the_problem():
    q, k, v = make(np.random.default_rng(0), 1, 2, 4, 2, 2, 8, 8, jnp.float32)
    with pytest.raises(ValueError, match="backend 'triton'"):
        attention(q, k, v, backend="triton")
    with pytest.raises(ValueError, match="not a multiple of kv heads"):
        attention(q[:, :, :3], k, v)
    with pytest.raises(ValueError, match="sliding_window needs causal"):
        attention(q, k, v, causal=False, sliding_window=2)
    with pytest.raises(ValueError, match="shapes disagree"):
        attention(q, k[:, :3], v)
    with pytest.raises(ValueError, match="return_lse with sinks"):
        attention(q, k, v, sinks=jnp.zeros(4), return_lse=True)
    with pytest.raises(ValueError, match="sinks must have shape"):
        attention(q, k, v, sinks=jnp.zeros(2))
    assert set(HERE) <= set(BACKENDS)


@pytest.mark.skipif(ON_GPU, reason="CPU behaviour")
def test_cpu_picks_xla_and_never_cudnn():
    q, k, v = make(np.random.default_rng(0), 1, 8, 8, 1, 2, 64, 64, jnp.bfloat16)
    assert not cudnn.supports(q, k, v, True, None, None, None, None, False)
    assert pick_backend(q, k, v, True, None, None, None, None, False) == "xla"
    with pytest.raises(ValueError, match="not on a GPU"):
        attention(q, k, v, backend="cudnn")


@pytest.mark.skipif(not ON_GPU, reason="cuDNN needs a GPU")
def test_cudnn_matches_oracle_on_gpu():
    rng = np.random.default_rng(3)
    q, k, v = make(rng, 3, 128, 128, 2, 4, 128, 128, jnp.bfloat16)
    lengths = jnp.array([128, 50, 0], jnp.int32)
    for kw in [dict(), dict(kv_lengths=lengths), dict(sliding_window=32, kv_lengths=lengths),
               dict(causal=False, kv_lengths=lengths)]:
        w = kw.pop("sliding_window", None)
        causal = kw.pop("causal", True)
        assert pick_backend(q, k, v, causal, w, None, None, kw.get("kv_lengths"), False) == "cudnn"
        out = attention(q, k, v, causal=causal, sliding_window=w, backend="cudnn", **kw)
        assert rel_err(out, oracle(q, k, v, causal=causal, window=w, **kw)[0]) <= 2e-2
    assert not cudnn.supports(q[:, :1], k, v, True, None, None, None, None, False)  # decode: offset S - 1
