"""Greedy decode of a fixture model driven layer by layer with its KV cache on the host and attention there
(moejax.lightning), next to the oracles: the resident model's `generate`, transformers' greedy tokens (the fixture's
reference.npz) and the single-device float32 full forward without a cache. Used in process by
tests/lightning/test_host_attention.py (one device: host and accelerator the same) and by tests/lightning_worker.py
(two devices: the accelerator is the last, the host cpu:0)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from conftest import fixture_dir, reference
from flax import nnx

import moejax
from moejax.kernels.backends import Kernels
from moejax.lightning import host_kv
from moejax.lightning.host_attention import HostAttention
from moejax.models.moe import MoEBlock

# One fixture per attention variant: GQA with q/k norm, with a sliding window, with sinks and alternating windows,
# with biases; MLA with and without q_lora.
FAMILIES = ["qwen3_moe", "mixtral", "gpt_oss", "qwen2_moe", "deepseek_v3", "deepseek_v2_lite"]
NEW_TOKENS = 4  # the prefill's token and three decode steps (prompts of 5, 11 and 3 tokens: windows of 5 and 6 slide)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _run(fn, graphdef, state, *args):
    return fn(nnx.merge(graphdef, state), *args)


def _prefill(model, ids, positions):
    return model(ids, positions, model.init_cache(*ids.shape), read_cache=False)


def _embed(model, tokens, positions):
    return model.embed_inputs(tokens, positions)


def _head(model, x):
    return model.head(x, jnp.zeros((x.shape[0],), jnp.int32))


def _attn_norm(layer, x):
    return layer.attn_norm(x)


def _ffn_half(layer, x, h):
    """DecoderLayer's second half: the residual after attention, then the MLP on its normalised input."""
    x = x + h
    y = layer.mlp_norm(x)
    return x + (layer.mlp(y, Kernels().experts) if isinstance(layer.mlp, MoEBlock) else layer.mlp(y))


def _unsplit_attention(layer, x, at, cache):
    return layer.attn(x, at, cache)


def _max_diff(out, ref) -> tuple[float, float]:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    err = float(np.max(np.abs(out - ref)))
    return err, err / float(np.max(np.abs(ref)))


def host_greedy(model, prompts: list[list[int]], new_tokens: int, host: jax.Device) -> dict:
    """Greedy tokens of `model` (its weights on the accelerator) with the KV on `host`: the prefill on the accelerator
    and its KV written to the host cache, then each decode step layer by layer through HostAttention. Beside it, each
    layer's unsplit attention on the accelerator over its own cache (same inputs) measures the split's error."""
    B, T = len(prompts), max(map(len, prompts))
    lengths = np.array([len(p) for p in prompts], np.int32)
    ids = np.zeros((B, T), np.int32)
    for r, p in enumerate(prompts):
        ids[r, : len(p)] = p
    positions = np.tile(np.arange(T, dtype=np.int32), (B, 1))
    graphdef, state = nnx.split(model)
    logits, device_cache = _run(_prefill, graphdef, state, ids, positions)
    step_logits = [np.asarray(logits)[np.arange(B), lengths - 1]]
    cache = host_kv.write_prefill(host_kv.allocate(model, B, T + new_tokens, host), device_cache)
    unsplit_cache = [{n: jnp.pad(a, [(0, 0), (0, new_tokens)] + [(0, 0)] * (a.ndim - 2)) for n, a in c.items()}
                     for c in device_cache]
    layers = [nnx.split(layer) for layer in model.layers]
    attns = [HostAttention(layer.attn, host) for layer in model.layers]
    tokens = step_logits[0].argmax(-1).astype(np.int32)
    out, h_err = [tokens], (0.0, 0.0)
    for step in range(1, new_tokens):
        pos = (lengths + step - 1)[:, None]
        x, at = _run(_embed, graphdef, state, tokens[:, None], pos)
        for i, (layer_def, layer_state) in enumerate(layers):
            h_in = _run(_attn_norm, layer_def, layer_state, x)
            h, cache[i] = attns[i](h_in, at, cache[i], pos)
            h_ref, unsplit_cache[i] = _run(_unsplit_attention, layer_def, layer_state, h_in, at, unsplit_cache[i])
            h_err = max(h_err, _max_diff(h, h_ref))
            x = _run(_ffn_half, layer_def, layer_state, x, h)
        step_logits.append(np.asarray(_run(_head, graphdef, state, x)))
        tokens = step_logits[-1].argmax(-1).astype(np.int32)
        out.append(tokens)
    kv_err = max(float(np.max(np.abs(np.asarray(cache[i][n]) - np.asarray(unsplit_cache[i][n]))))
                 for i in range(len(cache)) for n in cache[i])
    return dict(tokens=np.stack(out, 1), logits=np.stack(step_logits, 1), cache=cache, attns=attns, h_err=h_err,
                kv_err=kv_err, output_devices={str(d) for d in h.devices()})


def oracle_logits(engine, prompts: list[list[int]], tokens: np.ndarray) -> np.ndarray:
    """The resident single-device float32 forward without a cache over prompt + tokens: at each prompt's end and each
    new token, the next token's logits [B, new_tokens, V]."""
    n = tokens.shape[1]
    seqs = [p + tokens[r, :-1].tolist() for r, p in enumerate(prompts)]
    ids = np.zeros((len(seqs), max(map(len, seqs))), np.int32)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = s
    full = engine.logits(ids)
    return np.stack([full[r, len(p) - 1: len(p) - 1 + n] for r, p in enumerate(prompts)])


def run_family(name: str, accelerator: jax.Device, host: jax.Device) -> dict:
    """Every number the tests check for one fixture, its weights placed on `accelerator`, its KV on `host`."""
    ref = reference(name)
    prompts = [ref[f"prompt_{i}"].tolist() for i in range(3)]
    engine = moejax.load(fixture_dir(name), dtype="float32")
    # the layer-by-layer model lightning runs (a resident engine's holds stacked runs of layers)
    graphdef, state = nnx.split(nnx.merge(engine.graphdef, engine.params).unstacked())
    model = nnx.merge(graphdef, jax.device_put(state, accelerator))
    run = host_greedy(model, prompts, NEW_TOKENS, host)
    logits_err = _max_diff(run["logits"], oracle_logits(engine, prompts, run["tokens"]))
    cache_arrays = [a for layer in run["cache"] for a in layer.values()]
    return dict(tokens=run["tokens"].tolist(), resident=engine.generate(prompts, NEW_TOKENS),
                transformers=[ref[f"greedy_{i}"][:NEW_TOKENS].tolist() for i in range(3)],
                logits_abs=logits_err[0], logits_rel=logits_err[1], attention_abs=run["h_err"][0],
                attention_rel=run["h_err"][1], kv_abs=run["kv_err"],
                cache_shardings=sorted({str(a.sharding) for a in cache_arrays}),
                cache_committed=all(a.committed for a in cache_arrays),
                cache_bytes=host_kv.cache_bytes(run["cache"]),
                attention_devices=sorted({str(a.device) for a in run["attns"]}),
                core_devices=sorted({str(d) for a in run["attns"] for leaf in jax.tree.leaves(a.core)
                                     for d in leaf.devices()}),
                output_devices=sorted(run["output_devices"]))
