"""One decoder layer cut where CGOPipe's tasks cut it (moejax.lightning.schedule), each part a function of the
layer's (graphdef, state) for moejax.offload.layered_steps.Layer to jit per layer structure, except `host_attend`, which
is jitted where its arguments are (the host) and takes the attention core, not the layer.

    pre_attention   PREATTN on the device: the norm and the QKV projection -> (query, this call's KV)
    own_attention   PREATTN of a chunk that starts every row's sequence: attention over its own keys on the device
                    (MoE-Lightning's prefill runs on the GPU, §4 fn. 7) -> (core output, this call's KV)
    local_attention PREATTN of a layer whose cache is on the device (r_c): store and attend there -> (output, cache)
    host_attend     CPUATTN on the host: store the new KV in the host cache, attention over it -> (output, cache)
    post_route      POSTATTN's first half: the output projection, the residual, the MLP norm and the router
    post_dense      POSTATTN of a dense layer: the output projection, the residual and the MLP
The routed experts and the shared expert then run through moejax.offload.layered_steps.run_moe."""
from __future__ import annotations

import functools

import jax
from flax import nnx

from moejax.models.attention import AttentionCore, Positions, store_kv
from moejax.models.kv_pool import PagedCache

Cache = dict[str, jax.Array] | PagedCache


def pre_attention(graphdef: nnx.GraphDef, state: nnx.State, x: jax.Array, at: Positions
                  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    layer = nnx.merge(graphdef, state)
    return layer.attn.pre_attention(layer.attn_norm(x), at)


def own_attention(graphdef: nnx.GraphDef, state: nnx.State, x: jax.Array, at: Positions, *, backend: str
                  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Every row starts at position 0: its keys are this call's, at slot = position, as a cache of their own."""
    layer = nnx.merge(graphdef, state)
    q, new = layer.attn.pre_attention(layer.attn_norm(x), at)
    return layer.attn.core.attend(q, new, at.positions[:, 0], backend), new


def local_attention(graphdef: nnx.GraphDef, state: nnx.State, x: jax.Array, at: Positions, cache: Cache, *,
                    backend: str) -> tuple[jax.Array, Cache]:
    layer = nnx.merge(graphdef, state)
    q, new = layer.attn.pre_attention(layer.attn_norm(x), at)
    cache = store_kv(cache, at.positions, new)
    return layer.attn.core.attend(q, cache, at.positions[:, 0], backend), cache


@functools.partial(jax.jit, donate_argnums=0, static_argnames=("backend", "store_only"))
def host_attend(kv: dict[str, jax.Array], q: jax.Array | None, new: dict[str, jax.Array], positions: jax.Array,
                paged: tuple[jax.Array, jax.Array] | None, core: AttentionCore, *, backend: str,
                store_only: bool = False) -> tuple[jax.Array | None, dict[str, jax.Array]]:
    """The host's task, jitted on the host (only the KV arrays are donated): this call's KV stored, then, unless
    store_only, the core's attention over the cache. kv: per-row caches (slot = position) when `paged` is None, else
    the pool, read and written through paged = (block tables, slots)."""
    cache: Cache = kv if paged is None else PagedCache(kv, *paged)
    cache = store_kv(cache, positions, new)
    # `backend` is a paged kernel's (the pool's); per-row caches (Engine.generate) take the dense op's XLA form
    out = None if store_only else core.attend(q, cache, positions[:, 0],  # type: ignore[arg-type]
                                              backend if paged is not None else "xla")
    return out, cache.pool if isinstance(cache, PagedCache) else cache


def post_route(graphdef: nnx.GraphDef, state: nnx.State, x: jax.Array, o: jax.Array
               ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """-> (residual after attention, the MoE input [B, T, D], expert ids [N, k], weights [N, k])."""
    layer = nnx.merge(graphdef, state)
    x = x + layer.attn.post_attention(o)
    y = layer.mlp_norm(x)
    idx, weights = layer.mlp.route_tokens(y.reshape(-1, y.shape[-1]))
    return x, y, idx, weights


def post_dense(graphdef: nnx.GraphDef, state: nnx.State, x: jax.Array, o: jax.Array) -> jax.Array:
    layer = nnx.merge(graphdef, state)
    x = x + layer.attn.post_attention(o)
    return x + layer.mlp(layer.mlp_norm(x))
