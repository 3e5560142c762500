"""Distilling the expert estimator (Speculating Experts §6.1-6.3) from routing traces with optax.

Pairs: for every token and source MoE layer m (m + d < M), the quasi-hidden state built from m's recorded
residual, true routing and default vectors -> the true router logits of MoE layer m + d. Loss: KL(softmax(true)
|| softmax(estimated)), AdamW with warm-up and cosine decay. Traces are split by prompt into training and
validation; the validation recall (through each target layer's own routing) is printed as it trains, and at
the end picks the Hybrid-PF layers: the threshold on the router predictor's validation recall under which the
estimator is used, chosen to maximise the hybrid's recall."""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

from moejax.offload.layered_steps import LayeredSteps
from moejax.offload.predict import estimator as est
from moejax.offload.predict.layer_ops import quasi_hidden, route_logits
from moejax.offload.predict.learned import EstimatorPredictor
from moejax.offload.predict.replay import recall, recall_by_layer, true_routing
from moejax.offload.predict.router import DefaultVectors, RouterPredictor
from moejax.offload.predict.traces import Traces


def estimator_pairs(steps: LayeredSteps, traces: Traces, vectors: DefaultVectors, distance: int,
                    truth: list[tuple[np.ndarray, np.ndarray]] | None = None, chunk: int = 8192
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """-> (quasi-hidden inputs [P, D], source ids [P], true target logits [P, E], target MoE position [P])."""
    truth = truth or true_routing(steps, traces, chunk)
    moe, M = traces.moe_layers, len(traces.moe_layers)
    vec = jnp.asarray(vectors.vectors)
    qs, sources, targets, positions = [], [], [], []
    for m in range(M - distance):
        for s in range(0, len(traces.tokens), chunk):
            idx, weights = (a[s:s + chunk] for a in truth[m])
            qs.append(np.asarray(steps.layers[moe[m + 1]](quasi_hidden, traces.residual[s:s + chunk, m],
                                                          vec[moe[m]], idx, weights)))
        n = len(traces.tokens)
        sources.append(np.full((n,), m, np.int32))
        targets.append(traces.router_logits[:, m + distance])
        positions.append(np.full((n,), m + distance, np.int32))
    if not qs:
        raise ValueError(f"distill: a model with {M} MoE layers has no pair at distance {distance}")
    return np.concatenate(qs), np.concatenate(sources), np.concatenate(targets), np.concatenate(positions)


def _kl(params: dict, q: jax.Array, source: jax.Array, target: jax.Array) -> jax.Array:
    logp = jax.nn.log_softmax(est.apply(params, q, source), axis=-1)
    p_true = jax.nn.softmax(target, axis=-1)
    return jnp.mean(jnp.sum(p_true * (jax.nn.log_softmax(target, axis=-1) - logp), axis=-1))


def pair_recall(steps: LayeredSteps, moe_layers: Sequence[int], params: dict, pairs: tuple, chunk: int = 8192
                ) -> dict[int, float]:
    """Recall of the estimator on (q, source, true logits, target position) pairs, per target layer: both sets of
    logits routed by the target layer's own routing."""
    q, source, target, position = pairs
    apply = jax.jit(est.apply)
    out = {}
    for m in np.unique(position):
        rows = np.nonzero(position == m)[0]
        hits = []
        for s in range(0, len(rows), chunk):
            r = rows[s:s + chunk]
            layer = steps.layers[moe_layers[m]]
            pred, _ = layer(route_logits, apply(params, q[r], source[r]))
            true, _ = layer(route_logits, target[r])
            hits.append(recall(np.asarray(pred), np.asarray(true)) * len(r))
        out[moe_layers[m]] = float(np.sum(hits) / len(rows))
    return out


def choose_hybrid(router: dict[int, float], estimator: dict[int, float]) -> tuple[float, list[int]]:
    """The threshold on router recall (and the target layers under it) that maximises the hybrid's mean recall;
    ties go to fewer estimator layers."""
    best: tuple[float, float, list[int]] = (float(np.mean(list(router.values()))), 0.0, [])
    for tau in sorted(set(router.values())):
        tau = float(np.nextafter(tau, 1.0))  # layers with router recall < tau use the estimator
        chosen = [t for t in router if router[t] < tau]
        score = float(np.mean([estimator[t] if t in chosen else router[t] for t in router]))
        if score > best[0] + 1e-12:
            best = (score, tau, chosen)
    return best[1], sorted(best[2])


def distill(steps: LayeredSteps, traces: Traces, vectors: DefaultVectors, *, distance: int = 1, train_steps: int = 2000,
            batch: int = 1024, lr: float = 2e-3, latent: int = 256, mlp: int = 512, seed: int = 0,
            eval_every: int = 250, validation_every: int = 10, log: Callable[[str], None] = print,
            progress: bool | None = None) -> est.EstimatorNet:
    """Traces (and the default vectors they were calibrated with) -> a trained EstimatorNet whose info records
    tokens, pairs, steps, seconds, the validation KL and recall per layer and the Hybrid-PF choice."""
    train, validation = traces.split(validation_every)
    truth_train, truth_val = true_routing(steps, train), true_routing(steps, validation)
    pairs = estimator_pairs(steps, train, vectors, distance, truth_train)
    val_pairs = estimator_pairs(steps, validation, vectors, distance, truth_val)
    D, E = pairs[0].shape[1], pairs[2].shape[1]
    shape = est.EstimatorShape(hidden=D, experts=E, sources=len(traces.moe_layers), latent=latent, mlp=mlp,
                               distance=distance)
    shape.validate()
    params = est.init_params(shape, seed)
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, max(1, train_steps // 20), train_steps, lr * 0.05)
    tx = optax.adamw(schedule, weight_decay=0.01)
    opt_state = tx.init(params)

    @jax.jit
    def step(params: dict, opt_state: optax.OptState, q: jax.Array, source: jax.Array, target: jax.Array
             ) -> tuple[dict, optax.OptState, jax.Array]:
        loss, grads = jax.value_and_grad(_kl)(params, q, source, target)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    val_kl = jax.jit(_kl)
    rng = np.random.default_rng(seed)
    n = len(pairs[0])
    log(f"distill: {len(train.tokens)} training tokens ({n} pairs), {len(validation.tokens)} validation tokens, "
        f"distance {distance}, {train_steps} steps of {batch}")
    bar = tqdm(total=train_steps, disable=None if progress is None else not progress, unit="step", dynamic_ncols=True)
    history, t0 = [], time.time()
    for i in range(1, train_steps + 1):
        rows = rng.integers(0, n, size=min(batch, n))
        params, opt_state, loss = step(params, opt_state, *(jnp.asarray(a[rows]) for a in pairs[:3]))
        bar.set_postfix(kl=f"{float(loss):.4f}", refresh=False)
        bar.update(1)
        if i % eval_every == 0 or i == train_steps:
            per_layer = pair_recall(steps, traces.moe_layers, params, val_pairs)
            kl = float(val_kl(params, *(jnp.asarray(a[:65536]) for a in val_pairs[:3])))
            history.append(dict(step=i, train_kl=float(loss), validation_kl=kl,
                                validation_recall=float(np.mean(list(per_layer.values())))))
            bar.write(f"step {i}: train KL {float(loss):.4f}, validation KL {kl:.4f}, validation recall "
                      f"{history[-1]['validation_recall']:.3f}")
    bar.close()
    net = est.EstimatorNet(shape, params, vectors)
    router = recall_by_layer(steps, RouterPredictor(vectors, distance), validation, truth_val)["per_layer"]
    estimated = recall_by_layer(steps, EstimatorPredictor(net), validation, truth_val)["per_layer"]
    tau, hybrid = choose_hybrid(router, estimated)
    net.info = dict(train_tokens=int(len(train.tokens)), validation_tokens=int(len(validation.tokens)), pairs=n,
                    steps=train_steps, batch=batch, lr=lr, seconds=time.time() - t0, history=history,
                    validation_recall=dict(router={str(k): v for k, v in router.items()},
                                           estimator={str(k): v for k, v in estimated.items()}),
                    hybrid_threshold=tau, hybrid_layers=hybrid)
    return net
