"""Cached placement (Speculating Experts, fMoE): a fixed number of device slots, each holding one expert of one
layer, shared by all MoE layers (moejax.offload.expert_cache decides who sits where and who is evicted).
A MoE layer asks for the experts its tokens use; misses are loaded on demand and waited for. With a predictor,
the experts it expects `distance` layers ahead are prefetched right after this layer's work is issued, so the
copies overlap the compute.

- exact (speculative=False): the true router's experts run; predictions only move weights, so the logits
  equal the resident model's.
- speculative=True: a layer runs the experts and weights predicted for it (as Speculating Experts does); the
  true router still runs, to count the tokens whose expert set differs and the expert choices it did not make
  (stats: mispredicted_tokens, mispredicted_choices).
- router_free (speculative only; Speculating Experts §6.4): where a layer runs predicted experts, the predictor
  also builds its next prediction from them, not from the true router's, so routing decisions chain from
  prediction to prediction, and the layer's attention step skips the router (moejax.offload.layered_steps.attend).
  With count_mispredictions the router runs anyway, only to count (a router and a host sync per MoE layer).

With prefill="stream" (Speculating Experts' setting: prefill loads, decode predicts), a pass of more than one
token per row copies every expert of each MoE layer in, the next layer's on their way while this one computes,
runs the true router's experts, and leaves the cache alone; the cache and the predictor serve the decode passes
(one token per row). The predictor still sees the prefill's routing (its state, e.g. expert maps, follows it).

Prefetches wait in a queue and at most `prefetch_depth` of their copies are on their way at once; a miss is
copied before anything still queued (fMoE §4.6: a miss pauses prefetching), and the queue resumes after it, so
a miss waits behind at most prefetch_depth copies instead of every prefetch issued.

The experts of one step are stacked into one [m, ...] array for the expert FFN (m rounded up to a power of
two); when a step needs more distinct experts than `pass_experts`, it runs in passes of that many and sums."""
from __future__ import annotations

import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.buckets import bucket
from moejax.offload import layered_steps
from moejax.offload.expert_cache import ExpertCache, prefetch_priority
from moejax.offload.host_store import HostStore
from moejax.offload.predict.protocol import Arrays, Predictor, resolved
from moejax.offload.stats import OffloadStats

# Prefetch copies on their way at once: two keep a copy engine busy between layers while a miss waits behind at
# most two (fMoE starts a miss ahead of all queued prefetches; moejax cannot reorder copies already issued).
PREFETCH_DEPTH = 2


def routed_subset(graphdef: nnx.GraphDef, state: nnx.State, y: jax.Array, idx: jax.Array, weights: jax.Array,
                  local_of: jax.Array, experts: list[dict[str, jax.Array]], *, backend: str) -> jax.Array:
    """Routed output [N, D] of the experts in `experts` (a list of per-expert dicts); local_of [E] gives each
    expert's position in that list or -1, and tokens' choices outside it contribute nothing."""
    local = local_of[idx]
    present = local >= 0
    stacked = {name: jnp.stack([e[name] for e in experts]) for name in experts[0]}
    mlp = nnx.merge(graphdef, state).mlp
    return mlp.routed(y.reshape(-1, y.shape[-1]), jnp.where(present, local, 0), jnp.where(present, weights, 0.0),
                      stacked, backend)


def _ready(array: jax.Array) -> bool:
    """Whether a copy has landed, without waiting (jax.Array's type does not declare ArrayImpl.is_ready)."""
    return bool(array.is_ready())  # type: ignore[attr-defined]


@jax.jit
def _mispredicted(predicted: jax.Array, true: jax.Array) -> jax.Array:
    """-> [tokens whose predicted expert set differs, predicted (token, expert) choices the router did not make]."""
    wrong = ~jnp.any(predicted[:, :, None] == true[:, None, :], axis=2)
    return jnp.stack([jnp.sum(jnp.any(wrong, axis=1)), jnp.sum(wrong)])


class CachedExpertsRuntime(layered_steps.LayerRuntime):
    name = "cached"

    def __init__(self, store: HostStore, cache_slots: int, eviction: str, backend: str, *,
                 predictor: Predictor | None = None, speculative: bool = False, router_free: bool = False,
                 pass_experts: int | None = None, count_mispredictions: bool = False,
                 prefetch_depth: int = PREFETCH_DEPTH, prefill: str = "cache") -> None:
        if not store.per_expert:
            raise ValueError("cached placement needs a per_expert HostStore")
        if speculative and predictor is None:
            raise ValueError("cached placement: speculative=True needs a predictor")
        if router_free and not speculative:
            raise ValueError("cached placement: router_free=True needs speculative=True")
        if count_mispredictions and not router_free:
            raise ValueError("cached placement: count_mispredictions=True applies to router_free=True (speculative "
                             "mode without it runs the router and counts anyway)")
        self.router_free = router_free
        # speculative mode runs the true router, and so counts, unless router-free skips it
        self.counts_mispredictions = speculative and (count_mispredictions or not router_free)
        self.store, self.backend, self.predictor, self.speculative = store, backend, predictor, speculative
        self.cache = ExpertCache(cache_slots, eviction)
        self.pass_experts = min(pass_experts or cache_slots, cache_slots)
        self.stats: OffloadStats = OffloadStats()
        self._slots: list[dict[str, jax.Array] | None] = [None] * cache_slots
        self._planned: dict[int, tuple] = {}  # speculative: layer -> (idx, weights) predicted for this pass
        if prefill not in ("cache", "stream"):
            raise ValueError(f"cached placement: prefill must be 'cache' or 'stream', got {prefill!r}")
        self.prefill = prefill
        self._streaming = False  # this pass streams whole layers (a prefill pass with prefill="stream")
        self._ahead: dict[int, list[dict[str, jax.Array]]] = {}  # streaming: a layer's experts, copies started
        if prefetch_depth < 1:
            raise ValueError(f"cached placement: prefetch_depth must be >= 1, got {prefetch_depth}")
        self.prefetch_depth = prefetch_depth
        # slot -> (layer, expert) a prefetch placed there whose copy has not started, in the order to start them
        self._queued: dict[int, tuple[int, int]] = {}
        self._copying: list[dict[str, jax.Array]] = []  # prefetch copies started and maybe not done
        self._ran: set[int] = set()  # layers whose experts this pass has run: their queued guesses go last

    def begin_pass(self, steps: layered_steps.LayeredSteps) -> None:
        self._planned.clear()
        self._ran.clear()
        self._steps = steps
        self._streaming = self.prefill == "stream" and steps.inputs.shape[1] > 1  # [rows, tokens, D]: a prefill
        if self._streaming and steps.moe_layers and steps.moe_layers[0] not in self._ahead:
            self._ahead[steps.moe_layers[0]] = self._fetch_layer(steps.moe_layers[0])  # beside the layers before
        if self.predictor is not None:
            self.predictor.begin_pass(steps)

    def needs_router(self, layer: int) -> bool:
        """Whether `layer`'s attention step must run the true router (LayeredSteps): not where router-free
        speculation already planned the layer's experts, unless mispredictions are counted."""
        return self._streaming or not (self.router_free and layer in self._planned and not self.counts_mispredictions)

    def moe(self, handle: layered_steps.Layer, x: jax.Array, y: jax.Array, idx: jax.Array | None,
            weights: jax.Array | None) -> jax.Array:
        """idx, weights: the true router's choices, None where needs_router(layer) said it could be skipped."""
        if self._streaming:
            assert idx is not None and weights is not None  # a streamed pass runs every router
            return self._streamed_moe(handle, x, y, idx, weights)
        layer = handle.index
        s = self.stats[layer]
        self._start_queued()  # copies finished while the previous layer computed: room for queued ones
        source = self._planned.get(layer) if self.router_free else None
        src_idx, src_weights = (idx, weights) if source is None else source
        assert src_idx is not None and src_weights is not None  # no router only where a plan exists
        predicted = {} if self.predictor is None else \
            self.predictor.predict(self._steps.passes, layer, x, y, src_idx, src_weights)
        if layer in predicted:  # a prediction for this very layer (the oracle): load it as a prefetch first
            self._prefetch(layer, *resolved(predicted[layer]))
        if self.speculative:
            self._planned.update({target: resolved(p) for target, p in predicted.items()})
        if self.speculative and layer in self._planned:
            run_idx, run_weights = self._planned.pop(layer)
            s.speculated_tokens += run_idx.shape[0]
            if idx is not None and self.counts_mispredictions:
                tokens, choices = np.asarray(_mispredicted(run_idx, idx))
                s.checked_tokens += run_idx.shape[0]
                s.mispredicted_tokens += int(tokens)
                s.mispredicted_choices += int(choices)
        else:
            assert idx is not None and weights is not None  # unplanned layers run the router
            run_idx, run_weights = idx, weights
        self._ran.add(layer)  # from its request on, its guesses not requested are of no use to this pass
        out = self._routed_out(handle, y, run_idx, run_weights)
        x = handle(layered_steps.finish, x, y, out)
        # after this layer's work is issued: the copies overlap it, and so does a predictor still matching (Pending)
        ahead = {target: resolved(p) for target, p in predicted.items() if target != layer}
        if ahead:
            self._prefetch_ahead(layer, ahead)
        return x

    def _streamed_moe(self, handle: layered_steps.Layer, x: jax.Array, y: jax.Array, idx: jax.Array, weights: jax.Array
                      ) -> jax.Array:
        """A prefill pass with prefill="stream": every expert of the layer (copied during the previous MoE layer,
        else now), the true router's choices, the next MoE layer's experts started once this layer's work is
        issued; the cache is not touched. The predictor is told the routing (its state) and its guesses unused."""
        layer = handle.index
        s = self.stats[layer]
        if self.predictor is not None:
            self.predictor.predict(self._steps.passes, layer, x, y, idx, weights)
        experts = self._ahead.pop(layer, None) or self._fetch_layer(layer)
        start = time.perf_counter()
        jax.block_until_ready(experts)
        s.wait_s += time.perf_counter() - start
        n = len(experts)
        experts = experts + [experts[-1]] * (bucket(n) - n)
        out = handle(routed_subset, y, idx, weights, jnp.arange(self.store.num_experts(layer), dtype=jnp.int32),
                     experts, backend=self.backend)
        x = handle(layered_steps.finish, x, y, out)
        moe = self._steps.moe_layers
        position = moe.index(layer)
        if position + 1 < len(moe):  # after this layer's work is issued: the copies overlap it
            self._ahead[moe[position + 1]] = self._fetch_layer(moe[position + 1])
        return x

    def _fetch_layer(self, layer: int) -> list[dict[str, jax.Array]]:
        """Start copying every expert of `layer` (async), outside the cache's slots; counted as streamed."""
        s = self.stats[layer]
        experts = [self.store.fetch_expert(layer, e) for e in range(self.store.num_experts(layer))]
        s.streamed_experts += len(experts)
        s.bytes_h2d += len(experts) * self.store.expert_bytes(layer)
        return experts

    def _request(self, layer: int, chunk: np.ndarray) -> list[dict[str, jax.Array]]:
        self._wait(layer, self._start_request(layer, chunk))
        return [self._held((layer, int(e))) for e in chunk]

    def _held(self, key: tuple[int, int]) -> dict[str, jax.Array]:
        """The arrays of an expert the cache holds (one just requested)."""
        slot = self.cache.slot(key)
        arrays = None if slot is None else self._slots[slot]
        assert arrays is not None, f"expert {key} is not in the cache"
        return arrays

    def _prefetch(self, layer: int, p_idx: Arrays, p_weights: Arrays) -> None:
        """Load the experts predicted for this very layer, the highest predicted weight first."""
        self._issue([(share, layer, expert) for expert, share in self._shares(layer, p_idx, p_weights).items()])

    def _prefetch_ahead(self, now: int, predicted: dict[int, tuple[Arrays, Arrays]]) -> None:
        """Load the experts predicted for the MoE layers ahead in one queue, ordered across those layers by fMoE's
        prefetch priority (§4.5): predicted weight / MoE layers ahead, so a likely expert two layers on can go
        before an unlikely one of the next layer; what fits is what matters most. The cache's scores stay the
        weights (eviction priority)."""
        moe = self._steps.moe_layers
        shares: dict[Sequence[int], float] = {
            (target, expert): share for target, (p_idx, p_weights) in predicted.items()
            for expert, share in self._shares(target, p_idx, p_weights).items()}
        self._issue([(float(prefetch_priority(np.array([share]), moe.index(target), moe.index(now))[0]), target,
                      expert) for (target, expert), share in shares.items()], shares)

    def _shares(self, layer: int, p_idx: Arrays, p_weights: Arrays) -> dict[int, float]:
        """Each predicted expert's weight, summed over the rows, as a share of the rows."""
        ids, w = np.asarray(p_idx).reshape(-1), np.asarray(p_weights, np.float64).reshape(-1)
        keep = ids >= 0
        share = np.bincount(ids[keep], weights=w[keep], minlength=self.store.num_experts(layer)) / p_idx.shape[0]
        return {int(e): float(share[e]) for e in np.unique(ids[keep])}

    def _issue(self, queue: list[tuple[float, int, int]], scores: dict[Sequence[int], float] | None = None
               ) -> None:
        """Prefetch (priority, layer, expert) entries: the cache places them, the highest priority first (ties: the
        order given), and their copies join the queue in that order; the cache's priority scores are the experts'
        shares (scores; default the priorities)."""
        order = sorted(range(len(queue)), key=lambda i: -queue[i][0])
        keys = [(queue[i][1], queue[i][2]) for i in order]
        if scores is None:
            scores = {(layer, expert): priority for priority, layer, expert in queue}
        loads, _ = self.cache.prefetch(keys, scores)
        for key, slot in loads:
            self._slots[slot] = None  # the slot's former expert is evicted; the new one is not copied yet
            self._queued.pop(slot, None)
            self._queued[slot] = key
        self._start_queued()

    def _start_queued(self) -> None:
        """Start queued prefetch copies, in queue order, while fewer than prefetch_depth are on their way; guesses
        for layers this pass has already run wait behind the rest (they help the next pass at most)."""
        if any(layer in self._ran for layer, _ in self._queued.values()):
            self._queued = dict(sorted(self._queued.items(), key=lambda item: item[1][0] in self._ran))
        self._copying = [arrays for arrays in self._copying if not all(_ready(a) for a in arrays.values())]
        while self._queued and len(self._copying) < self.prefetch_depth:
            slot, (layer, expert) = next(iter(self._queued.items()))
            self._copying.append(self._load(layer, expert, slot))
            self.stats[layer].prefetches += 1

    def _load(self, layer: int, expert: int, slot: int) -> dict[str, jax.Array]:
        """Start copying one expert into a slot (async) and count its bytes; a prefetch queued for the slot is
        started or dropped by this (the slot now holds this expert)."""
        self._queued.pop(slot, None)
        arrays = self._slots[slot] = self.store.fetch_expert(layer, expert)
        self.stats[layer].bytes_h2d += self.store.expert_bytes(layer)
        return arrays

    # hooks of moejax.sharding.cached_ep (one cache per device): the routed output, a request split at its wait
    def _routed_out(self, handle: layered_steps.Layer, y: jax.Array, run_idx: jax.Array, run_weights: jax.Array
                    ) -> jax.Array:
        """The routed output [N, D] of the choices run_idx / run_weights, their experts requested from the cache
        in passes of pass_experts."""
        layer = handle.index
        needed = np.unique(np.asarray(run_idx))
        out = None
        for start in range(0, len(needed), self.pass_experts):
            chunk = needed[start: start + self.pass_experts]
            experts = self._request(layer, chunk)
            local_of = np.full((self.store.num_experts(layer),), -1, np.int32)
            local_of[chunk] = np.arange(len(chunk), dtype=np.int32)
            experts += [experts[-1]] * (bucket(len(experts)) - len(experts))  # fewer distinct shapes to compile
            part = handle(routed_subset, y, run_idx, run_weights, jnp.asarray(local_of), experts,
                          backend=self.backend)
            out = part if out is None else out + part
        assert out is not None  # every token has choices
        return out

    def _start_request(self, layer: int, chunk: np.ndarray) -> list[dict[str, jax.Array] | None]:
        """Request a chunk's experts from the cache and start the copies of its misses -> the arrays to wait for."""
        s = self.stats[layer]
        hits, loads, _ = self.cache.request([(layer, int(e)) for e in chunk])
        # misses start first, ahead of the prefetches still queued; a hit whose prefetch is still queued is a miss
        late = [slot for _, slot in hits if slot in self._queued]
        loaded = [self._load(layer, expert, slot) for (_, expert), slot in loads]
        loaded += [self._load(*self._queued[slot], slot) for slot in late]
        s.hits, s.misses = s.hits + len(hits) - len(late), s.misses + len(loads) + len(late)
        self._start_queued()  # the queue resumes behind the misses
        return loaded + [self._slots[slot] for _, slot in hits]  # prefetches may still be on the way

    def _wait(self, layer: int, arrays: list[dict[str, jax.Array] | None]) -> None:
        start = time.perf_counter()
        jax.block_until_ready(arrays)
        self.stats[layer].wait_s += time.perf_counter() - start

    def cache_stats(self) -> dict:
        return self.cache.stats()

    def reset_stats(self) -> None:
        self.stats = type(self.stats)()
        self.cache.reset_stats()

    def describe(self) -> str:
        pred = "none" if self.predictor is None else self.predictor.describe()
        mode = "exact"
        if self.speculative:
            mode = "speculative" + (", router-free" if self.router_free else "") + \
                ("" if self.counts_mispredictions else ", mispredictions not counted")
        stream = "; prefill passes stream every expert, one layer ahead" if self.prefill == "stream" else ""
        return (f"cached: {self.cache.num_slots} expert slots, eviction {self.cache.policy}, predictor {pred} "
                f"({mode}), up to {self.pass_experts} experts per pass, {self.prefetch_depth} prefetch copies in "
                f"flight at most{stream}")
