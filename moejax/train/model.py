"""The trained model as pure functions over a flat parameter dict ({"layers.0.attn.wq": array, ...}): random init,
the forward through moejax's own MoEModel (the serving math), and the training loss.

Loss = next-token cross-entropy + LOAD_BALANCE_COEF * load-balancing loss + Z_LOSS_COEF * router z-loss, both
averaged over MoE layers:
- load balancing (Switch Transformer, Eq. 4; what transformers' qwen3_moe computes, divided by k so a perfectly
  balanced router scores 1): E * sum_e f_e * P_e, f_e the share of top-k assignments to expert e, P_e the mean
  router probability of e;
- z-loss (ST-MoE, Eq. 5): mean over tokens of logsumexp(router logits)^2, which keeps logits small.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.typing import DTypeLike

from moejax.config import ModelConfig
from moejax.kernels.backends import Kernels
from moejax.models.decoder import MoEModel
from moejax.models.moe import MoEBlock
from moejax.weights import random_param

LOAD_BALANCE_COEF = 0.02
Z_LOSS_COEF = 0.001
# "tiled" (each expert's rows padded to whole tiles, one batched matmul) is the differentiable expert backend
# training uses (`xla` loops over a dynamic number of experts, which reverse mode cannot differentiate). A
# pycode-moe step (8 x 512 tokens, forward + backward) took 3.4 s with it on the 2-core CPU; an earlier probe on
# the same shape (another session, not side by side) took 5.1 s with "dense" and 6.4 s with ragged_dot. Side by
# side under load, one expert FFN forward + backward (4096 tokens, 16 experts top-2) took 0.19 s tiled against
# 0.84 s dense.
TRAIN_KERNELS = Kernels(experts="tiled", attention="xla")


def name_of(path: tuple) -> str:
    return ".".join(str(p) for p in path)


class TrainModel:
    """cfg's MoEModel split into a graph and flat float32 parameters; `apply` merges them back."""

    def __init__(self, cfg: ModelConfig, dtype: DTypeLike = jnp.float32) -> None:
        self.cfg = cfg
        abstract = nnx.eval_shape(lambda: MoEModel(cfg, dtype))
        self.graphdef, state = nnx.split(abstract)
        self.paths = {name_of(path): path for path, _ in nnx.to_flat_state(state)}
        self.shapes = {name_of(path): var.get_value() for path, var in nnx.to_flat_state(state)}

    def init(self, seed: int) -> dict:
        """Normal(0, 0.02) weights, norms 1 (weights.random_param, the presets' init)."""
        return {name: random_param(self.paths[name], s, seed) for name, s in self.shapes.items()}

    def module(self, params: dict) -> MoEModel:
        return nnx.merge(self.graphdef, nnx.from_flat_state({self.paths[n]: v for n, v in params.items()}))

    def apply(self, params: dict, tokens: jax.Array, kernels: Kernels = TRAIN_KERNELS
              ) -> tuple[jax.Array, list[jax.Array]]:
        """tokens [B, T] -> (float32 logits [B, T, V], router logits per MoE layer [[B*T, E], ...])."""
        return forward_with_router(self.module(params), tokens, kernels)


def forward_with_router(model: MoEModel, tokens: jax.Array, kernels: Kernels) -> tuple[jax.Array, list[jax.Array]]:
    """tokens [B, T] -> (float32 logits [B, T, V], router logits per MoE layer in layer order [[B*T, E], ...])."""
    model = model.unstacked()  # router logits are recorded per layer
    for layer in model.layers:
        if isinstance(layer.mlp, MoEBlock):
            layer.mlp.record_router = True
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    (logits, _), sown = nnx.capture(model, nnx.Intermediate)(tokens, positions, kernels=kernels)
    flat = sorted(nnx.to_flat_state(sown), key=lambda path_var: path_var[0][1])  # ('layers', i, 'mlp', name)
    return logits, [var.get_value()[0] for _, var in flat]


def router_losses(cfg: ModelConfig, router_logits: list) -> tuple:
    """(load-balancing loss, z-loss), each averaged over MoE layers (see the module docstring)."""
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    balance, z = [], []
    for logits in router_logits:
        probs = jax.nn.softmax(logits, axis=-1)
        _, idx = jax.lax.top_k(logits, k)
        share = jnp.mean(jax.nn.one_hot(idx, E).sum(axis=1), axis=0) / k  # f_e; sums to 1
        balance.append(E * jnp.sum(share * jnp.mean(probs, axis=0)))
        z.append(jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2))
    return jnp.mean(jnp.stack(balance)), jnp.mean(jnp.stack(z))


def loss_fn(model: TrainModel, params: dict, window: jax.Array) -> tuple:
    """window [B, T + 1] -> (total loss, metrics dict)."""
    logits, router = model.apply(params, window[:, :-1])
    targets = window[:, 1:]
    ce = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, targets))
    balance, z = router_losses(model.cfg, router)
    total = ce + LOAD_BALANCE_COEF * balance + Z_LOSS_COEF * z
    accuracy = jnp.mean(jnp.argmax(logits, axis=-1) == targets)
    return total, dict(loss=total, ce=ce, balance=balance, z_loss=z, top1=accuracy)
