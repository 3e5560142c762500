"""fMoE's expert maps (§4): a store of per-iteration maps (each MoE layer's gate distribution in one inference
iteration of one request: the mean over the prompt's tokens for its prefill, the one token's for a decode
iteration) keyed by the iteration's semantic embedding (the mean of its input embeddings).

- Search (§4.2): the first d MoE layers by semantic search (cosine of embeddings), layer l + d by trajectory
  search (cosine of the gate distributions observed at layers 0..l, flattened, against the same layers of each
  map).
- Selection (§4.3, Eq. 6-8): δ = clip(1 - score, 0, 1); the fewest experts, most probable first, whose
  probabilities sum to at least δ, and at least k of them.
- Store (§4.4): capacity C; a new map replaces the stored map most redundant with it once the store is full,
  redundancy RDY = (d/L)·score_sem + ((L-d)/L)·score_map. The "hits" policy is a replacement ablation against it
  (least used first, as LFU): each stored map counts the searches that chose it, and a new map replaces the least
  chosen one. (Fig. 12a's "hit count" is another thing: MoE-Infinity's request-level expert hit counts as the
  tracked pattern, a predictor of its own, not built here.)
- Priorities (§4.5): prefetch priority p / (l - l_now) (moejax.offload.expert_cache.prefetch_priority), which orders
  the cached placement's copies across the layers ahead (moejax.offload.cached); eviction priority from the map
  probabilities (the cache's "priority" policy takes them as scores).

`ExpertMapPredictor` runs this in the cached placement, each row (request) of a batch matched on its own, on a
matcher thread beside the layer loop (publish/subscribe, §4.3); the placement prefetches the union of the rows'
sets. It prefetches only; speculative execution needs per-token predictions and refuses it. With a fallback
predictor it starts from an empty store (fMoE's online setting, §6.3): the fallback predicts until the first maps
are stored, and every pass fills the store."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.offload.layered_steps import LayeredSteps
from moejax.offload.predict.arrays_io import load_arrays, save_arrays
from moejax.offload.predict.artifacts import expect_kind
from moejax.offload.predict.protocol import Arrays, Pending, Prediction, Predictor
from moejax.offload.predict.traces import Traces

POLICIES = ("redundancy", "hits")  # ExpertMapStore.policy


def _unit(v: np.ndarray) -> np.ndarray:
    return v / np.maximum(np.linalg.norm(v, axis=-1, keepdims=True), 1e-12)


def _prefix_norms2(maps: np.ndarray) -> np.ndarray:
    return np.cumsum((maps.astype(np.float64) ** 2).sum(axis=2), axis=1)


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
    policy: str = "redundancy"  # which map a new one replaces: "redundancy" (§4.4) or "hits" (the least chosen)
    hits: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))  # [n] searches that chose it
    # [n, M]: each map's squared norm over its layers 0..m (trajectory cosines of a growing prefix), kept by add
    _prefix2: np.ndarray | None = dataclasses.field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"expert maps: policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if len(self.hits) != len(self.maps):
            self.hits = np.zeros(len(self.maps), np.int64)

    @classmethod
    def empty(cls, capacity: int, distance: int, moe_layers: int, experts: int, hidden: int,
              policy: str = "redundancy") -> ExpertMapStore:
        if capacity < 1 or distance < 1:
            raise ValueError(f"expert maps: capacity and distance must be >= 1, got {capacity}, {distance}")
        return cls(capacity, distance, np.zeros((0, hidden), np.float32), np.zeros((0, moe_layers, experts),
                                                                                   np.float32), policy)

    @classmethod
    def unsized(cls, capacity: int, distance: int, policy: str = "redundancy") -> ExpertMapStore:
        """An empty store whose shapes its first maps set: fMoE's online setting (§6.3), maps collected while
        serving a model the caller has not sized the store for."""
        return cls.empty(capacity, distance, 0, 0, 0, policy)

    def chosen(self, best: np.ndarray) -> None:
        """Count searches that chose the maps `best` (indices; repeats count each time)."""
        np.add.at(self.hits, np.asarray(best, np.int64), 1)

    def __len__(self) -> int:
        return len(self.maps)

    @property
    def nbytes(self) -> int:
        """Host memory the store's arrays hold (fMoE §4.4 sizes a 50K-map store at ~200 MB)."""
        return int(self.embeddings.nbytes + self.maps.nbytes)

    @property
    def prefix_norms2(self) -> np.ndarray:
        """[n, M] float64: the squared norm of each map's layers 0..m."""
        if self._prefix2 is None:
            self._prefix2 = _prefix_norms2(self.maps)
        return self._prefix2

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
        self.add_batch(np.asarray(embedding)[None], np.asarray(gate_map)[None])

    def add_batch(self, embeddings: np.ndarray, gate_maps: np.ndarray) -> None:
        """Store new iterations' maps [b, M, E] (embeddings [b, D]); once full, §4.4's update: the redundancy
        RDY [b, C] of the new iterations against the stored ones, each new one replacing its most redundant
        stored map that no earlier one of the batch replaced."""
        e = _unit(np.asarray(embeddings, np.float32))
        g = np.asarray(gate_maps, np.float32)
        if not len(self):  # an empty store takes its first maps' shapes (an unsized one has none yet)
            self.embeddings = np.zeros((0, *e.shape[1:]), np.float32)
            self.maps = np.zeros((0, *g.shape[1:]), np.float32)
            self._prefix2 = None
        room = min(max(self.capacity - len(self), 0), len(g))
        if room:
            self._prefix2 = np.concatenate([self.prefix_norms2, _prefix_norms2(g[:room])])
            self.embeddings = np.concatenate([self.embeddings, e[:room]])
            self.maps = np.concatenate([self.maps, g[:room]])
            self.hits = np.concatenate([self.hits, np.zeros(room, np.int64)])
        for start in range(room, len(g), self.capacity):  # at most C at once: each replaces a different map
            self._replace(e[start:start + self.capacity], g[start:start + self.capacity])

    def _replace(self, e: np.ndarray, g: np.ndarray) -> None:
        prefix, L = self.prefix_norms2, self.maps.shape[1]
        if self.policy == "hits":  # the least chosen maps, the oldest first among equals
            for x, victim in enumerate(np.argsort(self.hits, kind="stable")[:len(g)]):
                self.embeddings[victim], self.maps[victim], self.hits[victim] = e[x], g[x], 0
                prefix[victim] = _prefix_norms2(g[x:x + 1])[0]
            return
        flat = g.reshape(len(g), -1).astype(np.float64)
        norms = np.sqrt((flat ** 2).sum(axis=1)[:, None] * prefix[None, :, -1])
        traj = flat @ self.maps.reshape(len(self), -1).astype(np.float64).T / np.maximum(norms, 1e-12)
        redundancy = (self.distance / L) * (e @ self.embeddings.T) + ((L - self.distance) / L) * traj
        for x in range(len(g)):
            victim = int(np.argmax(redundancy[x]))
            redundancy[:, victim] = -np.inf
            self.embeddings[victim], self.maps[victim], self.hits[victim] = e[x], g[x], 0
            prefix[victim] = _prefix_norms2(g[x:x + 1])[0]

    def save(self, path: str) -> str:
        return save_arrays(path, dict(embeddings=self.embeddings, maps=self.maps,
                                      settings=np.asarray([self.capacity, self.distance,
                                                           POLICIES.index(self.policy)], np.int64)))

    @classmethod
    def load(cls, path: str) -> ExpertMapStore:
        tree = load_arrays(path, "expert maps")
        expect_kind(tree, path, "expert maps")
        capacity, distance, *policy = (int(v) for v in tree["settings"])  # stores saved before policies: 2 values
        return cls(capacity, distance, tree["embeddings"].astype(np.float32), tree["maps"].astype(np.float32),
                   POLICIES[policy[0] if policy else 0])


def gate_probabilities(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(axis=-1, keepdims=True)
    p = np.exp(z)
    return p / p.sum(axis=-1, keepdims=True)


def build_store(traces: Traces, embed_table: np.ndarray, *, capacity: int = 1024, distance: int = 1,
                prefill_lengths: Sequence[int] | None = None) -> ExpertMapStore:
    """One map per inference iteration, as the predictor stores them while serving (§4.1, §4.4). Traced sequence
    r is prompt r (its first prefill_lengths[r] tokens; default all of them) followed by the tokens its decode
    iterations fed (each one token: in a causal model, a traced token's gate distributions are those of the
    decode iteration that fed it). The prefill iteration's map is the mean gate distribution over the prompt,
    keyed by the prompt's mean input embedding; a decode iteration's is its token's own, keyed by that token's
    embedding."""
    M, E = traces.router_logits.shape[1:]
    lengths = np.diff(traces.starts)
    prefill = lengths if prefill_lengths is None else np.asarray(prefill_lengths)
    if len(prefill) != traces.num_prompts or (prefill < 1).any() or (prefill > lengths).any():
        raise ValueError(f"build_store: prefill_lengths must give 1..length tokens for each of the "
                         f"{traces.num_prompts} traced sequences; got {list(prefill)} for lengths {list(lengths)}")
    store = ExpertMapStore.empty(capacity, distance, M, E, embed_table.shape[1])
    for r in range(traces.num_prompts):
        start, stop = int(traces.starts[r]), int(traces.starts[r + 1])
        split = start + int(prefill[r])
        store.add(embed_table[traces.tokens[start:split]].mean(axis=0),
                  gate_probabilities(traces.router_logits[start:split]).mean(0))
        for t in range(split, stop):
            store.add(embed_table[traces.tokens[t]], gate_probabilities(traces.router_logits[t]))
    return store


def predict_sets(store: ExpertMapStore, embedding: np.ndarray, observed: np.ndarray, position: int, k: int, *,
                 semantic: bool = True, adaptive: bool = True) -> dict[int, tuple]:
    """What the predictor prefetches when MoE layer `position` (0-based among MoE layers) has run, with gate
    distributions `observed` [position + 1, E]: {target position: (expert ids, their map probabilities)}.
    fMoE §6.5's ablations: semantic=False is Map (T), no prediction for the first d layers; adaptive=False
    drops δ (§4.3), exactly the map's k most probable experts."""
    M, d = store.maps.shape[1], store.distance
    out = {}
    if position == 0 and semantic:  # the first d layers cannot be reached by a trajectory at distance d
        i, score = store.semantic(embedding)
        for target in range(min(d, M)):
            ids = select_experts(store.maps[i, target], score if adaptive else 1.0, k)  # score 1: δ = 0, top-k
            out[target] = (ids, store.maps[i, target, ids])
    if position + d < M:
        i, score = store.trajectory(observed[:position + 1])
        ids = select_experts(store.maps[i, position + d], score if adaptive else 1.0, k)
        out[position + d] = (ids, store.maps[i, position + d, ids])
    return out


def _valid_mean(a: jax.Array, valid: jax.Array | None) -> jax.Array:
    """[B, T, F] -> [B, F]: the mean over each row's valid tokens (valid [B, T]; None: all); 0 for a row with none."""
    if valid is None:
        return a.mean(axis=1)
    w = valid.astype(a.dtype)[..., None]
    return (a * w).sum(axis=1) / jnp.maximum(w.sum(axis=1), 1)


def _row_gates(graphdef: nnx.GraphDef, state: nnx.State, y: jax.Array, valid: jax.Array | None = None, *,
               rows: int) -> jax.Array:
    """Each row's (request's) mean gate distribution [rows, E] over its valid tokens."""
    mlp = nnx.merge(graphdef, state).mlp
    p = jax.nn.softmax(mlp.router_logits(y.reshape(-1, y.shape[-1]).astype(jnp.float32)), axis=-1)
    return _valid_mean(p.reshape(rows, -1, p.shape[-1]), valid)


@jax.jit
def _row_embeddings(inputs: jax.Array, valid: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """Each row's semantic embedding [B, D] (the mean of its valid input embeddings [B, T, D]) and whether it is
    a request's [B] (it has a valid token: padding rows have none)."""
    rows = jnp.ones(inputs.shape[:1], bool) if valid is None else valid.any(axis=1)
    return _valid_mean(inputs.astype(jnp.float32), valid), rows


def _padded(sets: list[np.ndarray], p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-row expert ids (most probable first) -> (ids [B, K] padded with -1, their map probabilities [B, K])."""
    width = max(1, *(len(s) for s in sets))
    ids, probs = np.full((len(sets), width), -1, np.int32), np.zeros((len(sets), width), np.float32)
    for b, s in enumerate(sets):
        ids[b, :len(s)], probs[b, :len(s)] = s, p[b, s]
    return ids, probs


class _PassMatcher:
    """One forward pass's matching, run on the matcher thread: per-row semantic search, then per MoE layer the
    rows' trajectories against every stored map. The cosine over layers 0..j is kept as running dot products
    [B, C] and the maps' prefix norms, so each layer costs one [B, E] x [E, C] product, not a search over
    (j + 1)·E columns."""

    def __init__(self, store: ExpertMapStore, embeddings: np.ndarray, adaptive: bool = True,
                 requests: np.ndarray | None = None):
        self.store, self.adaptive = store, adaptive  # adaptive=False: δ off, each row's k most probable (§6.5)
        self.embeddings = np.asarray(embeddings, np.float32)
        # [B] bool: the rows that are requests; padding rows get no sets and store no maps
        self.requests = np.ones(len(self.embeddings), bool) if requests is None else np.asarray(requests, bool)
        B, C = len(self.embeddings), len(store)
        self.dots, self.norm2 = np.zeros((B, C)), np.zeros(B)
        self.prefix2 = store.prefix_norms2  # [C, M]
        self.observed: list[np.ndarray] = []

    def semantic(self, k: int) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """The first d MoE layers from each row's most similar stored embedding (§4.2)."""
        if not len(self.store):  # nothing to match yet (online, from an empty store)
            return {}
        scores = _unit(self.embeddings) @ self.store.embeddings.T  # [B, C]
        best = np.argmax(scores, axis=1)
        score = scores[np.arange(len(best)), best]
        self.store.chosen(best[self.requests])
        return {t: self._select(best, score, t, k) for t in range(min(self.store.distance, self.store.maps.shape[1]))}

    def layer(self, j: int, gates: np.ndarray, k: int) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """MoE layer j's observed gate distributions [B, E] -> each row's sets for layer j + d (§4.2-4.3)."""
        g = np.asarray(gates, np.float64)
        self.observed.append(g)
        if not len(self.store):  # the pass is only recorded, to be stored (online, from an empty store)
            return {}
        self.dots += g @ self.store.maps[:, j].astype(np.float64).T
        self.norm2 += (g ** 2).sum(axis=1)
        scores = self.dots / np.maximum(np.sqrt(self.norm2[:, None] * self.prefix2[None, :, j]), 1e-12)
        target = j + self.store.distance
        if target >= self.store.maps.shape[1]:
            return {}
        best = np.argmax(scores, axis=1)
        self.store.chosen(best[self.requests])
        return {target: self._select(best, scores[np.arange(len(best)), best], target, k)}

    def _select(self, best: np.ndarray, score: np.ndarray, target: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        p = self.store.maps[best, target]  # [B, E]: each row's matched map at the target layer
        score = score if self.adaptive else np.ones_like(score)  # score 1: δ = 0, top-k
        none = np.zeros(0, np.int64)
        return _padded([select_experts(p[b], float(score[b]), k) if self.requests[b] else none
                        for b in range(len(best))], p)

    def iteration_maps(self) -> tuple[np.ndarray, np.ndarray]:
        """(embeddings [B', D], maps [B', M, E]) of the pass's distinct request rows: the iterations to store
        (§4.4); padding rows are not stored, identical rows once."""
        maps = np.stack(self.observed, axis=1).astype(np.float32)[self.requests]
        embeddings = self.embeddings[self.requests]
        _, first = np.unique(np.concatenate([embeddings, maps.reshape(len(maps), -1)], axis=1), axis=0,
                             return_index=True)
        keep = np.sort(first)
        return embeddings[keep], maps[keep]


class ExpertMapPredictor:
    """fMoE's matcher beside the layer loop (§4.3, "asynchronous expert map matching"): the loop publishes each
    pass's input embeddings and each MoE layer's gate distributions as device arrays (dispatched, never read on
    the loop's thread); one matcher thread reads them once they are computed, matches every row (request) of the
    batch on its own, and answers with per-row sets. `predict` returns `Pending` results; the cached placement
    reads the ones for the layers ahead after the layer's own work is dispatched, so the search runs while that
    layer computes. The predictor never reads a device array on the loop's thread; the loop does wait for each
    layer's search result (right after dispatching the layer), and the first MoE layer's own prefetch waits for
    the semantic search. The layer loop's validity mask (LayeredSteps.valid) keeps padding out: a row's embedding
    and gate distributions are means over its valid tokens, and padding rows are neither matched nor stored."""

    def __init__(self, store: ExpertMapStore, *, update: bool = True, semantic: bool = True, adaptive: bool = True,
                 fallback: Predictor | None = None):
        """semantic / adaptive: fMoE §6.5's ablations (predict_sets); both on is fMoE, Map (T+S+δ).
        fallback: what predicts while the store is empty (fMoE's online setting, §6.3: maps collected while
        serving); each pass begun on an empty store is its, and is still recorded and stored as maps."""
        self.store, self.distance, self.update = store, store.distance, update
        self.semantic, self.adaptive, self.fallback = semantic, adaptive, fallback
        if len(store) == 0 and (fallback is None or not update):
            raise ValueError("expert maps: the store is empty (build it with `python -m launch.calibrate --maps`, "
                             "or serve from it with a fallback predictor and update=True: fMoE's online setting)")
        if fallback is not None and fallback.distance != store.distance:
            raise ValueError(f"expert maps: the fallback predictor's distance {fallback.distance} differs from the "
                             f"store's {store.distance}")
        self._cold = False  # this pass began on an empty store: the fallback predicts it
        self._matcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="expert-map-matcher")  # FIFO: in order
        self._futures: list[Future] = []
        self._pass: _PassMatcher | None = None  # the pass being matched (the matcher thread's)

    def begin_pass(self, steps: LayeredSteps) -> None:
        if not len(self.store):  # online and still empty: the last pass's maps first (its arrays are computed)
            self.drain()
        # what the matcher finished: its errors surface here; what it has not (storing the last pass's maps) goes
        # on: the thread takes its work in order, so this pass is matched against the updated store all the same
        done = [future for future in self._futures if future.done()]
        self._futures = [future for future in self._futures if not future.done()]
        for future in done:  # dropped first: an error fails the pass it surfaces in, not every later one
            future.result()  # re-raises the matcher's error
        self._steps = steps
        self._rows = steps.inputs.shape[0]
        # the store only grows, and the matcher takes this pass after every add submitted before it
        self._cold = len(self.store) == 0
        if self.fallback is not None:
            self.fallback.begin_pass(steps)
        self._valid = getattr(steps, "valid", None)  # [B, T]: the pass's request tokens (None: all)
        self._submit(self._begin, *_row_embeddings(steps.inputs, self._valid))  # dispatched; read on the matcher

    def _submit(self, fn: Callable, *args: Any) -> Future:
        future = self._matcher.submit(fn, *args)
        self._futures.append(future)
        return future

    def _begin(self, embeddings: jax.Array, requests: jax.Array) -> None:
        self._pass = _PassMatcher(self.store, np.asarray(embeddings), self.adaptive, np.asarray(requests))

    def predict(self, pass_no: int, layer: int, x: Arrays, y: Arrays, idx: Arrays, weights: Arrays) -> Prediction:
        moe = self._steps.moe_layers
        j, k = moe.index(layer), int(idx.shape[-1])
        if self._cold:  # recorded on the matcher thread all the same: the pass's maps fill the store
            assert self.fallback is not None
            self._submit(self._match, j, self._steps.layers[layer](_row_gates, y, self._valid, rows=self._rows), k,
                         j == len(moe) - 1)
            return self.fallback.predict(pass_no, layer, x, y, idx, weights)
        out: Prediction = {}
        if j == 0 and self.semantic:  # first, so the first layer's own prefetch waits for the input embeddings only
            semantic = self._submit(self._first_layers, k)
            out |= {moe[t]: Pending(semantic, t) for t in range(min(self.distance, len(moe)))}
        gates = self._steps.layers[layer](_row_gates, y, self._valid, rows=self._rows)  # read on the matcher thread
        future = self._submit(self._match, j, gates, k, j == len(moe) - 1)
        if j + self.distance < len(moe):
            out[moe[j + self.distance]] = Pending(future, j + self.distance)
        return out

    def _first_layers(self, k: int) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        assert self._pass is not None
        return self._pass.semantic(k)

    def _match(self, j: int, gates: jax.Array, k: int, last: bool) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        assert self._pass is not None
        out = self._pass.layer(j, np.asarray(gates), k)
        if last and self.update:  # the pass is done: its iterations' maps join the store (§4.4)
            self.store.add_batch(*self._pass.iteration_maps())
        return out

    def drain(self) -> None:
        """Wait for the matcher to finish what was published (re-raising its errors): the store is then settled."""
        futures, self._futures = self._futures, []
        for future in futures:
            future.result()

    def describe(self) -> str:
        online = "" if self.fallback is None else f"; {self.fallback.describe()} while the store is empty"
        return (f"expert_map ({len(self.store)} maps of capacity {self.store.capacity}, "
                f"{self.store.nbytes / 2**20:.2f} MiB, distance {self.distance}, "
                f"{ablation_name(self.semantic, self.adaptive)}; matched per request, asynchronously{online})")


def ablation_name(semantic: bool, adaptive: bool) -> str:
    """fMoE §6.5's names: "T", "T+S", "T+S+δ" (and "T+δ")."""
    return "T" + ("+S" if semantic else "") + ("+δ" if adaptive else "")


def replay_predictions(store: ExpertMapStore, traces: Traces, embed_table: np.ndarray, k: int, *,
                       semantic: bool = True, adaptive: bool = True) -> tuple[dict[int, tuple], float]:
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
            sets = predict_sets(store, embeddings[prompt_of[n]], probs[n, :j + 1], j, k, semantic=semantic,
                                adaptive=adaptive)
            for target, (chosen, p) in sets.items():
                ids[target][n, :len(chosen)], weights[target][n, :len(chosen)] = chosen, p
                sizes.append(len(chosen))
    out = {traces.moe_layers[t]: (ids[t], weights[t]) for t in range(M) if (ids[t] >= 0).any()}
    return out, float(np.mean(sizes)) if sizes else 0.0
