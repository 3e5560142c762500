"""The cached-decode modes of `launch.bench offload` and what each needs, built from one calibration pass over the
resident engine: default vectors (router), a distilled estimator (estimator) and an expert-map store (expert_map
and fMoE §6.5's ablations Map (T) and Map (T+S); expert_map is Map (T+S+δ)).

expert_map-online starts from an empty store (fMoE §6.3's online setting): the router predictor (the calibration's
default vectors) predicts until the store holds maps, and every pass served, the warm-up's included, adds its maps.

moe_infinity is the baseline fMoE compares with (MoE-Infinity's request-level expert activation matrices,
moejax.offload.predict.activation_matrices): one matrix per calibration prompt, the collection not updated while
timed (as the expert_map modes' store); moe_infinity-online starts from an empty collection, the router predictor
standing in until a request is done.

on-demand is the LRU-only baseline when --eviction is lru: the expert cache with no predictor, so every miss is
loaded when its layer runs."""
from __future__ import annotations

import copy
import dataclasses
import os
import time
from collections.abc import Callable

import numpy as np
from flax import nnx

from launch.bench.quality import stdlib_texts
from launch.distill import text_prompts
from moejax.engine import Engine
from moejax.offload.predict import DefaultVectors, EstimatorPredictor, RouterPredictor, replay
from moejax.offload.predict.activation_matrices import ActivationMatrices, ActivationMatrixPredictor
from moejax.offload.predict.estimator import EstimatorNet
from moejax.offload.predict.expert_maps import ExpertMapPredictor, ExpertMapStore, build_store
from moejax.offload.predict.hit_counts import request_counts
from moejax.offload.predict.traces import record
from moejax.train.distill import distill

# mode -> (predictor, options of ExpertMapPredictor or of the cached placement)
MODES: dict[str, tuple[str | None, dict[str, bool]]] = {
    "on-demand": (None, {}),
    "prefetch": ("router", {}),
    "speculative": ("router", dict(speculative=True)),
    "estimator": ("estimator", {}),
    "expert_map": ("expert_map", dict(semantic=True, adaptive=True)),
    "expert_map-T+S": ("expert_map", dict(semantic=True, adaptive=False)),
    "expert_map-T": ("expert_map", dict(semantic=False, adaptive=False)),
    # fMoE's online setting (§6.3): an empty store filled while serving, the router predictor until it holds maps
    "expert_map-online": ("expert_map", dict(online=True)),
    # MoE-Infinity (fMoE's baseline): request-level activation matrices, from the calibration or collected online
    "moe_infinity": ("moe_infinity", {}),
    "moe_infinity-online": ("moe_infinity", dict(online=True)),
}
DEFAULT_MODES = "on-demand,prefetch,speculative,expert_map"


def parse_modes(text: str) -> list[str]:
    """--modes -> the modes in order, on-demand first (the baseline every saving is measured against)."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"--modes: unknown {', '.join(unknown)} (choose from {', '.join(MODES)})")
    return ["on-demand"] + [m for m in dict.fromkeys(modes) if m != "on-demand"]


def calibration_prompts(engine: Engine, source: str, count: int, tokens: int, seed: int) -> tuple[list[list[int]], str]:
    """`count` prompts of `tokens` ids: random ids, or windows of the stdlib corpus's training split (needs the
    model's tokenizer) -> (prompts, how they were made)."""
    rng = np.random.default_rng(seed)
    if source == "random":
        return rng.integers(0, engine.config.vocab_size, (count, tokens)).tolist(), "random ids"
    return stdlib_prompts(engine, "train", count, tokens, rng), "windows of the stdlib corpus (train split)"


def stdlib_prompts(engine: Engine, split: str, count: int, tokens: int, rng: np.random.Generator) -> list[list[int]]:
    """`count` windows of `tokens` ids from a random sample of the stdlib split's files (one window each at most,
    so the prompts are different requests, as fMoE's maps assume)."""
    texts = stdlib_texts(split)
    prompts: list[list[int]] = []
    for i in rng.permutation(len(texts)):
        windows = text_prompts(engine, [texts[i]], tokens)  # an empty file has none
        if windows and len(windows[0]) == tokens:
            prompts.append(windows[0])
        if len(prompts) == count:
            return prompts
    raise ValueError(f"stdlib {split}: only {len(prompts)} files hold {tokens} tokens, {count} wanted")


@dataclasses.dataclass
class Calibration:
    vectors_path: str  # default vectors (router modes)
    estimator: EstimatorNet | None  # estimator mode
    store: ExpertMapStore | None  # as built (each expert_map mode serves a copy: serving adds maps)
    record: dict  # what was built from what, and how long it took
    requests: np.ndarray | None = None  # moe_infinity: one activation matrix per calibration prompt [R, M, E]


def build(resident: Engine, prompts: list[list[int]], modes: list[str], directory: str, *, distill_steps: int,
          capacity: int, log: Callable[[str], None]) -> Calibration:
    """Trace `prompts` through the resident engine once; from the traces: default vectors (saved under
    `directory`), an estimator when a mode needs one, an expert-map store (one map per prompt) when one does."""
    t0 = time.perf_counter()
    traces, vectors = record(resident, prompts, max_tokens_per_prompt=max(len(p) for p in prompts),
                             max_tokens=2 ** 62)
    made: dict = dict(prompts=len(prompts), tokens=int(len(traces.tokens)), trace_s=time.perf_counter() - t0)
    path = vectors.save(os.path.join(directory, "vectors"))
    needs = {MODES[m][0] for m in modes}
    net = store = None
    if "estimator" in needs:
        t0 = time.perf_counter()
        net = distill(replay.steps_of(resident), traces, vectors, distance=1, train_steps=distill_steps,
                      eval_every=max(distill_steps // 4, 1), validation_every=min(10, traces.num_prompts),
                      log=log, progress=False)
        made.update(distill_steps=distill_steps, distill_s=time.perf_counter() - t0,
                    estimator_info={k: v for k, v in net.info.items() if isinstance(v, (int, float, str))})
    if "expert_map" in needs:
        embed = np.asarray(nnx.merge(resident.graphdef, resident.params).embed[...], np.float32)
        store = build_store(traces, embed, capacity=capacity, distance=1)
        made.update(store=store_size(store))
    requests = None
    if "moe_infinity" in needs:
        requests = request_counts(traces, resident.config.num_experts_per_tok)
        made.update(activation_matrices=len(requests))
    return Calibration(path, net, store, made, requests)


def store_size(store: ExpertMapStore) -> dict:
    return dict(maps=len(store), capacity=store.capacity, bytes=store.nbytes)


def engine_options(mode: str, calibration: Calibration) -> dict:
    """The cached placement's options of `mode` (a fresh store copy for an expert_map mode)."""
    name, options = MODES[mode]
    if name is None:
        return {}
    if name == "router":
        return dict(predictor="router", prefetch_distance=1, default_vectors=calibration.vectors_path, **options)
    if name == "estimator":
        assert calibration.estimator is not None, "built for the estimator mode"
        return dict(predictor=EstimatorPredictor(calibration.estimator), prefetch_distance=1)
    if name == "moe_infinity":
        fallback = RouterPredictor(DefaultVectors.load(calibration.vectors_path))
        if options.get("online"):
            return dict(predictor=ActivationMatrixPredictor(ActivationMatrices(1024), fallback=fallback),
                        prefetch_distance=1)
        assert calibration.requests is not None, "built for the moe_infinity mode"
        # update=False: every timed run serves the calibration's matrices (as the expert_map modes do)
        return dict(predictor=ActivationMatrixPredictor(ActivationMatrices(len(calibration.requests),
                                                                           calibration.requests), update=False),
                    prefetch_distance=1)
    store = calibration.store
    assert store is not None, "built for the expert_map modes"
    if options.get("online"):
        return dict(predictor=ExpertMapPredictor(ExpertMapStore.unsized(store.capacity, store.distance),
                                                 fallback=RouterPredictor(DefaultVectors.load(calibration.vectors_path))),
                    prefetch_distance=1)
    # update=False: every timed run serves the calibration store (serving would add the repeated prompt's own map)
    return dict(predictor=ExpertMapPredictor(copy.deepcopy(store), update=False, semantic=options.get("semantic", True),
                                             adaptive=options.get("adaptive", True)),
                prefetch_distance=1)
