"""A placement and its settings as one frozen dataclass, checked in one place (`PlacementSettings.__post_init__`):
what `moejax.load`'s offloading keywords become. A ValueError names the setting."""
from __future__ import annotations

import dataclasses

import numpy as np

from moejax.offload.expert_cache import POLICIES
from moejax.offload.memory_plan import PLACEMENTS
from moejax.offload.predict import PREDICTORS

STREAMS = ("python", "jit")
_ONLY_FOR = {"window": "streamed", "stream": "streamed", "cache_slots": "cached", "eviction": "cached",
             "predictor": "cached", "default_vectors": "cached", "estimator": "cached", "maps": "cached",
             "prefetch_distance": "cached", "speculative": "cached", "router_free": "cached"}


def _error(message: str):
    return ValueError(f"moejax.load: {message}")


@dataclasses.dataclass(frozen=True)
class PlacementSettings:
    """Where routed experts live on one device (moejax.offload) and the settings of that placement; None: not given
    (the memory plan or the placement decides). See `moejax.load` for each setting."""
    placement: str = "auto"
    device_memory_gb: float | None = None
    window: int | None = None
    stream: str | None = None
    cache_slots: int | None = None
    eviction: str | None = None
    predictor: object = None  # a name in PREDICTORS or a predictor object
    default_vectors: str | None = None
    estimator: str | None = None
    maps: str | None = None
    prefetch_distance: int | None = None
    speculative: bool = False
    router_free: bool = False

    def __post_init__(self):
        if self.placement not in PLACEMENTS:
            raise _error(f"placement must be one of {', '.join(PLACEMENTS)}; got {self.placement!r}")
        for name, only in _ONLY_FOR.items():
            if getattr(self, name) not in (None, False) and self.placement not in ("auto", only):
                raise _error(f"{name} applies to placement {only!r}, not {self.placement!r}")
        for name in ("window", "cache_slots", "prefetch_distance"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1):
                raise _error(f"{name} must be an int >= 1, got {value!r}")
        if self.stream not in (None, *STREAMS):
            raise _error(f"stream must be one of {', '.join(STREAMS)}; got {self.stream!r}")
        if self.stream == "jit" and self.window is not None:
            raise _error("window applies to stream='python' (inside the jit XLA schedules the copies)")
        if self.eviction not in (None, *POLICIES):
            raise _error(f"eviction must be one of {', '.join(POLICIES)}; got {self.eviction!r}")
        self._check_predictor()

    def _check_predictor(self) -> None:
        """The predictor and the files and modes it takes go together."""
        predictor = self.predictor
        if isinstance(predictor, str) and predictor not in PREDICTORS:
            raise _error(f"predictor must be one of {', '.join(PREDICTORS)} or a predictor object; got {predictor!r}")
        if predictor == "router" and not self.default_vectors:
            raise _error("predictor 'router' needs default_vectors: a directory written by DefaultVectors.save "
                         "(make one with `python -m launch.calibrate`)")
        if predictor in ("estimator", "hybrid") and not self.estimator:
            raise _error(f"predictor {predictor!r} needs estimator: a directory written by `python -m launch.distill`")
        if self.estimator and predictor not in ("estimator", "hybrid"):
            raise _error(f"estimator applies to predictor 'estimator' or 'hybrid', not {predictor!r}")
        if predictor == "expert_map" and not self.maps:
            raise _error("predictor 'expert_map' needs maps: a directory written by `python -m launch.calibrate "
                         "--maps`")
        if self.maps and predictor != "expert_map":
            raise _error(f"maps applies to predictor 'expert_map', not {predictor!r}")
        if predictor == "expert_map" and self.speculative:
            raise _error("predictor 'expert_map' predicts one set of experts per pass, not each token's: it "
                         "prefetches only, and speculative=True cannot run it")
        if self.default_vectors and predictor != "router":
            raise _error(f"default_vectors applies to predictor 'router', not {predictor!r} (an estimator directory "
                         "holds its own)")
        if self.router_free and not self.speculative:
            raise _error("router_free=True applies to speculative=True (it chains predictions in speculative mode)")
        if self.speculative and predictor is None:
            raise _error("speculative=True needs a predictor")

    @property
    def streams_in_jit(self) -> bool:
        return self.stream == "jit"

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))
