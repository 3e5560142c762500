"""The predictor `moejax.load`'s placement settings name (checked where they are built, moejax.offload.settings),
built at load and checked against the model."""
from __future__ import annotations

from typing import cast

from moejax.config import ModelConfig
from moejax.offload.predict import (
    DefaultVectors,
    EstimatorNet,
    EstimatorPredictor,
    HybridPredictor,
    OraclePredictor,
    PreviousHiddenPredictor,
    RouterPredictor,
    artifacts,
)
from moejax.offload.predict.activation_matrices import ActivationMatrices, ActivationMatrixPredictor
from moejax.offload.predict.expert_maps import ExpertMapPredictor, ExpertMapStore
from moejax.offload.predict.protocol import Predictor
from moejax.offload.settings import PlacementSettings

ONLINE_MAP_CAPACITY = 1024  # maps an online store keeps (launch.calibrate --maps's default)
ONLINE_REQUEST_CAPACITY = 1024  # request matrices the moe_infinity predictor keeps


def _error(message: str) -> ValueError:
    return ValueError(f"moejax.load: {message}")


def _same_distance(settings: PlacementSettings, built_for: int, what: str) -> int:
    distance = settings.prefetch_distance
    if distance is not None and distance != built_for:
        raise ValueError(f"prefetch_distance {distance} differs from the {what}'s, built for distance {built_for}")
    return built_for


def predictor_of(settings: PlacementSettings) -> Predictor | None:
    """The predictor object the settings name (its files read here, at load), or what was given, or None."""
    try:
        return _predictor(settings)
    except ValueError as e:
        raise _error(str(e)) from None


def _predictor(settings: PlacementSettings) -> Predictor | None:
    name = settings.predictor
    distance = settings.prefetch_distance or 1
    # PlacementSettings checked that each named predictor has its files
    if name == "router":
        assert settings.default_vectors is not None
        return RouterPredictor(DefaultVectors.load(settings.default_vectors), distance)
    if name in ("estimator", "hybrid"):
        assert settings.estimator is not None
        net = EstimatorNet.load(settings.estimator)
        _same_distance(settings, net.shape.distance, "estimator")
        return EstimatorPredictor(net) if name == "estimator" else HybridPredictor(net)
    if name == "expert_map":  # without maps: fMoE's online setting, from an empty store
        store = (ExpertMapStore.load(settings.maps) if settings.maps else
                 ExpertMapStore.unsized(ONLINE_MAP_CAPACITY, distance))
        distance = _same_distance(settings, store.distance, "expert maps")
        fallback = (RouterPredictor(DefaultVectors.load(settings.default_vectors), distance) if settings.default_vectors
                    else PreviousHiddenPredictor(distance))
        return ExpertMapPredictor(store, fallback=fallback)
    if name == "moe_infinity":  # collected while serving: the fallback predicts until a request is done
        fallback = (RouterPredictor(DefaultVectors.load(settings.default_vectors), distance) if settings.default_vectors
                    else PreviousHiddenPredictor(distance))
        return ActivationMatrixPredictor(ActivationMatrices(ONLINE_REQUEST_CAPACITY), distance, fallback=fallback)
    if name == "previous_hidden":
        return PreviousHiddenPredictor(distance)
    if name == "oracle":
        return OraclePredictor()
    return cast("Predictor | None", name)  # a predictor object given in the settings, or None


def check_predictor(predictor: object, cfg: ModelConfig) -> None:
    """The predictor built from files (moejax.offload.setup.predictor_of) against the model it is loaded with."""
    if isinstance(predictor, RouterPredictor):
        artifacts.check_vectors(predictor.vectors.vectors, cfg, artifacts.KINDS["default vectors"][1])
    elif isinstance(predictor, (EstimatorPredictor, HybridPredictor)):
        net = predictor.net if isinstance(predictor, EstimatorPredictor) else predictor.estimator.net
        artifacts.check_estimator(net.shape.hidden, net.shape.experts, net.vectors.vectors, cfg, artifacts.ESTIMATOR)
    elif isinstance(predictor, ExpertMapPredictor):
        if len(predictor.store):  # an online store starts empty and sized by the model's first pass
            artifacts.check_maps(predictor.store.embeddings, predictor.store.maps, cfg,
                                 artifacts.KINDS["expert maps"][1])
        if predictor.fallback is not None:
            check_predictor(predictor.fallback, cfg)
    elif isinstance(predictor, ActivationMatrixPredictor) and predictor.fallback is not None:
        check_predictor(predictor.fallback, cfg)
