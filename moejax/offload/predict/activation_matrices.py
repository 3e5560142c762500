"""MoE-Infinity's request-level predictor, the baseline fMoE compares with (fMoE: Fine-Grained Expert Offloading for
Large Mixture-of-Experts Serving, arXiv 2502.05370, §2.3, §6; MoE-Infinity: Offloading-Efficient MoE Model Serving,
arXiv 2401.14361): each served request leaves an expert activation matrix [MoE layers, experts] (how many of its
tokens each expert took, top-k selections), kept in a collection of fixed capacity (the oldest replaced first). A
request being served is matched to the most similar stored matrix by cosine over its own matrix so far (its earlier
passes over every layer, the current pass up to the layer it has reached), and the k experts the match used most at
the layer d ahead are prefetched. The same matching as hit_counts.replay_hit_counts, which replays it from a
calibration's matrices; `replay_online` replays this predictor's own code, the collection filled as it serves.

In the cached placement a request is a row of the batch: a pass of more than one token per row (a prefill) starts
its rows' requests, and the requests the batch finished join the collection then; decode passes of the same batch
size continue them. Padding rows and tokens (the loop's validity mask) count nothing and are not stored. Until the
collection holds a matrix, a fallback predictor predicts (the online setting: matrices collected while serving).
The layer loop does not say which request a row holds: under continuous batching (chunked prefill passes between
decode passes of the pool's slots) each run of passes of one shape counts as requests of its own, so a request's
matrix is stored in pieces (the tokens stay the resident model's: the predictor only moves weights)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.offload.layered_steps import LayeredSteps
from moejax.offload.predict.hit_counts import top_k_hits
from moejax.offload.predict.protocol import Arrays, Prediction, Predictor
from moejax.offload.predict.traces import Traces


class ActivationMatrices:
    """The collection: up to `capacity` request matrices [n, M, E] (float64 counts), the oldest replaced first."""

    def __init__(self, capacity: int, matrices: np.ndarray | None = None):
        if capacity < 1:
            raise ValueError(f"activation matrices: capacity must be >= 1, got {capacity}")
        self.capacity = int(capacity)
        self.matrices = np.zeros((0, 0, 0)) if matrices is None else np.asarray(matrices, np.float64)[-capacity:]
        self._next = 0  # the slot the next matrix replaces once full (FIFO)

    def __len__(self) -> int:
        return len(self.matrices)

    def add(self, matrices: np.ndarray) -> None:
        """Store finished requests' matrices [b, M, E]."""
        for m in np.asarray(matrices, np.float64):
            if not len(self):
                self.matrices = np.zeros((0, *m.shape))
            if len(self) < self.capacity:
                self.matrices = np.concatenate([self.matrices, m[None]])
            else:
                self.matrices[self._next] = m
                self._next = (self._next + 1) % self.capacity

    def best(self, observed: np.ndarray) -> np.ndarray:
        """observed [B, M, E] -> each row's most similar stored matrix (cosine over the whole matrix) [B]."""
        flat = self.matrices.reshape(len(self), -1)
        obs = np.asarray(observed, np.float64).reshape(len(observed), -1)
        norms = np.sqrt((obs ** 2).sum(axis=1)[:, None] * (flat ** 2).sum(axis=1)[None, :])
        return np.argmax(obs @ flat.T / np.maximum(norms, 1e-12), axis=1)

    def top(self, best: np.ndarray, target: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The k experts the matched matrices used most at MoE layer `target` -> (ids [B, k], count shares [B, k])."""
        counts = self.matrices[best, target]  # [B, E]
        ids = np.argsort(-counts, axis=1, kind="stable")[:, :k].astype(np.int32)
        shares = np.take_along_axis(counts, ids, axis=1) / np.maximum(counts.sum(axis=1, keepdims=True), 1)
        return ids, shares.astype(np.float32)


class RequestMatcher:
    """The predictor's host side, fed counts: the requests in flight (one matrix per row) and their matches."""

    def __init__(self, collection: ActivationMatrices, distance: int, store: bool = True):
        if distance < 1:
            raise ValueError(f"moe_infinity predictor: distance must be >= 1, got {distance}")
        self.collection, self.distance, self.store = collection, int(distance), store  # store: add finished ones
        self.current = np.zeros((0, 0, 0))  # [B, M, E]: each row's request's counts so far

    def begin(self, rows: int, layers: int, experts: int, new_requests: bool) -> None:
        """A pass over `rows` rows starts; new_requests: it starts its rows' requests (the finished ones are stored)."""
        if new_requests or self.current.shape != (rows, layers, experts):
            self.finish()
            self.current = np.zeros((rows, layers, experts))

    def finish(self) -> None:
        """The requests in flight are done: their matrices join the collection (rows that counted nothing do not)."""
        used = self.current.any(axis=(1, 2))
        if used.any() and self.store:
            self.collection.add(self.current[used])
        self.current = np.zeros((0, 0, 0))

    def first_layers(self, k: int) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """Before MoE layer 0 runs: the first d layers from the rows' earlier passes (rows without: none, -1)."""
        seen = np.asarray(self.current.any(axis=(1, 2)))
        if not len(self.collection) or not seen.any():
            return {}
        best = self.collection.best(self.current)
        return {t: _only(seen, *self.collection.top(best, t, k)) for t in range(min(self.distance,
                                                                                     self.current.shape[1]))}

    def layer(self, j: int, counts: np.ndarray, k: int) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """MoE layer j's counts [B, E] this pass -> the rows' sets for layer j + d (rows with no token: none)."""
        self.current[:, j] += counts
        target = j + self.distance
        if not len(self.collection) or target >= self.current.shape[1]:
            return {}
        best = self.collection.best(self.current)
        return {target: _only(np.asarray(counts.any(axis=1)), *self.collection.top(best, target, k))}


def _only(rows: np.ndarray, ids: np.ndarray, shares: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sets for `rows` only (a bool mask); the others' ids are -1 (no prediction), as the cached placement skips."""
    return np.where(rows[:, None], ids, -1).astype(np.int32), np.where(rows[:, None], shares, 0).astype(np.float32)


def _row_counts(graphdef: nnx.GraphDef, state: nnx.State, idx: jax.Array, valid: jax.Array | None, *,
                rows: int) -> jax.Array:
    """Each row's count of top-k selections per expert [rows, E] over its valid tokens."""
    experts = nnx.merge(graphdef, state).mlp.cfg.num_experts
    hits = jax.nn.one_hot(idx, experts, dtype=jnp.float32).sum(axis=1).reshape(rows, -1, experts)  # [B, T, E]
    if valid is not None:
        hits = hits * valid[..., None].astype(hits.dtype)
    return hits.sum(axis=1)


class ActivationMatrixPredictor:
    """MoE-Infinity's predictor in the cached placement (the module docstring). It reads each MoE layer's counts on
    the host (one sync per MoE layer): a baseline, not built to overlap as the expert maps' matcher is."""

    def __init__(self, collection: ActivationMatrices, distance: int = 1, *, fallback: Predictor | None = None,
                 update: bool = True):
        if not len(collection) and (fallback is None or not update):
            raise ValueError("moe_infinity predictor: the collection is empty; serve from it with a fallback "
                             "predictor and update=True (matrices collected while serving)")
        if fallback is not None and fallback.distance != distance:
            raise ValueError(f"moe_infinity predictor: the fallback's distance {fallback.distance} differs from "
                             f"{distance}")
        self.collection, self.distance, self.fallback, self.update = collection, int(distance), fallback, update
        self.matcher = RequestMatcher(collection, distance, store=update)
        self._cold = False  # the collection is empty: the fallback predicts this pass

    def begin_pass(self, steps: LayeredSteps) -> None:
        self._steps = steps
        rows, tokens = steps.inputs.shape[:2]
        self._new, self._rows = tokens > 1, int(rows)
        if self.fallback is not None:
            self.fallback.begin_pass(steps)

    def predict(self, pass_no: int, layer: int, x: Arrays, y: Arrays, idx: Arrays, weights: Arrays) -> Prediction:
        moe = self._steps.moe_layers
        j, k = moe.index(layer), int(idx.shape[-1])
        counts = np.asarray(self._steps.layers[layer](_row_counts, idx, getattr(self._steps, "valid", None),
                                                      rows=self._rows), np.float64)
        out: Prediction = {}
        if j == 0:  # the first pass sizes the matrices; a prefill's finished requests are stored here
            self.matcher.begin(self._rows, len(moe), counts.shape[1], self._new)
            self._cold = not len(self.collection)
            out |= {moe[t]: p for t, p in self.matcher.first_layers(k).items()}
        sets = self.matcher.layer(j, counts, k)
        if self._cold:
            assert self.fallback is not None
            return self.fallback.predict(pass_no, layer, x, y, idx, weights)
        return out | {moe[t]: p for t, p in sets.items()}

    def describe(self) -> str:
        online = "" if self.fallback is None else f"; {self.fallback.describe()} while it is empty"
        return (f"moe_infinity (request-level expert activation matrices, {len(self.collection)} of capacity "
                f"{self.collection.capacity}, matched by cosine, distance {self.distance}{online})")


def replay_online(traces: Traces, k: int, distance: int = 1, *, capacity: int = 1024,
                  collection: ActivationMatrices | None = None) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """The predictor's sets for every traced token, each traced sequence a request served token by token (batch-1
    passes), its matrix stored once it is done (the collection given, or an empty one, grows) -> {target layer:
    (ids [N, k], shares [N, k])}; -1 where it predicts nothing (an empty collection)."""
    N, M, E = traces.router_logits.shape
    collection = ActivationMatrices(capacity) if collection is None else collection
    matcher = RequestMatcher(collection, distance)
    hits = top_k_hits(traces.router_logits, k)
    ids = np.full((M, N, k), -1, np.int32)
    shares = np.zeros((M, N, k), np.float32)
    for r in range(traces.num_prompts):
        for n in range(int(traces.starts[r]), int(traces.starts[r + 1])):
            matcher.begin(1, M, E, new_requests=n == traces.starts[r])
            sets = matcher.first_layers(k)
            for j in range(M):
                sets |= matcher.layer(j, hits[n, j][None], k)
            for t, (i, s) in sets.items():
                ids[t, n], shares[t, n] = i[0], s[0]
    matcher.finish()
    return {traces.moe_layers[t]: (ids[t], shares[t]) for t in range(M) if (ids[t] >= 0).any()}
