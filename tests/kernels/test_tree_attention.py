"""Blocked tree attention (the key ranges packing.tree_span chooses) against the dense tree-mask reference
(models.attention.attend), on forests packed by the real packer: shared prefixes, siblings, multi-token
candidates, several trees in a row, prior keys from the prefix cache, sliding windows, sinks and pad rows."""
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.kernels.attention import blocked
from moejax.models.attention import TreeMask, attend, tree_attend
from moejax.sched.packing import PAD_NODE, ScoreSeq, assemble, pack_row
from moejax.sched.prefix_cache import PrefixCache


def _seqs(rng, tag, prefix_len, siblings, suffix_len, candidates, cand_len):
    prefix = rng.integers(1, 500, prefix_len).tolist()
    out = []
    for s in range(siblings):
        ctx = prefix + rng.integers(1, 500, suffix_len).tolist()
        for c in range(candidates):
            cand = rng.integers(1, 500, cand_len).tolist()
            reads = tuple((len(ctx) - 1 + k, cand[k], (tag, s, c)) for k in range(cand_len))
            out.append(ScoreSeq(tuple(ctx + cand[:-1]), len(ctx), (tag, s), reads))
    return out


def _forests(seed):
    """Rows (list of ScoreSeq lists) of several shapes, and a prefix cache that already holds some prefixes."""
    rng = np.random.default_rng(seed)
    one_prefix = _seqs(rng, "a", 400, 40, 9, 3, 2)  # one long shared prefix, many short siblings
    forest = _seqs(rng, "b", 150, 1, 0, 1, 1) + _seqs(rng, "c", 90, 3, 40, 2, 3) + _seqs(rng, "d", 130, 1, 5, 4, 1)
    return [[one_prefix], [forest, _seqs(rng, "e", 64, 2, 7, 2, 2)]]


def _batch(rows, cache):
    packed = [pack_row(r, cache, want_store=lambda h: True) for r in rows]
    arrays, _, span = assemble(packed, 64)
    return arrays, span


def _tree(arrays, span):
    if "prior_pos" not in arrays:
        keys = {n: arrays[f"q_{n}"] for n in ("pre", "post")} | {"pos": arrays["positions"]}
    else:
        keys = {n: np.concatenate([arrays[f"prior_{n}"], arrays[f"q_{n}" if n != "pos" else "positions"]], 1)
                for n in ("pre", "post", "pos")}
    return TreeMask(jnp.asarray(arrays["q_pre"]), *(jnp.asarray(keys[n]) for n in ("pre", "post", "pos")), *span)


def _visible(tree, q_pos, window):
    dist = q_pos[:, :, None] - np.asarray(tree.k_pos)[:, None, :]
    vis = dist >= 0
    if window is not None:
        vis &= dist < window
    q_pre = np.asarray(tree.q_pre)[:, :, None]
    return vis & (np.asarray(tree.k_pre)[:, None, :] <= q_pre) & (q_pre < np.asarray(tree.k_post)[:, None, :])


def _cases():
    """(rows, cache) per case: each forest without a cache, then again after a batch stored its prefixes."""
    out = []
    for i, rows in enumerate(_forests(0)):
        out.append((f"forest{i}", rows, None))
        cache = PrefixCache(64)
        cache.begin_batch()
        _batch(rows[:1], cache)  # stores the blocks of the first row's contexts: they become prior keys
        cache.begin_batch()
        out.append((f"forest{i}+prior", rows, cache))
    return out


@pytest.mark.parametrize("name,rows,cache", _cases(), ids=[c[0] for c in _cases()])
def test_span_holds_every_visible_key(name, rows, cache):
    """Every (query, key) pair the tree mask allows lies in the ranges the blocked kernel reads; and the span is
    narrower than the causal triangle where trees allow it."""
    arrays, span = _batch(rows, cache)
    tree = _tree(arrays, span)
    T = arrays["tokens"].shape[1]
    P = tree.k_pos.shape[1] - T
    vis = _visible(tree, arrays["positions"], None)
    read = np.zeros(vis.shape[1:], bool)
    for qs, qe, ranges in blocked.tree_blocks(T, P, span.head, span.window):
        for lo, hi in ranges:
            read[qs:qe, lo:hi] = True
    real = arrays["q_pre"] != PAD_NODE  # pad queries see other pads or nothing: nothing reads them
    assert not (vis & ~read[None])[real].any(), f"span {span} misses visible keys"
    assert real.any() and (vis.sum(-1)[real] > 0).all()  # every real query sees at least itself
    if name.startswith("forest0"):  # one prefix under many siblings: at most a head and a short window
        assert span.window is not None and span.window <= 256 and span.head <= 448, span


@pytest.mark.parametrize("window,sinks", [(None, False), (24, False), (None, True), (24, True)])
@pytest.mark.parametrize("name,rows,cache", _cases(), ids=[c[0] for c in _cases()])
def test_blocked_tree_attention_equals_dense(name, rows, cache, window, sinks):
    arrays, span = _batch(rows, cache)
    tree = _tree(arrays, span)
    B, T = arrays["tokens"].shape
    S = tree.k_pos.shape[1]
    rng = np.random.default_rng(1)
    Hq, Hkv, D = 4, 2, 16
    q = jnp.asarray(rng.standard_normal((B, T, Hq, D)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, S, Hkv, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, S, Hkv, D)), jnp.float32)
    s = jnp.asarray(rng.standard_normal(Hq), jnp.float32) if sinks else None
    pos = jnp.asarray(arrays["positions"])
    want = attend(q, k, v, pos, tree.k_pos, 0.25, window, s, tree)
    got = tree_attend(q, k, v, pos, 0.25, tree, window, s)
    real = arrays["q_pre"] != PAD_NODE  # pad queries compute garbage that nothing reads
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], rtol=2e-5, atol=2e-6)
    assert np.isfinite(np.asarray(got)).all()
