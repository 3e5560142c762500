"""Block pool for the prefix KV cache: per layer, the attention cache layout with batch = block and length =
BLOCK tokens. The host-side table (which hash lives in which block) is in moejax.sched.prefix_cache."""
from __future__ import annotations

import jax.numpy as jnp

BLOCK = 16


def gather(pool, block_ids):
    """pool (list per layer of {name: [N, BLOCK, ...]}), block_ids int [B, NP] -> per-layer [B, NP*BLOCK, ...]."""
    B, NP = block_ids.shape
    flat = block_ids.reshape(-1)
    return [{name: a[flat].reshape(B, NP * BLOCK, *a.shape[2:]) for name, a in layer.items()} for layer in pool]


def store(pool, keys, block_ids, src):
    """Copy tokens of `keys` (per-layer {name: [B, S, ...]}) into pool blocks: block_ids [B, NS] (an id >= the
    pool size is skipped), src [B, NS, BLOCK] = the key index of each token of each block."""
    B, NS, _ = src.shape
    flat_ids = block_ids.reshape(-1)
    out = []
    for layer_pool, layer_keys in zip(pool, keys):
        new = {}
        for name, a in layer_pool.items():
            k = layer_keys[name]
            idx = src.reshape((B, NS * BLOCK) + (1,) * (k.ndim - 2))
            blocks = jnp.take_along_axis(k, idx, axis=1).reshape(B * NS, BLOCK, *a.shape[2:])
            new[name] = a.at[flat_ids].set(blocks.astype(a.dtype), mode="drop")
        out.append(new)
    return out


def concat_prior(prior, new):
    """Keys [B, P, ...] of earlier tokens followed by a call's own keys [B, T, ...]."""
    return jnp.concatenate([prior.astype(new.dtype), new], axis=1)


def concat_keys(prior, new):
    """Per-layer keys of a packed call: prior keys (or None) followed by the call's own keys."""
    if prior is None:
        return new
    return [{name: concat_prior(p[name], n[name]) for name in n} for p, n in zip(prior, new)]
