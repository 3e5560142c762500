"""Feed-forward blocks: dense SwiGLU MLP, routers (softmax/sigmoid, group-limited top-k, biases), and
the MoE block (routed experts + optional shared expert)."""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from moejax.config import ModelConfig
from moejax.kernels import invariant
from moejax.kernels.expert_ffn import expert_ffn
from moejax.kernels.precision import f32_dot

_f32 = jnp.float32
EXPERT_ARRAYS = ("we_gate_up", "we_down", "be_gate_up", "be_down")  # what offloading moves
# (x2 [N, D], idx [N, k], weights [N, k], expert arrays by name) -> weighted routed output [N, D]
ExpertFFN = Callable[[jax.Array, jax.Array, jax.Array, dict[str, jax.Array]], jax.Array]


def is_routed_expert(path: tuple) -> bool:
    """Flat nnx parameter path -> whether it is a routed expert array (('layers', i, 'mlp', 'we_down'))."""
    return len(path) == 4 and path[0] == "layers" and path[2] == "mlp" and path[3] in EXPERT_ARRAYS


def _param(shape: tuple[int, ...], dtype: DTypeLike) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, dtype))


class DenseMLP(nnx.Module):
    def __init__(self, hidden: int, width: int, bias: bool, dtype: DTypeLike) -> None:
        self.w_gate, self.w_up, self.w_down = _param((hidden, width), dtype), _param((hidden, width), dtype), \
            _param((width, hidden), dtype)
        self.b_gate = _param((width,), dtype) if bias else None
        self.b_up = _param((width,), dtype) if bias else None
        self.b_down = _param((hidden,), dtype) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        def lin(v: jax.Array, w: nnx.Param, b: nnx.Param | None) -> jax.Array:
            y = f32_dot(v, w[...])
            return y if b is None else y + b[...].astype(_f32)
        h = jax.nn.silu(lin(x, self.w_gate, self.b_gate)) * lin(x, self.w_up, self.b_up)
        return lin(h.astype(x.dtype), self.w_down, self.b_down).astype(x.dtype)


def route(cfg: ModelConfig, logits: jax.Array, correction_bias: jax.Array | None = None
          ) -> tuple[jax.Array, jax.Array]:
    """float32 router logits [N, E] -> (expert ids [N, k], weights [N, k] float32)."""
    k, E = cfg.num_experts_per_tok, cfg.num_experts
    scores = jax.nn.sigmoid(logits) if cfg.router_scoring == "sigmoid" else jax.nn.softmax(logits, axis=-1)
    choice = scores if correction_bias is None else scores + correction_bias  # bias picks, never weighs
    if cfg.topk_groups is not None:
        n_group, topk_group = cfg.topk_groups
        grouped = choice.reshape(-1, n_group, E // n_group)
        if cfg.group_score == "top2_sum":
            group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
        else:
            group_scores = jnp.max(grouped, axis=-1)
        _, top_groups = jax.lax.top_k(group_scores, topk_group)
        keep = jnp.zeros_like(group_scores, dtype=bool).at[jnp.arange(group_scores.shape[0])[:, None],
                                                            top_groups].set(True)
        choice = jnp.where(jnp.repeat(keep, E // n_group, axis=-1), choice, -jnp.inf)
    _, idx = jax.lax.top_k(choice, k)
    weights = jnp.take_along_axis(scores, idx, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return idx, weights * cfg.routed_scaling_factor


def local_expert_ffn(cfg: ModelConfig, backend: str = "auto") -> ExpertFFN:
    """The single-device routed FFN of cfg's experts: (x2 [N, D], idx [N, k], weights [N, k], experts by name) ->
    weighted output [N, D]. Needs no block: an expert group that holds only the experts runs it (DEP)."""
    def local(x2: jax.Array, idx: jax.Array, weights: jax.Array, experts: dict[str, jax.Array]) -> jax.Array:
        if invariant.active():
            return invariant.expert_ffn(x2, idx, weights, experts["we_gate_up"], experts["we_down"],
                                        experts.get("be_gate_up"), experts.get("be_down"), cfg.expert_act,
                                        cfg.swiglu_limit, cfg.swiglu_alpha).astype(x2.dtype)
        return expert_ffn(x2, idx, weights, experts["we_gate_up"], experts["we_down"], experts.get("be_gate_up"),
                          experts.get("be_down"), act=cfg.expert_act, limit=cfg.swiglu_limit, alpha=cfg.swiglu_alpha,
                          backend=backend)
    return local


class LocalExperts:
    """How a MoE block runs its routed experts inside the whole-model jits: route, then the single-device expert
    FFN over the block's own arrays. Placements give blocks other runners (host-memory inputs, programs over
    devices); every runner is stateless and compares equal to its kind, so equal layers keep equal graphdefs."""

    def __call__(self, block: MoEBlock, x2: jax.Array, backend: str) -> jax.Array:
        idx, weights = block.route_tokens(x2)
        return block.routed(x2, idx, weights, self.arrays(block), backend)

    def arrays(self, block: MoEBlock) -> dict[str, jax.Array]:
        return block.expert_weights()

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self)

    def __hash__(self) -> int:
        return hash(type(self))


LOCAL_EXPERTS = LocalExperts()  # the default runner (stateless, so one instance serves every block)


class HostExperts(LocalExperts):
    """Routed experts that are host-memory inputs of the jits (a streamed placement with stream='jit'): each block
    moves its arrays to the device where it uses them, and XLA schedules the copies."""

    def arrays(self, block: MoEBlock) -> dict[str, jax.Array]:
        return {name: jax.device_put(a, jax.memory.Space.Device) for name, a in block.expert_weights().items()}


class MoEBlock(nnx.Module):
    # Set by moejax.train (forward_with_router): route_tokens sows its router logits as an nnx.Intermediate
    # ("sown_router_logits") for nnx.capture; the training losses and the quality bench read them.
    record_router = False

    def __init__(self, cfg: ModelConfig, dtype: DTypeLike,
                 experts_runner: Callable[[MoEBlock, jax.Array, str], jax.Array] = LOCAL_EXPERTS) -> None:
        """experts_runner(block, x2 [N, D], backend) -> routed output [N, D]: LocalExperts, HostExperts, or a
        program over devices (moejax.sharding.experts.ShardedExperts); the placement picks it."""
        D, E, I = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        self.cfg = cfg
        self.run_experts = experts_runner
        self.router = _param((D, E), _f32)  # routers stay float32 whatever the model dtype
        self.router_bias = _param((E,), _f32) if cfg.router_bias else None
        self.correction_bias = _param((E,), _f32) if cfg.score_correction_bias else None
        self.we_gate_up = _param((E, D, 2 * I), dtype)  # [gate | up] along the last axis
        self.we_down = _param((E, I, D), dtype)
        self.be_gate_up = _param((E, 2 * I), dtype) if cfg.expert_bias else None
        self.be_down = _param((E, D), dtype) if cfg.expert_bias else None
        self.shared = DenseMLP(D, cfg.shared_expert_size, cfg.mlp_bias, dtype) if cfg.shared_expert_size else None
        self.shared_gate = _param((D, 1), dtype) if cfg.shared_expert_gate else None

    def router_logits(self, x2: jax.Array) -> jax.Array:
        dot = invariant.dot if invariant.active() else jnp.dot
        logits = dot(x2.astype(_f32), self.router[...], precision=jax.lax.Precision.HIGHEST)
        return logits if self.router_bias is None else logits + self.router_bias[...]

    def expert_weights(self) -> dict[str, jax.Array]:
        """The routed experts' arrays by name (absent biases left out), as `routed` takes them."""
        return {name: getattr(self, name)[...] for name in EXPERT_ARRAYS if getattr(self, name) is not None}

    def route_tokens(self, x2: jax.Array) -> tuple[jax.Array, jax.Array]:
        """[N, D] -> (expert ids [N, k], float32 weights [N, k])."""
        bias = None if self.correction_bias is None else self.correction_bias[...]
        logits = self.router_logits(x2)
        if self.record_router:
            self.sow(nnx.Intermediate, "sown_router_logits", logits)
        if invariant.active():  # softmax and top-k per fixed row tile; the ids ride along as exact floats
            k = self.cfg.num_experts_per_tok
            both = invariant.by_rows(lambda t: jnp.concatenate(
                [a.astype(_f32) for a in route(self.cfg, t, bias)], axis=-1), logits)
            return both[:, :k].astype(jnp.int32), both[:, k:]
        return route(self.cfg, logits, bias)

    def routed(self, x2: jax.Array, idx: jax.Array, weights: jax.Array, experts: dict[str, jax.Array],
               backend: str = "auto") -> jax.Array:
        """Routed experts' weighted output [N, D]; `experts` may come from anywhere (this block's own arrays, a
        host-streamed copy, or a cache holding a subset, with `idx` renumbered to it)."""
        return self._local_ffn(backend)(x2, idx, weights, experts)

    def _local_ffn(self, backend: str) -> ExpertFFN:
        return local_expert_ffn(self.cfg, backend)

    def with_shared(self, x2: jax.Array, y: jax.Array) -> jax.Array:
        """Add the shared expert (if any) to the routed output y [N, D]."""
        if self.shared is None:
            return y
        s = self.shared(x2)
        if self.shared_gate is not None:
            gate = jax.nn.sigmoid(f32_dot(x2, self.shared_gate[...]))
            s = (gate * s.astype(_f32)).astype(x2.dtype)
        return y + s

    def __call__(self, x: jax.Array, backend: str = "auto") -> jax.Array:
        B, T, D = x.shape
        x2 = x.reshape(B * T, D)
        y = self.run_experts(self, x2, backend)
        return self.with_shared(x2, y).reshape(B, T, D)
