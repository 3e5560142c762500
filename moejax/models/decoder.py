"""Decoder layer and the whole model forward (prefill and cached decode), one math for all families."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from moejax.config import ModelConfig
from moejax.kernels.backends import AUTO_KERNELS, Kernels
from moejax.kernels.precision import f32_dot
from moejax.models.attention import Cache, GQAttention, MLAttention, Positions, TreeMask
from moejax.models.kv_pool import PagedCache
from moejax.models.layer_runs import LayerRun, layer_kinds, layer_runs
from moejax.models.layers import RMSNorm, rope_cos_sin
from moejax.models.moe import LOCAL_EXPERTS, DenseMLP, MoEBlock
from moejax.sampling import StepArray


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: DTypeLike,
                 experts_runner: Callable[[MoEBlock, jax.Array, str], jax.Array] = LOCAL_EXPERTS) -> None:
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.attn = (MLAttention if cfg.attention == "mla" else GQAttention)(cfg, layer, dtype)
        self.mlp: MoEBlock | DenseMLP
        if cfg.is_moe(layer):
            self.mlp = MoEBlock(cfg, dtype, experts_runner)
        else:
            self.mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, dtype)

    def attend(self, x: jax.Array, at: Positions, cache: Cache, prior: dict[str, jax.Array] | None = None, *,
               read_cache: bool, kernels: Kernels) -> tuple[jax.Array, jax.Array, Cache]:
        """The attention half: -> (residual after attention, its normalized input to the MLP, cache). cache, prior:
        this layer's (MoEModel.run_layers)."""
        h, cache = self.attn(self.attn_norm(x), at, cache, read_cache, prior, kernels.attention)
        x = x + h
        return x, self.mlp_norm(x), cache

    def __call__(self, x: jax.Array, at: Positions, cache: Cache, prior: dict[str, jax.Array] | None = None, *,
                 read_cache: bool, kernels: Kernels) -> tuple[jax.Array, Cache]:
        x, y, cache = self.attend(x, at, cache, prior, read_cache=read_cache, kernels=kernels)
        y = self.mlp(y, kernels.experts) if isinstance(self.mlp, MoEBlock) else self.mlp(y)
        return x + y, cache


class MoEModel(nnx.Module):
    """Build under `nnx.eval_shape` (weights are filled by the checkpoint loader or the preset init)."""

    def __init__(self, cfg: ModelConfig, dtype: DTypeLike = jnp.float32,
                 experts_runner: Callable[[MoEBlock, jax.Array, str], jax.Array] = LOCAL_EXPERTS,
                 split_batch: Callable[[jax.Array], jax.Array] | None = None, *, stacked: bool = False) -> None:
        """experts_runner: how every MoE block runs its routed experts (the placement's; see MoEBlock).
        split_batch(x [B, T, D]): a data-parallel layout's constraint splitting hidden states by rows over the
        devices, so attention runs on each device's own sequences (None: no constraint).
        stacked: the layers are held as runs of like layers with stacked weights (moejax.models.layer_runs), and
        every step runs each run as one scan; per-layer caches, keys and pools are then lists per run member with
        a leading [count] axis (`map_layers` applies per-layer code to either)."""
        self.cfg = cfg
        self.split_batch = split_batch
        self.embed = nnx.Param(jnp.zeros((cfg.vocab_size, cfg.hidden_size), dtype))
        self.stacked = stacked
        self.experts_runner = experts_runner
        if stacked:
            self.layer_runs: tuple[LayerRun, ...] = tuple(layer_runs(layer_kinds(cfg)))
            self.runs = nnx.List([nnx.List([_stacked(DecoderLayer(cfg, run.layer(0, j), dtype, experts_runner),
                                                     run.count) for j in range(run.period)])
                                  for run in self.layer_runs])
        else:
            self.layers = nnx.List([DecoderLayer(cfg, i, dtype, experts_runner) for i in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = None if cfg.tie_word_embeddings else nnx.Param(
            jnp.zeros((cfg.hidden_size, cfg.vocab_size), dtype))

    # -- layers, one by one or as runs ------------------------------------------------------------------------
    def layer(self, i: int) -> DecoderLayer:
        """Decoder layer i (of a stacked model: its weights sliced out of the run's stacks)."""
        if not self.stacked:
            return self.layers[i]
        for run, members in zip(self.layer_runs, self.runs, strict=True):
            if i in run.layers:
                repeat, member = run.where(i)
                graphdef, state = nnx.split(members[member])
                return nnx.merge(graphdef, jax.tree.map(lambda a, repeat=repeat: a[repeat], state))
        raise IndexError(f"layer {i} of {self.cfg.num_layers}")

    def stacked_sources(self) -> dict[tuple, tuple[tuple, ...]]:
        """A stacked model's layer parameters: flat path of each stack -> the per-layer paths it stacks, by repeat
        (('runs', r, j, *rest) -> (('layers', i, *rest), ...)); the paths of an unstacked model of the same config."""
        out: dict[tuple, tuple[tuple, ...]] = {}
        for r, (run, members) in enumerate(zip(self.layer_runs, self.runs, strict=True)):
            for j, member in enumerate(members):
                for path, _ in nnx.to_flat_state(nnx.state(member)):
                    out[("runs", r, j, *path)] = tuple(("layers", run.layer(c, j), *path) for c in range(run.count))
        return out

    def unstacked(self) -> MoEModel:
        """This model with one module per layer (a stacked model's weights sliced out of its stacks; inside a jit the
        slices are views): for code that walks `layers` or records per layer (training, the quality bench)."""
        if not self.stacked:
            return self
        dtype = self.embed.dtype
        graphdef, state = nnx.split(nnx.eval_shape(lambda: MoEModel(self.cfg, dtype, self.experts_runner,
                                                                     self.split_batch)))
        mine = dict(nnx.to_flat_state(nnx.state(self)))
        values = {path: var.get_value() for path, var in mine.items() if path[0] != "runs"}
        for stack, layer_paths in self.stacked_sources().items():
            values.update({path: mine[stack].get_value()[c] for c, path in enumerate(layer_paths)})
        flat = list(nnx.to_flat_state(state))
        for path, var in flat:
            var.set_value(values[path])
        return nnx.merge(graphdef, nnx.from_flat_state(flat))

    def map_layers(self, fn: Callable[..., Any], *per_layer: Sequence[Any]) -> list[Any]:
        """fn applied to each layer's entries of per-layer lists (caches, keys, pools): of a stacked model, to each
        run member's stacked entries, vmapped over their leading [count] axis."""
        each = jax.vmap(fn) if self.stacked else fn
        return [each(*entries) for entries in zip(*per_layer, strict=True)]

    def init_cache(self, batch: int, length: int) -> list[dict[str, jax.Array]]:
        dtype = self.embed.dtype
        if not self.stacked:
            return [layer.attn.init_cache(batch, length, dtype) for layer in self.layers]
        return [jax.tree.map(lambda a, n=run.count: jnp.zeros((n, *a.shape), a.dtype),
                             member.attn.init_cache(batch, length, dtype))
                for run, members in zip(self.layer_runs, self.runs, strict=True) for member in members]

    def kv_bytes_per_token(self) -> int:
        """KV cache bytes of one token over every layer (from shapes only: the model may be abstract)."""
        shapes = jax.eval_shape(lambda: self.init_cache(1, 1))
        return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(shapes))

    def __call__(self, tokens: StepArray, positions: StepArray, cache: Sequence[Cache] | None = None, *,
                 read_cache: bool = True, kernels: Kernels = AUTO_KERNELS, gather_idx: StepArray | None = None,
                 tree: TreeMask | None = None, prior: Sequence[dict[str, jax.Array]] | None = None
                 ) -> tuple[jax.Array, list[Cache] | None]:
        """tokens, positions [B, T] -> float32 logits [B, T, V], or only at `gather_idx` ([B] -> [B, V],
        [B, U] -> [B, U, V]), and the per-layer cache.

        With a cache (list per layer) the new keys are written at slot = position; `read_cache=False`
        says the cache held nothing before this call, so attention reads only the new keys.
        With a `tree` (TreeMask) the rows are packed token trees that may attend to `prior` keys (per-layer
        cache-layout arrays [B, P, ...]); the second output is then this call's keys per layer."""
        x, at = self.embed_inputs(tokens, positions, tree)
        x, new_cache = self.run_layers(x, at, cache, read_cache, kernels, prior)
        return self.head(x, gather_idx), (None if cache is None and tree is None else new_cache)

    def run_layers(self, x: jax.Array, at: Positions, cache: Sequence[Cache] | None = None, read_cache: bool = True,
                   kernels: Kernels = AUTO_KERNELS, prior: Sequence[dict[str, jax.Array]] | None = None
                   ) -> tuple[jax.Array, list[Cache]]:
        """Every decoder layer in turn -> (hidden states, per-layer caches or new keys). cache, prior: per layer
        (of a stacked model, per run member)."""
        if self.stacked:
            return self._run_stacked(x, at, cache, read_cache, kernels, prior)
        new_cache = []
        for i, layer in enumerate(self.layers):
            x, c = layer(x, at, None if cache is None else cache[i], None if prior is None else prior[i],
                         read_cache=read_cache, kernels=kernels)
            new_cache.append(c)
        return x, new_cache

    def _run_stacked(self, x: jax.Array, at: Positions, cache: Sequence[Cache] | None, read_cache: bool,
                     kernels: Kernels, prior: Sequence[dict[str, jax.Array]] | None) -> tuple[jax.Array, list]:
        """Each run as one scan over its repeats. Caches ride in the scan's carry and each layer updates its slice
        in place; a call without caches returns its new keys (packed trees) as the scan's stacked outputs."""
        new: list = []
        g = 0
        for run, members in zip(self.layer_runs, self.runs, strict=True):
            splits = [nnx.split(m) for m in members]
            caches = None if cache is None else list(cache[g:g + run.period])
            priors = None if prior is None else list(prior[g:g + run.period])

            def body(carry: tuple, xs: tuple, splits: list = splits) -> tuple:
                h, cs = carry
                c, states, pr = xs
                outs = []
                for j, (graphdef, _) in enumerate(splits):
                    layer = nnx.merge(graphdef, states[j])
                    h, out = layer(h, at, None if cs is None else _slice(cs[j], c), None if pr is None else pr[j],
                                   read_cache=read_cache, kernels=kernels)
                    if cs is None:
                        outs.append(out)
                    else:
                        cs = [*cs[:j], _update(cs[j], out, c), *cs[j + 1:]]
                return (h, cs), outs

            xs = (jnp.arange(run.count, dtype=jnp.int32), [s for _, s in splits], priors)
            outs: list
            (x, caches), outs = jax.lax.scan(body, (x, caches), xs)
            new += caches if caches is not None else outs
            g += run.period
        return x, new

    def embed_inputs(self, tokens: StepArray, positions: StepArray, tree: TreeMask | None = None
                     ) -> tuple[jax.Array, Positions]:
        """-> (hidden states [B, T, D], Positions): what the first layer takes (tree: packed rows' TreeMask)."""
        cos, sin = rope_cos_sin(self.cfg.rope, self.cfg.rotary_dim, positions)
        x = self.embed[...][tokens]
        # the steps call this inside their jits: positions is traced there, a jax.Array
        at = Positions(cast(jax.Array, positions), cos, sin, tree)
        return (x if self.split_batch is None else self.split_batch(x)), at

    def head(self, x: jax.Array, gather_idx: StepArray | None = None) -> jax.Array:
        """Last hidden states -> float32 logits (at every position, or at `gather_idx` as in __call__)."""
        if gather_idx is not None:
            one = gather_idx.ndim == 1
            x = jnp.take_along_axis(x, (gather_idx[:, None] if one else gather_idx)[..., None], axis=1)
            x = x[:, 0] if one else x
        x = self.final_norm(x)
        head = self.embed[...].T if self.lm_head is None else self.lm_head[...]
        return f32_dot(x, head)


def _stacked(layer: DecoderLayer, count: int) -> DecoderLayer:
    """`layer` with every weight repeated along a new leading [count] axis (the loader fills them)."""
    graphdef, state = nnx.split(layer)
    return nnx.merge(graphdef, jax.tree.map(lambda a: jnp.broadcast_to(a, (count, *a.shape)), state))


def _slice(cache: Cache, c: jax.Array) -> Cache:
    """Repeat c's part of a stacked cache: a PagedCache keeps the whole stacked pool and writes its slice in place
    (its table and slots are every layer's); a dict cache's slice is copied out (and back by _update)."""
    if isinstance(cache, PagedCache):
        return PagedCache(cache.pool, cache.table, cache.slots, c)
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, c, keepdims=False), cache)


def _update(stack: Cache, part: Cache, c: jax.Array) -> Cache:
    if isinstance(stack, PagedCache):
        assert isinstance(part, PagedCache)  # a layer returns its cache's kind, its slice written in place
        return PagedCache(part.pool, stack.table, stack.slots)
    return jax.tree.map(lambda s, p: jax.lax.dynamic_update_index_in_dim(s, p.astype(s.dtype), c, 0), stack, part)
