"""Attention blocks: GQA/MHA (biases, q/k norm, sinks, sliding window) and DeepSeek MLA.

Every block takes `x [B, T, D]`, `Positions` (absolute positions [B, T], consecutive within a row, and their
rotary angles), the attention backend (moejax.kernels.attention) and either
- an optional per-layer cache whose slot index equals the token position -> `(out [B, T, D], new_cache)`, or
- a `PagedCache` (moejax.models.kv_pool: block pool, block tables, write slots) -> `(out, the cache with this call's
  keys written)`; attention reads every key through the block tables, or only this call's keys when
  `read_cache` is False (a chunk that starts every row's sequence), or
- a `TreeMask` (Positions.tree) and optional `prior` keys (KV of earlier tokens, cache layout [B, P, ...]) for packed
  token trees -> `(out, new)` where `new` holds this call's keys in cache layout (to store them for reuse).

A cached call (dict cache or PagedCache, read_cache) runs in three stages that a pipeline may place on different
devices (MoE-Lightning's CGOPipe: attention on the host CPU, the rest on the accelerator):
`pre_attention(x, at) -> (query, new KV)`, `store_kv(cache, positions, new)` + `AttentionCore.attend(query, cache,
q_offset)` (a pure function of its arguments, for any device), and `post_attention(core output) -> out`.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from moejax.config import ModelConfig
from moejax.kernels import invariant
from moejax.kernels.attention import attention, blocked
from moejax.kernels.attention.paged import paged_attention
from moejax.kernels.precision import f32_einsum
from moejax.models.kv_pool import PagedCache, concat_prior
from moejax.models.layers import RMSNorm, apply_rope

_f32 = jnp.float32
Cache = dict[str, jax.Array] | PagedCache | None  # a layer's: its own arrays, a paged pool's view, or none


def _dense(shape: tuple[int, ...], dtype: DTypeLike) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, dtype))


def _proj(x: jax.Array, w: nnx.Param, b: nnx.Param | None = None) -> jax.Array:
    y = f32_einsum("btd,df->btf", x, w[...])
    if b is not None:
        y = y + b[...].astype(_f32)
    return y.astype(x.dtype)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["q_pre", "k_pre", "k_post", "k_pos"],
                   meta_fields=["head", "window"])
@dataclasses.dataclass(frozen=True)
class TreeMask:
    """Visibility for rows that pack token trees (shared prefixes, siblings, candidates) and forests of them.
    Nodes are numbered in DFS preorder and node n spans [pre_n, post_n) over its subtree, so key j is visible to
    query i when j's node is an ancestor-or-self of i's node: k_pre[j] <= q_pre[i] < k_post[j]; positions then
    make it causal inside a node. Keys are the prior keys followed by this call's tokens.
    head, window (static, from moejax.sched.packing.tree_span): every new key a query at row index i sees lies in
    [0, head) or within `window` keys before the end of i's query block (None: anywhere before it), so
    attention reads only those (moejax.kernels.attention.blocked.tree_blocks)."""
    q_pre: jax.Array  # [B, T]
    k_pre: jax.Array  # [B, S]
    k_post: jax.Array  # [B, S]
    k_pos: jax.Array  # [B, S]
    head: int = 0
    window: int | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Positions:
    """Where a step's tokens sit, the same for every layer (MoEModel.embed_inputs makes it): positions [B, T], their
    rotary cos and sin, and for rows that pack token trees the TreeMask of which keys each token sees (else None)."""
    positions: jax.Array
    cos: jax.Array
    sin: jax.Array
    tree: TreeMask | None = None


def tree_attend(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, scale: float, tree: TreeMask,
                window: int | None = None, sinks: jax.Array | None = None) -> jax.Array:
    """`attend` over a packed tree, reading only the key ranges the tree's static span allows (blocked)."""
    if invariant.active():  # keys one at a time in key order, whatever the pack (batch_invariant)
        return invariant.tree_attention(q, k, v, q_pos, scale, tree.k_pos, tree.q_pre, tree.k_pre, tree.k_post,
                                        window, sinks)
    T, S = q.shape[1], k.shape[1]
    P = S - T

    def visible(qs: int, qe: int, idx: jax.Array) -> jax.Array:
        k_pos = tree.k_pos[:, idx]
        dist = q_pos[:, qs:qe, None] - k_pos[:, None, :]
        vis = dist >= 0
        if window is not None:
            vis &= dist < window
        q_pre = tree.q_pre[:, qs:qe, None]
        return vis & (tree.k_pre[:, None, idx] <= q_pre) & (q_pre < tree.k_post[:, None, idx])

    blocks = blocked.tree_blocks(T, P, tree.head, tree.window)
    return blocked.attention(q, k, v, blocks, visible, scale, sinks)[0]


def attend(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array, scale: float,
           window: int | None = None, sinks: jax.Array | None = None, tree: TreeMask | None = None) -> jax.Array:
    """Causal attention with GQA head groups over explicit key positions (packed token trees; the kernels take
    consecutive positions only). q [B,T,Hq,D], k [B,S,Hkv,D], v [B,S,Hkv,Dv];
    q_pos [B,T], k_pos [B,S]. A key is visible when k_pos <= q_pos (and k_pos > q_pos - window), and, with a
    `tree`, when its node is an ancestor-or-self of the query's node.
    sinks [Hq]: one extra logit per head that takes softmax mass but contributes no value (GPT-OSS)."""
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    qg = q.reshape(B, T, Hkv, Hq // Hkv, D)
    logits = f32_einsum("btkgd,bskd->bkgts", qg, k) * scale
    dist = q_pos[:, :, None] - k_pos[:, None, :]  # [B,T,S]
    visible = dist >= 0
    if window is not None:
        visible &= dist < window
    if tree is not None:
        q_pre = tree.q_pre[:, :, None]
        visible &= (tree.k_pre[:, None, :] <= q_pre) & (q_pre < tree.k_post[:, None, :])
    logits = jnp.where(visible[:, None, None], logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    if sinks is not None:
        sink = sinks.astype(_f32).reshape(1, Hkv, Hq // Hkv, 1, 1)
        m = jnp.maximum(m, sink)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(logits - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    if sinks is not None:
        denom = denom + jnp.exp(sink - m)
    p = (p / jnp.maximum(denom, 1e-30)).astype(v.dtype)  # a query that sees no key gets 0, not NaN
    out = f32_einsum("bkgts,bskd->btkgd", p, v)
    return out.reshape(B, T, Hq, v.shape[-1]).astype(q.dtype)


def write_cache(cache: jax.Array, positions: jax.Array, new: jax.Array) -> jax.Array:
    """Store new [B,T,...] at slot = position, per sequence."""
    rows = jnp.arange(positions.shape[0])[:, None]
    return cache.at[rows, positions].set(new.astype(cache.dtype), mode="drop")


def cache_positions(cache_len: int, batch: int) -> jax.Array:
    return jnp.broadcast_to(jnp.arange(cache_len, dtype=jnp.int32), (batch, cache_len))


def _paged_backend(backend: str) -> str:
    """The paged kernel's backend for the model's attention backend (cuDNN has no paged form: its `auto`)."""
    return "auto" if backend == "cudnn" else backend


def store_kv(cache: dict[str, jax.Array] | PagedCache, positions: jax.Array, new: dict[str, jax.Array]
             ) -> dict[str, jax.Array] | PagedCache:
    """A cache with new KV {name: [B, T, ...]} stored: a dict cache at slot = position, a PagedCache at its slots."""
    if isinstance(cache, PagedCache):
        return cache.write(new)
    return {name: write_cache(cache[name], positions, new[name]) for name in cache}


@functools.partial(jax.tree_util.register_dataclass, data_fields=["sinks"], meta_fields=["kind", "scale", "window"])
@dataclasses.dataclass(frozen=True)
class AttentionCore:
    """A layer's attention over its KV cache, apart from the projections: its static settings and its sinks, so that
    it runs on whichever device holds the cache and the query (the sinks are an array: copy the core with them).
    kind "gqa": query [B,T,Hq,hd] over {"k", "v"} [.., Hkv, hd]; "mla": the absorbed query [B,T,H,R+r] over
    {"latent" [.., R], "k_rope" [.., r]}, the latent being both the value and the first part of the key."""
    kind: str
    scale: float
    window: int | None = None
    sinks: jax.Array | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("gqa", "mla"):
            raise ValueError(f"AttentionCore.kind must be 'gqa' or 'mla', got {self.kind!r}")

    def attend(self, q: jax.Array, cache: dict[str, jax.Array] | PagedCache, q_offset: jax.Array,
               backend: str = "auto") -> jax.Array:
        """Query t of row b at position q_offset[b] + t, over the cache's keys at positions <= its own (this call's
        already stored) -> [B, T, H, hd] (GQA) or the latent output [B, T, H, R] (MLA), in q.dtype."""
        if isinstance(cache, PagedCache):
            pool, table = cache.readable()
            k_parts: tuple[jax.Array, ...]
            if self.kind == "mla":  # the keys are read from the latent and k_rope pools, never concatenated
                lat = pool["latent"][:, :, None]
                k_parts, v = (lat, pool["k_rope"][:, :, None]), lat
            else:
                k_parts, v = (pool["k"],), pool["v"]
            return paged_attention(q, k_parts, v, table, q_offset, sliding_window=self.window,
                                   sinks=self.sinks, scale=self.scale, backend=_paged_backend(backend))
        if self.kind == "mla":
            k = jnp.concatenate([cache["latent"], cache["k_rope"]], -1)[:, :, None, :]
            v = cache["latent"][:, :, None, :]
        else:
            k, v = cache["k"], cache["v"]
        return attention(q, k, v, sliding_window=self.window, sinks=self.sinks, q_offset=q_offset, scale=self.scale,
                         backend=backend)


def cached_attention(block: GQAttention | MLAttention, x: jax.Array, at: Positions,
                     cache: dict[str, jax.Array] | PagedCache, backend: str = "auto"
                     ) -> tuple[jax.Array, dict[str, jax.Array] | PagedCache]:
    """A cached call through the three stages, all on x's device -> (out [B, T, D], the cache with this call's KV)."""
    q, new = block.pre_attention(x, at)
    cache = store_kv(cache, at.positions, new)
    return block.post_attention(block.core.attend(q, cache, at.positions[:, 0], backend)), cache


class GQAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: DTypeLike) -> None:
        D, H, K, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = H, K, hd
        self.scale = cfg.softmax_scale
        self.window = cfg.sliding_window if cfg.layer_types[layer] == "sliding" else None
        self.interleaved = cfg.rope.interleaved
        self.wq, self.wk, self.wv = _dense((D, H * hd), dtype), _dense((D, K * hd), dtype), _dense((D, K * hd), dtype)
        self.wo = _dense((H * hd, D), dtype)
        qkv_b = cfg.qkv_bias
        self.bq = _dense((H * hd,), dtype) if qkv_b else None
        self.bk = _dense((K * hd,), dtype) if qkv_b else None
        self.bv = _dense((K * hd,), dtype) if qkv_b else None
        self.bo = _dense((D,), dtype) if cfg.o_bias else None
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.sinks = nnx.Param(jnp.zeros((H,), _f32)) if cfg.sinks else None

    def init_cache(self, batch: int, length: int, dtype: DTypeLike) -> dict[str, jax.Array]:
        shape = (batch, length, self.num_kv_heads, self.head_dim)
        return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}

    @property
    def core(self) -> AttentionCore:
        return AttentionCore("gqa", self.scale, self.window, None if self.sinks is None else self.sinks[...])

    def pre_attention(self, x: jax.Array, at: Positions) -> tuple[jax.Array, dict[str, jax.Array]]:
        """x [B, T, D] -> (q [B, T, Hq, hd], this call's KV {"k", "v"} [B, T, Hkv, hd]): projections (and biases),
        q/k norm, rope."""
        B, T, _ = x.shape
        q = _proj(x, self.wq, self.bq).reshape(B, T, self.num_heads, self.head_dim)
        k = _proj(x, self.wk, self.bk).reshape(B, T, self.num_kv_heads, self.head_dim)
        v = _proj(x, self.wv, self.bv).reshape(B, T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # both or neither (qk_norm)
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, at.cos, at.sin, self.interleaved), apply_rope(k, at.cos, at.sin, self.interleaved)
        return q, {"k": k, "v": v}

    def post_attention(self, out: jax.Array) -> jax.Array:
        """The core's output [B, T, Hq, hd] -> [B, T, D] (wo and its bias)."""
        B, T = out.shape[:2]
        return _proj(out.reshape(B, T, -1), self.wo, self.bo)

    def __call__(self, x: jax.Array, at: Positions, cache: Cache = None, read_cache: bool = True,
                 prior: dict[str, jax.Array] | None = None, backend: str = "auto") -> tuple[jax.Array, Cache]:
        if at.tree is None and cache is not None and read_cache:
            return cached_attention(self, x, at, cache, backend)
        q, new = self.pre_attention(x, at)
        k, v = new["k"], new["v"]
        sinks = self.sinks[...] if self.sinks is not None else None
        if at.tree is not None:
            keys, values = (k, v) if prior is None else (concat_prior(prior["k"], k), concat_prior(prior["v"], v))
            out = tree_attend(q, keys, values, at.positions, self.scale, at.tree, self.window, sinks)
            return self.post_attention(out), new
        if cache is not None:  # prefill into an empty cache: every key is in this call
            cache = store_kv(cache, at.positions, new)
        out = attention(q, k, v, sliding_window=self.window, sinks=sinks, scale=self.scale, backend=backend)
        return self.post_attention(out), cache


class MLAttention(nnx.Module):
    """Multi-head latent attention. The cache holds the normalised KV latent and the roped shared key
    (as transformers does); cached steps attend in the absorbed form, with W_UK folded into the query
    and W_UV applied after, so the latent is never expanded per head."""

    def __init__(self, cfg: ModelConfig, layer: int, dtype: DTypeLike) -> None:
        D, H = cfg.hidden_size, cfg.num_heads
        self.num_heads, self.nope, self.rope_dim = H, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.v_dim, self.rank = cfg.v_head_dim, cfg.kv_lora_rank
        self.scale = cfg.softmax_scale
        self.interleaved = cfg.rope.interleaved
        qk = self.nope + self.rope_dim
        bias = cfg.mla_bias
        if cfg.q_lora_rank:
            self.wq: nnx.Param | None = None
            self.wq_a: nnx.Param | None = _dense((D, cfg.q_lora_rank), dtype)
            self.bq_a = _dense((cfg.q_lora_rank,), dtype) if bias else None
            self.q_a_norm: RMSNorm | None = RMSNorm(cfg.q_lora_rank, 1e-6, dtype)
            self.wq_b: nnx.Param | None = _dense((cfg.q_lora_rank, H * qk), dtype)
        else:
            self.wq = _dense((D, H * qk), dtype)
            self.wq_a = self.bq_a = self.q_a_norm = self.wq_b = None
        self.wkv_a = _dense((D, self.rank + self.rope_dim), dtype)
        self.bkv_a = _dense((self.rank + self.rope_dim,), dtype) if bias else None
        self.kv_a_norm = RMSNorm(self.rank, 1e-6, dtype)
        self.wkv_b = _dense((self.rank, H * (self.nope + self.v_dim)), dtype)
        self.wo = _dense((H * self.v_dim, D), dtype)
        self.bo = _dense((D,), dtype) if bias else None

    def init_cache(self, batch: int, length: int, dtype: DTypeLike) -> dict[str, jax.Array]:
        return {"latent": jnp.zeros((batch, length, self.rank), dtype),
                "k_rope": jnp.zeros((batch, length, self.rope_dim), dtype)}

    @property
    def core(self) -> AttentionCore:
        return AttentionCore("mla", self.scale)

    def pre_attention(self, x: jax.Array, at: Positions) -> tuple[jax.Array, dict[str, jax.Array]]:
        """x [B, T, D] -> (the absorbed query [B, T, H, R + r]: W_UK folded into q_nope, then q_rope; this call's
        {"latent" [B, T, R], "k_rope" [B, T, r]})."""
        q_nope, q_rope, latent, k_rope = self._project(x, at)
        w_uk = self._w_kv()[..., : self.nope]
        q_lat = f32_einsum("bthn,rhn->bthr", q_nope, w_uk).astype(x.dtype)
        return jnp.concatenate([q_lat, q_rope], -1), {"latent": latent, "k_rope": k_rope[:, :, 0]}

    def post_attention(self, o_lat: jax.Array) -> jax.Array:
        """The core's latent output [B, T, H, R] -> [B, T, D] (W_UV, then wo and its bias)."""
        B, T = o_lat.shape[:2]
        out = f32_einsum("bthr,rhv->bthv", o_lat, self._w_kv()[..., self.nope:]).astype(o_lat.dtype)
        return _proj(out.reshape(B, T, -1), self.wo, self.bo)

    def _project(self, x: jax.Array, at: Positions) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """-> q_nope [B, T, H, n], roped q_rope [B, T, H, r], the normalised latent [B, T, R], roped k_rope
        [B, T, 1, r]."""
        B, T, _ = x.shape
        if self.wq is not None:
            q = _proj(x, self.wq)
        else:
            # q_lora_rank: made with wq_a and wq_b
            assert self.q_a_norm is not None and self.wq_a is not None and self.wq_b is not None
            q = _proj(self.q_a_norm(_proj(x, self.wq_a, self.bq_a)), self.wq_b)
        q = q.reshape(B, T, self.num_heads, self.nope + self.rope_dim)
        q_nope, q_rope = q[..., : self.nope], q[..., self.nope:]
        kv = _proj(x, self.wkv_a, self.bkv_a)
        latent = self.kv_a_norm(kv[..., : self.rank])
        k_rope = kv[..., self.rank:][:, :, None, :]
        q_rope = apply_rope(q_rope, at.cos, at.sin, self.interleaved)
        k_rope = apply_rope(k_rope, at.cos, at.sin, self.interleaved)
        return q_nope, q_rope, latent, k_rope

    def _w_kv(self) -> jax.Array:
        """wkv_b as [R, H, n + v]: per head, W_UK (the first n) and W_UV."""
        return self.wkv_b[...].reshape(self.rank, self.num_heads, self.nope + self.v_dim)

    def __call__(self, x: jax.Array, at: Positions, cache: Cache = None, read_cache: bool = True,
                 prior: dict[str, jax.Array] | None = None, backend: str = "auto") -> tuple[jax.Array, Cache]:
        if at.tree is None and cache is not None and read_cache:  # absorbed form over the cached latent
            return cached_attention(self, x, at, cache, backend)
        B, T, _ = x.shape
        q_nope, q_rope, latent, k_rope = self._project(x, at)
        new = {"latent": latent, "k_rope": k_rope[:, :, 0]}
        w_kv = self._w_kv()
        if at.tree is not None:
            if prior is not None:
                latent = concat_prior(prior["latent"], latent)
                k_rope = concat_prior(prior["k_rope"], k_rope[:, :, 0])[:, :, None]
            out = self._expanded(q_nope, q_rope, latent, k_rope, w_kv, tree=at.tree, q_pos=at.positions)
            return _proj(out.reshape(B, T, -1), self.wo, self.bo), new
        if cache is not None:  # expanded form: cheaper when every key is in this call
            cache = store_kv(cache, at.positions, new)
        out = self._expanded(q_nope, q_rope, latent, k_rope, w_kv, backend=backend)
        return _proj(out.reshape(B, T, -1), self.wo, self.bo), cache

    def _expanded(self, q_nope: jax.Array, q_rope: jax.Array, latent: jax.Array, k_rope: jax.Array, w_kv: jax.Array,
                  *, tree: TreeMask | None = None, q_pos: jax.Array | None = None, backend: str = "auto"
                  ) -> jax.Array:
        """Attention with the latent expanded to per-head keys and values (latent [B,S,R], k_rope [B,S,1,r]):
        over a packed tree, or causal over this call's own tokens."""
        B, S, _ = latent.shape
        kv_h = f32_einsum("bsr,rhf->bshf", latent, w_kv).astype(q_nope.dtype)
        k = jnp.concatenate([kv_h[..., : self.nope],
                             jnp.broadcast_to(k_rope, (B, S, self.num_heads, self.rope_dim))], -1)
        q_full, v = jnp.concatenate([q_nope, q_rope], -1), kv_h[..., self.nope:]
        if tree is not None:
            assert q_pos is not None  # given with the tree
            return tree_attend(q_full, k, v, q_pos, self.scale, tree)
        return attention(q_full, k, v, scale=self.scale, backend=backend)  # T == S: queries are every key
