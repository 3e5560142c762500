"""Paged attention (moejax.kernels.attention.paged) against dense attention over each row's gathered keys.

Pools hold random blocks; the tables are a random permutation of block ids, with the entries past a row's last
block naming arbitrary blocks (never visible). float32, tolerance 1e-5 (as test_attention_kernels.py).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.kernels.attention import attention
from moejax.kernels.attention.paged import gather_blocks, paged_attention
from moejax.kernels.lowering import TRITON, cuda_module
from moejax.kernels.platform import on_gpu

P = 16  # moejax.models.kv_pool.BLOCK


def make(rng, *, B, T, Hkv, G, widths, Dv, offsets, mla=False, extra_blocks=3):
    """q, key parts, v pool (MLA: the first key part), tables and offsets for rows at `offsets`."""
    NB = -(-(max(offsets) + T) // P)
    N = B * NB + extra_blocks

    def f(*s):
        return jnp.asarray(rng.standard_normal(s), jnp.float32)

    q = f(B, T, Hkv * G, sum(widths))
    parts = tuple(f(N, P, Hkv, w) for w in widths)
    v = parts[0] if mla else f(N, P, Hkv, Dv)
    table = rng.permutation(N)[:B * NB].reshape(B, NB)
    for b, off in enumerate(offsets):  # blocks past the row's last query: any block of the pool
        used = -(-(off + T) // P)
        table[b, used:] = rng.integers(0, N, NB - used)
    return q, parts, v, jnp.asarray(table, jnp.int32), jnp.asarray(offsets, jnp.int32)


CASES = {
    # decode, GQA, head dim 8 (pools padded to 16), rows at different offsets, sinks
    "gqa_decode_sinks": (dict(B=3, T=1, Hkv=2, G=2, widths=(8,), Dv=8, offsets=(0, 17, 90)),
                         dict(sinks=True)),
    # chunks reading earlier blocks; a sliding window that skips row 0's first key tile (of 64 keys) and hides
    # all of it from row 1's last queries (at 65, 66), though they visit it
    "gqa_chunk_window": (dict(B=3, T=5, Hkv=2, G=2, widths=(16,), Dv=16, offsets=(70, 62, 3)),
                         dict(sliding_window=3)),
    # MLA absorbed: keys latent (32) || rope (8), value = latent; 160 rows = two row blocks; window and sinks
    "mla_chunk": (dict(B=2, T=40, Hkv=1, G=4, widths=(32, 8), Dv=32, offsets=(50, 0), mla=True),
                  dict(sliding_window=45, sinks=True, scale=0.3)),
}


@pytest.mark.parametrize("backend", ["xla", "cpu", "pallas_interpret"] +
                         (["pallas"] if on_gpu() else []))  # compiled: GPU
@pytest.mark.parametrize("case", list(CASES))
def test_paged_matches_dense_reference(case, backend):
    shape, kw = CASES[case]
    rng = np.random.default_rng(sorted(CASES).index(case))
    q, parts, v, table, offsets = make(rng, **shape)
    kw = dict(kw)
    if kw.pop("sinks", False):
        kw["sinks"] = jnp.asarray(rng.standard_normal(q.shape[2]), jnp.float32)
    out = jax.jit(functools.partial(paged_attention, backend=backend, **kw))(q, parts, v, table, offsets)
    k_dense = jnp.concatenate([gather_blocks(p, table) for p in parts], axis=-1)
    ref = attention(q, k_dense, gather_blocks(v, table), q_offset=offsets, backend="reference", **kw)
    assert out.shape == ref.shape and out.dtype == q.dtype
    err = np.linalg.norm(np.asarray(out) - np.asarray(ref)) / np.linalg.norm(np.asarray(ref))
    assert err <= 1e-5, err


def _visible_columns(offsets, T, window, NB):
    """Each row's table columns its queries can see: from its first query's window start to its last query."""
    cols = []
    for off in offsets:
        lo = 0 if window is None else max(off - window + 1, 0) // P
        cols.append(range(min(lo, (off + T - 1) // P), min((off + T - 1) // P, NB - 1) + 1))
    return cols


LONG = dict(B=3, T=1, Hkv=2, G=2, widths=(8,), Dv=8, offsets=(0, 150, 300))  # 19 table columns, three rows apart


@pytest.mark.parametrize("columns", [None, 1, 3])  # the default (8), one, and one that divides nothing
@pytest.mark.parametrize("case", list(CASES) + ["long_decode_window"])
def test_xla_reads_only_the_blocks_each_row_sees(case, columns):
    """Every pool block no row's queries can see is NaN (a read of one would poison its row through 0 x NaN): the
    XLA path still matches the reference computed on the clean pool."""
    from moejax.kernels.attention import paged_xla
    shape, kw = CASES[case] if case in CASES else (LONG, dict(sliding_window=40, sinks=True))
    rng = np.random.default_rng(7)
    q, parts, v, table, offsets = make(rng, **shape)
    kw = dict(kw)
    sinks = jnp.asarray(rng.standard_normal(q.shape[2]), jnp.float32) if kw.pop("sinks", False) else None
    window, scale = kw.get("sliding_window"), kw.get("scale", 1 / np.sqrt(q.shape[-1]))
    k_dense = jnp.concatenate([gather_blocks(p, table) for p in parts], axis=-1)
    ref = attention(q, k_dense, gather_blocks(v, table), q_offset=offsets, sinks=sinks, backend="reference", **kw)
    seen = {int(table[b, c]) for b, cols in enumerate(_visible_columns(shape["offsets"], shape["T"], window,
                                                                       table.shape[1])) for c in cols}
    unseen = np.array([i for i in range(v.shape[0]) if i not in seen])
    poison = lambda a: a.at[unseen].set(jnp.nan)  # noqa: E731
    mla = shape.get("mla", False)
    parts_p = tuple(poison(p) for p in parts)
    out = paged_xla.attention(q, parts_p, parts_p[0] if mla else poison(v), table, offsets, sinks, window=window,
                              scale=float(scale), columns=columns)
    assert len(unseen) > 0 and np.isfinite(np.asarray(out)).all()
    err = np.linalg.norm(np.asarray(out) - np.asarray(ref)) / np.linalg.norm(np.asarray(ref))
    assert err <= 1e-5, err


DECODE_CASES = {
    # B=3, NB=5, Hq=6 over Hkv=2; rows of lengths 1, 41 and 76; a window that hides row 2's first blocks; sinks
    "gqa_odd_window_sinks": (dict(B=3, T=1, Hkv=2, G=3, widths=(8,), Dv=8, offsets=(0, 40, 75)),
                             dict(sliding_window=20, sinks=True)),
    # MLA absorbed decode: keys latent (32) || rope (8) from two pools, value = the latent pool itself
    "mla_two_parts_sinks": (dict(B=3, T=1, Hkv=1, G=4, widths=(32, 8), Dv=32, offsets=(0, 33, 70), mla=True),
                            dict(sinks=True, scale=0.3)),
    # a few queries per row (speculative decode), rows apart
    "gqa_three_queries": (dict(B=3, T=3, Hkv=2, G=3, widths=(8,), Dv=8, offsets=(0, 29, 61)), dict()),
    # bfloat16 pools (gathered as uint16 inside the loop)
    "gqa_bf16": (dict(B=3, T=1, Hkv=2, G=3, widths=(8,), Dv=8, offsets=(0, 40, 75), dtype=jnp.bfloat16),
                 dict(sinks=True)),
}


@pytest.mark.parametrize("columns", [None, 2])  # the default (one step at these sizes); a loop of 3 steps, the last cut
@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_cpu_backend_decode_reads_only_visible_blocks(case, columns):
    """The "cpu" backend against dense attention over each row's gathered keys, with every pool block no row's
    queries can see set to NaN (a read of one would poison its row through 0 x NaN)."""
    from moejax.kernels.attention import paged_cpu
    shape, kw = DECODE_CASES[case]
    shape = dict(shape)
    dtype = shape.pop("dtype", jnp.float32)
    rng = np.random.default_rng(sorted(DECODE_CASES).index(case))
    q, parts, v, table, offsets = make(rng, **shape)
    mla = shape.get("mla", False)
    q, parts = q.astype(dtype), tuple(p.astype(dtype) for p in parts)
    v = parts[0] if mla else v.astype(dtype)
    kw = dict(kw)
    sinks = jnp.asarray(rng.standard_normal(q.shape[2]), jnp.float32) if kw.pop("sinks", False) else None
    window, scale = kw.get("sliding_window"), kw.get("scale", 1 / np.sqrt(q.shape[-1]))
    up = lambda a: a.astype(jnp.float32)  # noqa: E731

    @jax.jit
    def dense(q, parts, v, table, offsets, sinks):
        k = jnp.concatenate([gather_blocks(up(p), table) for p in parts], axis=-1)
        return attention(up(q), k, gather_blocks(up(v), table), q_offset=offsets, sinks=sinks, backend="reference",
                         **kw)
    ref = dense(q, parts, v, table, offsets, sinks)
    seen = {int(table[b, c]) for b, cols in enumerate(_visible_columns(shape["offsets"], shape["T"], window,
                                                                       table.shape[1])) for c in cols}
    unseen = np.array([i for i in range(v.shape[0]) if i not in seen])
    poison = lambda a: a.at[unseen].set(jnp.nan)  # noqa: E731
    parts_p = tuple(poison(p) for p in parts)
    run = jax.jit(functools.partial(paged_cpu.attention, window=window, scale=float(scale), columns=columns))
    out = run(q, parts_p, parts_p[0] if mla else poison(v), table, offsets, sinks)
    assert out.shape == ref.shape and out.dtype == dtype
    assert len(unseen) > 0 and np.isfinite(np.asarray(up(out))).all()
    err = np.linalg.norm(np.asarray(up(out)) - np.asarray(ref)) / np.linalg.norm(np.asarray(ref))
    assert err <= (1e-5 if dtype == jnp.float32 else 1e-2), err


@pytest.mark.parametrize("B,T,Hq,Hkv,widths,Dv,NB,extra", [
    (4, 1, 8, 2, (128,), 128, 64, dict(sinks=True, sliding_window=128)),  # GQA decode
    (2, 64, 8, 2, (128,), 128, 32, dict()),  # GQA chunk
    (2, 1, 16, 1, (512, 64), 512, 32, dict(mla=True)),  # DeepSeek MLA absorbed decode: latent || rope, v = latent
])
def test_paged_pallas_lowers_to_triton_for_cuda(B, T, Hq, Hkv, widths, Dv, NB, extra):
    bf16, i32, N = jnp.bfloat16, jnp.int32, B * NB
    extra = dict(extra)
    mla = extra.pop("mla", False)
    sinks = jnp.zeros(Hq, jnp.float32) if extra.pop("sinks", False) else None

    def fn(q, parts, v, table, offsets):
        return paged_attention(q, parts, parts[0] if mla else v, table, offsets, sinks=sinks, backend="pallas",
                               **extra)
    sd = jax.ShapeDtypeStruct
    parts = tuple(sd((N, P, Hkv, w), bf16) for w in widths)
    assert TRITON in cuda_module(fn, sd((B, T, Hq, sum(widths)), bf16), parts, sd((N, P, Hkv, Dv), bf16),
                                 sd((B, NB), i32), sd((B,), i32))


def test_bad_inputs_name_the_problem():
    q, parts, v, table, offsets = make(np.random.default_rng(0), B=1, T=2, Hkv=2, G=2, widths=(8,), Dv=8,
                                       offsets=(0,))
    with pytest.raises(ValueError, match="widths do not add up"):
        paged_attention(q, (parts[0][..., :4],), v, table, offsets)
    with pytest.raises(ValueError, match="block table rows"):
        paged_attention(q, parts, v, jnp.concatenate([table, table]), offsets)
