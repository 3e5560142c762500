"""fMoE's expert maps (§4): a store of per-request maps (each MoE layer's mean gate distribution over the
request's tokens) keyed by the request's semantic embedding (the mean of its input embeddings).

- Search (§4.2): the first d MoE layers by semantic search (cosine of embeddings), layer l + d by trajectory
  search (cosine of the gate distributions observed at layers 0..l, flattened, against the same layers of each
  map).
- Selection (§4.3, Eq. 6-8): δ = clip(1 - score, 0, 1); the fewest experts, most probable first, whose
  probabilities sum to at least δ, and at least k of them.
- Store (§4.4): capacity C; a new map replaces the stored map most redundant with it once the store is full,
  redundancy RDY = (d/L)·score_sem + ((L-d)/L)·score_map.
- Priorities (§4.5): prefetch priority p / (l - l_now) (moejax.offload.expert_cache.prefetch_priority), which orders
  the cached placement's copies across the layers ahead (moejax.offload.cached); eviction priority from the map
  probabilities (the cache's "priority" policy takes them as scores).

`ExpertMapPredictor` runs this in the cached placement: it predicts one set per forward pass (all rows share
it), so it prefetches only; speculative execution needs per-token predictions and refuses it."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.offload.predict.arrays_io import load_arrays, save_arrays
from moejax.offload.predict.protocol import Arrays, Prediction

if TYPE_CHECKING:
    from moejax.offload.layered import LayeredSteps
    from moejax.offload.predict.traces import Traces


def _unit(v: np.ndarray) -> np.ndarray:
    return v / np.maximum(np.linalg.norm(v, axis=-1, keepdims=True), 1e-12)


def select_experts(p: np.ndarray, score: float, k: int) -> np.ndarray:
    """Eq. 6-8: expert ids, most probable first, the fewest whose probabilities sum to >= clip(1 - score, 0, 1),
    and at least k."""
    delta = min(max(1.0 - float(score), 0.0), 1.0)
    order = np.argsort(-p, kind="stable")
    covered = np.cumsum(p[order])
    n = int(np.searchsorted(covered, delta - 1e-12) + 1)  # first prefix reaching delta
    return order[:min(max(n, k), len(p))]


@dataclasses.dataclass
class ExpertMapStore:
    capacity: int
    distance: int
    embeddings: np.ndarray  # [n, D] unit semantic embeddings
    maps: np.ndarray  # [n, M, E] gate distributions per MoE layer

    @classmethod
    def empty(cls, capacity: int, distance: int, moe_layers: int, experts: int, hidden: int) -> "ExpertMapStore":
        if capacity < 1 or distance < 1:
            raise ValueError(f"expert maps: capacity and distance must be >= 1, got {capacity}, {distance}")
        return cls(capacity, distance, np.zeros((0, hidden), np.float32), np.zeros((0, moe_layers, experts),
                                                                                   np.float32))

    def __len__(self) -> int:
        return len(self.maps)

    def semantic(self, embedding: np.ndarray) -> tuple[int, float]:
        scores = self.embeddings @ _unit(np.asarray(embedding, np.float32))
        i = int(np.argmax(scores))
        return i, float(scores[i])

    def trajectory(self, observed: np.ndarray) -> tuple[int, float]:
        """observed [m, E]: the gate distributions of MoE layers 0..m-1 -> best map and its cosine score."""
        m = len(observed)
        flat = _unit(self.maps[:, :m].reshape(len(self), -1))
        scores = flat @ _unit(np.asarray(observed, np.float32).reshape(-1))
        i = int(np.argmax(scores))
        return i, float(scores[i])

    def add(self, embedding: np.ndarray, gate_map: np.ndarray) -> None:
        """Store a map; when full, it replaces the stored map most redundant with it (§4.4)."""
        e, g = _unit(np.asarray(embedding, np.float32))[None], np.asarray(gate_map, np.float32)[None]
        if len(self) < self.capacity:
            self.embeddings, self.maps = np.concatenate([self.embeddings, e]), np.concatenate([self.maps, g])
            return
        L = self.maps.shape[1]
        sem = self.embeddings @ e[0]
        traj = _unit(self.maps.reshape(len(self), -1)) @ _unit(g.reshape(-1))
        redundancy = (self.distance / L) * sem + ((L - self.distance) / L) * traj
        victim = int(np.argmax(redundancy))
        self.embeddings[victim], self.maps[victim] = e[0], g[0]

    def save(self, path: str) -> str:
        return save_arrays(path, dict(embeddings=self.embeddings, maps=self.maps,
                                      settings=np.asarray([self.capacity, self.distance], np.int64)))

    @classmethod
    def load(cls, path: str) -> "ExpertMapStore":
        tree = load_arrays(path, "expert maps")
        capacity, distance = (int(v) for v in tree["settings"])
        return cls(capacity, distance, tree["embeddings"].astype(np.float32), tree["maps"].astype(np.float32))


def gate_probabilities(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(axis=-1, keepdims=True)
    p = np.exp(z)
    return p / p.sum(axis=-1, keepdims=True)


def build_store(traces: Traces, embed_table: np.ndarray, *, capacity: int = 1024, distance: int = 1) -> ExpertMapStore:
    """One map per traced prompt: its mean gate distribution per MoE layer, keyed by its mean input embedding."""
    M, E = traces.router_logits.shape[1:]
    store = ExpertMapStore.empty(capacity, distance, M, E, embed_table.shape[1])
    for r in range(traces.num_prompts):
        rows = slice(traces.starts[r], traces.starts[r + 1])
        store.add(embed_table[traces.tokens[rows]].mean(axis=0), gate_probabilities(traces.router_logits[rows]).mean(0))
    return store


def predict_sets(store: ExpertMapStore, embedding: np.ndarray, observed: np.ndarray, position: int, k: int
                 ) -> dict[int, tuple]:
    """What the predictor prefetches when MoE layer `position` (0-based among MoE layers) has run, with gate
    distributions `observed` [position + 1, E]: {target position: (expert ids, their map probabilities)}."""
    M, d = store.maps.shape[1], store.distance
    out = {}
    if position == 0:  # the first d layers cannot be reached by a trajectory at distance d: semantic search
        i, score = store.semantic(embedding)
        for target in range(min(d, M)):
            ids = select_experts(store.maps[i, target], score, k)
            out[target] = (ids, store.maps[i, target, ids])
    if position + d < M:
        i, score = store.trajectory(observed[:position + 1])
        ids = select_experts(store.maps[i, position + d], score, k)
        out[position + d] = (ids, store.maps[i, position + d, ids])
    return out


def _router_probs(graphdef: nnx.GraphDef, state: nnx.State, y: jax.Array) -> jax.Array:
    mlp = nnx.merge(graphdef, state).mlp
    return jax.nn.softmax(mlp.router_logits(y.reshape(-1, y.shape[-1]).astype(jnp.float32)), axis=-1)


class ExpertMapPredictor:
    def __init__(self, store: ExpertMapStore, *, update: bool = True):
        self.store, self.distance, self.update = store, store.distance, update
        if len(store) == 0:
            raise ValueError("expert maps: the store is empty (build it with `python -m launch.calibrate --maps`)")

    def begin_pass(self, steps: LayeredSteps) -> None:
        self._steps = steps
        x = np.asarray(steps.inputs, np.float32)
        self._embedding = x.reshape(-1, x.shape[-1]).mean(axis=0)
        self._observed: list[np.ndarray] = []

    def predict(self, pass_no: int, layer: int, x: Arrays, y: Arrays, idx: Arrays, weights: Arrays) -> Prediction:
        moe = self._steps.moe_layers
        j = moe.index(layer)
        self._observed.append(np.asarray(self._steps.layers[layer](_router_probs, y)).mean(axis=0))
        sets = predict_sets(self.store, self._embedding, np.stack(self._observed), j,
                            int(np.asarray(idx).shape[-1]))
        # each set most probable first; the cached placement orders the copies across the layers ahead by §4.5's
        # prefetch priority (moejax.offload.cached._prefetch_ahead)
        out = {moe[target]: (ids[None].astype(np.int32), p[None].astype(np.float32))
               for target, (ids, p) in sets.items()}
        if self.update and j == len(moe) - 1:  # the pass is done: its map joins the store (§4.4)
            self.store.add(self._embedding, np.stack(self._observed))
        return out

    def describe(self) -> str:
        return f"expert_map ({len(self.store)} maps of capacity {self.store.capacity}, distance {self.distance})"


def replay_predictions(store: ExpertMapStore, traces: Traces, embed_table: np.ndarray, k: int
                       ) -> tuple[dict[int, tuple], float]:
    """The predictor's sets for every traced token as batch-1 decode iterations (semantic embedding: the
    token's prompt's mean input embedding; trajectory: the token's own gate distributions), the store left
    unchanged. -> ({target layer: (ids [N, E] padded with -1, map probabilities [N, E])} like
    replay.predictions, the mean number of experts predicted per (token, layer))."""
    N, M, E = traces.router_logits.shape
    probs = gate_probabilities(traces.router_logits)
    prompt_of = np.repeat(np.arange(traces.num_prompts), np.diff(traces.starts))
    embeddings = np.stack([embed_table[traces.tokens[traces.starts[r]:traces.starts[r + 1]]].mean(axis=0)
                           for r in range(traces.num_prompts)])
    ids = {t: np.full((N, E), -1, np.int32) for t in range(M)}
    weights = {t: np.zeros((N, E), np.float32) for t in range(M)}
    sizes = []
    for n in range(N):
        for j in range(M):
            for target, (chosen, p) in predict_sets(store, embeddings[prompt_of[n]], probs[n, :j + 1], j, k).items():
                ids[target][n, :len(chosen)], weights[target][n, :len(chosen)] = chosen, p
                sizes.append(len(chosen))
    out = {traces.moe_layers[t]: (ids[t], weights[t]) for t in range(M) if (ids[t] >= 0).any()}
    return out, float(np.mean(sizes)) if sizes else 0.0
