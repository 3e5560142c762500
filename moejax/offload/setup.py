"""`moejax.load`'s offloading options: checked, turned into a MemoryPlan, and into the placement the Engine runs."""
from __future__ import annotations

import dataclasses

import numpy as np

from moejax.config import ModelConfig
from moejax.offload.cached import Cached
from moejax.offload.expert_cache import POLICIES
from moejax.offload.host_store import is_routed_expert
from moejax.offload.memory_plan import MemoryPlanError, device_budget_bytes, plan_memory
from moejax.offload.predict import (PREDICTORS, DefaultVectors, EstimatorNet, EstimatorPredictor, HybridPredictor,
                                    OraclePredictor, PreviousHiddenPredictor, RouterPredictor)
from moejax.offload.predict.expert_maps import ExpertMapPredictor, ExpertMapStore
from moejax.offload.streamed import Streamed

OFFLOAD_OPTIONS = ("placement", "device_memory_gb", "window", "stream", "cache_slots", "eviction", "predictor",
                   "default_vectors", "estimator", "maps", "prefetch_distance", "speculative", "router_free")
STREAMS = ("python", "jit")
_ONLY_FOR = {"window": "streamed", "stream": "streamed", "cache_slots": "cached", "eviction": "cached",
             "predictor": "cached",
             "default_vectors": "cached", "estimator": "cached", "maps": "cached", "prefetch_distance": "cached",
             "speculative": "cached", "router_free": "cached"}


def _error(message: str):
    return ValueError(f"moejax.load: {message}")


def _check_predictor_options(options: dict) -> None:
    """The predictor and the files and modes it takes go together (a ValueError names the option)."""
    predictor = options.get("predictor")
    if isinstance(predictor, str) and predictor not in PREDICTORS:
        raise _error(f"predictor must be one of {', '.join(PREDICTORS)} or a predictor object; got {predictor!r}")
    if predictor == "router" and not options.get("default_vectors"):
        raise _error("predictor 'router' needs default_vectors: a directory written by DefaultVectors.save "
                     "(make one with `python -m launch.calibrate`)")
    if predictor in ("estimator", "hybrid") and not options.get("estimator"):
        raise _error(f"predictor {predictor!r} needs estimator: a directory written by `python -m launch.distill`")
    if options.get("estimator") and predictor not in ("estimator", "hybrid"):
        raise _error(f"estimator applies to predictor 'estimator' or 'hybrid', not {predictor!r}")
    if predictor == "expert_map" and not options.get("maps"):
        raise _error("predictor 'expert_map' needs maps: a directory written by `python -m launch.calibrate --maps`")
    if options.get("maps") and predictor != "expert_map":
        raise _error(f"maps applies to predictor 'expert_map', not {predictor!r}")
    if predictor == "expert_map" and options.get("speculative"):
        raise _error("predictor 'expert_map' predicts one set of experts per pass, not each token's: it prefetches "
                     "only, and speculative=True cannot run it")
    if options.get("default_vectors") and predictor != "router":
        raise _error(f"default_vectors applies to predictor 'router', not {predictor!r} (an estimator directory "
                     "holds its own)")
    if options.get("router_free") and not options.get("speculative"):
        raise _error("router_free=True applies to speculative=True (it chains predictions in speculative mode)")
    if options.get("speculative") and predictor is None:
        raise _error("speculative=True needs a predictor")


def offload_plan(cfg: ModelConfig, shapes: dict, options: dict):
    """Abstract parameter shapes + load options -> MemoryPlan (ValueError naming the option or the numbers)."""
    placement = options.get("placement") or "auto"
    spread = options.get("layout") is not None and placement == "auto"  # weights split over devices: not planned
    for name, only in _ONLY_FOR.items():
        if options.get(name) not in (None, False) and placement not in ("auto", only):
            raise _error(f"{name} applies to placement {only!r}, not {placement!r}")
    for name in ("window", "cache_slots", "prefetch_distance"):
        value = options.get(name)
        if value is not None and (not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1):
            raise _error(f"{name} must be an int >= 1, got {value!r}")
    if options.get("stream", "python") not in STREAMS:
        raise _error(f"stream must be one of {', '.join(STREAMS)}; got {options['stream']!r}")
    if options.get("stream") == "jit" and options.get("window") is not None:
        raise _error("window applies to stream='python' (inside the jit XLA schedules the copies)")
    eviction = options.get("eviction") or "lru"
    if eviction not in POLICIES:
        raise _error(f"eviction must be one of {', '.join(POLICIES)}; got {eviction!r}")
    _check_predictor_options(options)
    nbytes = lambda a: int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize  # noqa: E731
    total = sum(nbytes(a) for a in shapes.values())
    experts = sum(nbytes(a) for path, a in shapes.items() if is_routed_expert(path))
    moe_layers = sum(cfg.is_moe(i) for i in range(cfg.num_layers))
    E = cfg.num_experts or 1
    try:
        plan = plan_memory(total_bytes=total, expert_bytes=experts // max(moe_layers * E, 1), experts_per_layer=E,
                           moe_layers=moe_layers, top_k=cfg.num_experts_per_tok or 1,
                           budget_bytes=None if spread else device_budget_bytes(options.get("device_memory_gb")),
                           placement=placement,
                           window=options.get("window"), cache_slots=options.get("cache_slots"))
    except MemoryPlanError as e:
        raise _error(str(e)) from None
    if spread:
        plan = dataclasses.replace(plan, reason="a layout spreads the weights over devices")  # planned per device
        # by moejax.sharding.setup once the layout is resolved
    elif options.get("layout") is not None:
        plan = dataclasses.replace(plan, reason=plan.reason + "; planned as one device: under experts=async_ep each "
                                   "device holds the current and next layer's experts whole and window layers of its "
                                   "1/devices shards")
    if streams_in_jit(plan, options):
        plan = dataclasses.replace(plan, reason=plan.reason + "; stream='jit': XLA decides how many layers of "
                                   "experts are on the device at once (the window is a plan, not enforced)")
    return plan


def streams_in_jit(plan, options: dict) -> bool:
    """Streamed experts as host-memory inputs of the resident jits (XLA copies them in) instead of a Python loop."""
    return plan.placement == "streamed" and options.get("stream") == "jit"


def _same_distance(options: dict, built_for: int, what: str) -> int:
    distance = options.get("prefetch_distance")
    if distance is not None and distance != built_for:
        raise ValueError(f"prefetch_distance {distance} differs from the {what}'s, built for distance {built_for}")
    return built_for


def _predictor(options: dict):
    """The predictor object named by the options (its files read here, at load), or what was given, or None."""
    name = options.get("predictor")
    distance = options.get("prefetch_distance") or 1
    if name == "router":
        return RouterPredictor(DefaultVectors.load(options["default_vectors"]), distance)
    if name in ("estimator", "hybrid"):
        net = EstimatorNet.load(options["estimator"])
        _same_distance(options, net.shape.distance, "estimator")
        return EstimatorPredictor(net) if name == "estimator" else HybridPredictor(net)
    if name == "expert_map":
        store = ExpertMapStore.load(options["maps"])
        _same_distance(options, store.distance, "expert maps")
        return ExpertMapPredictor(store)
    if name == "previous_hidden":
        return PreviousHiddenPredictor(distance)
    if name == "oracle":
        return OraclePredictor()
    return name


def placement_factory(plan, options: dict, kernels):
    """-> make(store) building the placement of an offloaded plan (predictor files are read here, at load)."""
    try:
        predictor = _predictor(options)
    except ValueError as e:
        raise _error(str(e)) from None

    def make(store):
        if plan.placement == "streamed":
            return Streamed(store, plan.window, kernels.experts)
        return Cached(store, plan.cache_slots, options.get("eviction") or "lru", kernels.experts,
                      predictor=predictor, speculative=bool(options.get("speculative")),
                      router_free=bool(options.get("router_free")),
                      pass_experts=plan.pass_experts)
    return make
