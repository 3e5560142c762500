"""The neural expert estimator (Speculating Experts §6.1, App. A): from the quasi-hidden state at MoE layer l,
q_l = norm_{l+1}(r_l + Σ_e g_e·d_{l,e}), predict the router logits of MoE layer l + d.

    z = W_in q + b_in + emb[l]          linear projection to a latent, plus a learned per-layer embedding
    z = z + W_2 silu(W_1 z + b_1) + b_2  a two-layer SiLU MLP with a residual
    logits = W_head LayerNorm(z) + b_head

One network serves every source layer (the embedding tells them apart). Parameters are a flat dict of float32
arrays; `EstimatorNet` holds them with their shape settings and saves/loads with orbax, the default vectors of
its input beside them (an estimator directory is self-contained)."""
from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from moejax.offload.predict.arrays_io import load_arrays, save_arrays
from moejax.offload.predict.artifacts import ESTIMATOR, kind_of
from moejax.offload.predict.router import DefaultVectors

_f32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class EstimatorShape:
    hidden: int  # the model's hidden size D (input)
    experts: int  # E (output logits)
    sources: int  # number of source MoE layers (one embedding each)
    latent: int = 256
    mlp: int = 512
    distance: int = 1  # in MoE layers

    def validate(self) -> None:
        for name, value in dataclasses.asdict(self).items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"estimator: {name} must be an int >= 1, got {value!r}")


def init_params(shape: EstimatorShape, seed: int = 0) -> dict:
    keys = jax.random.split(jax.random.key(seed), 4)

    def dense(key: jax.Array, fan_in: int, fan_out: int) -> jax.Array:
        return jax.random.normal(key, (fan_in, fan_out), _f32) / np.sqrt(fan_in)

    H = shape.latent
    return dict(w_in=dense(keys[0], shape.hidden, H), b_in=jnp.zeros((H,), _f32),
                layer_emb=jnp.zeros((shape.sources, H), _f32),
                w_1=dense(keys[1], H, shape.mlp), b_1=jnp.zeros((shape.mlp,), _f32),
                w_2=dense(keys[2], shape.mlp, H) * 0.1, b_2=jnp.zeros((H,), _f32),
                ln_scale=jnp.ones((H,), _f32), ln_bias=jnp.zeros((H,), _f32),
                w_head=dense(keys[3], H, shape.experts), b_head=jnp.zeros((shape.experts,), _f32))


def apply(params: dict, q: jax.Array, source: jax.Array) -> jax.Array:
    """q [N, D] quasi-hidden states, source [N] int source-layer ids (0..sources-1) -> logits [N, E] float32."""
    hi = jax.lax.Precision.HIGHEST
    z = jnp.dot(q.astype(_f32), params["w_in"], precision=hi) + params["b_in"] + params["layer_emb"][source]
    z = z + jnp.dot(jax.nn.silu(jnp.dot(z, params["w_1"], precision=hi) + params["b_1"]), params["w_2"],
                    precision=hi) + params["b_2"]
    mean = jnp.mean(z, axis=-1, keepdims=True)
    var = jnp.mean((z - mean) ** 2, axis=-1, keepdims=True)
    z = (z - mean) * jax.lax.rsqrt(var + 1e-5) * params["ln_scale"] + params["ln_bias"]
    return jnp.dot(z, params["w_head"], precision=hi) + params["b_head"]


@dataclasses.dataclass
class EstimatorNet:
    shape: EstimatorShape
    params: dict
    vectors: DefaultVectors  # the default vectors its quasi-hidden input is built with
    info: dict = dataclasses.field(default_factory=dict)  # training record: tokens, steps, held-out recall, hybrid

    def save(self, path: str) -> str:
        """Write to the directory `path` (must not exist): orbax parameters, default vectors, estimator.json."""
        path = os.path.abspath(path)
        if os.path.exists(path):
            raise FileExistsError(f"estimator: {path!r} already exists")
        os.makedirs(path)
        save_arrays(os.path.join(path, "params"), self.params)
        self.vectors.save(os.path.join(path, "default_vectors"))
        with open(os.path.join(path, "estimator.json"), "w") as f:
            json.dump(dict(shape=dataclasses.asdict(self.shape), info=self.info), f, indent=1)
        return path

    @classmethod
    def load(cls, path: str) -> EstimatorNet:
        meta = os.path.join(os.path.abspath(path), "estimator.json")
        if not os.path.isfile(meta):
            if os.path.isdir(path):  # another predictor's files given here: say which
                try:
                    holds = kind_of(path, frozenset(load_arrays(path, "estimator")))
                except ValueError:
                    holds = "no estimator.json"
                raise ValueError(f"{ESTIMATOR} {path}: holds {holds}, not an estimator (write one with "
                                 "`python -m launch.distill`)")
            raise ValueError(f"estimator: {path!r} holds no estimator.json (write one with `python -m launch.distill`)")
        with open(meta) as f:
            saved = json.load(f)
        shape = EstimatorShape(**saved["shape"])
        tree = load_arrays(os.path.join(os.path.abspath(path), "params"), "estimator parameters")
        vectors = DefaultVectors.load(os.path.join(path, "default_vectors"))
        return cls(shape, {k: jnp.asarray(v, _f32) for k, v in tree.items()}, vectors, saved.get("info", {}))
