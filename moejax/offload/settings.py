"""A placement and its settings as one frozen dataclass, checked in one place (`PlacementSettings.__post_init__`):
what `moejax.load`'s offloading keywords become. Each setting is an option (moejax.options): its type, range, choices
and help are on its field, and launch.serve's flags come from them. A ValueError names the setting."""
from __future__ import annotations

import dataclasses

from moejax import options
from moejax.offload.expert_cache import POLICIES
from moejax.offload.predict import PREDICTORS
from moejax.options import option

AUTO = "auto"  # the placement option's value that leaves the choice to moejax.load
# the placement option's values: moejax.placements' classes that size budgets (a test holds the two together)
PLACEMENTS = (AUTO, "resident", "streamed", "cached", "lightning")
STREAMS = ("python", "jit")
PREFILL_EXPERTS = ("cache", "stream")
STREAMED, CACHED = ("placement", "streamed"), ("placement", "cached")  # what an option `applies` to
LIGHTNING = ("placement", "lightning")
WHERE = ("host", "device")
# lightning's launch orders (moejax.lightning.schedule.ORDERS; a test holds the two together)
PIPELINE_SCHEDULES = ("cgopipe", "flexgen")


def _error(message: str) -> ValueError:
    return ValueError(f"moejax.load: {message}")


@dataclasses.dataclass(frozen=True)
class PlacementSettings:
    """Where routed experts live on one device (moejax.offload) and the settings of that placement; None: not given
    (the memory budget or the placement decides). Each field's help says what it does (launch.serve's flags)."""
    placement: str = option(
        AUTO, choices=PLACEMENTS,
        help="where routed experts live: auto (resident when the model fits --device-memory-gb, else streamed, else "
             "cached; lightning when the planned batch's KV cache does not fit beside the weights), resident, "
             "streamed (layers copied ahead from host memory; prefill batches are packed to the profiled saturation "
             "threshold), cached (an expert cache; for decode and small batches), lightning "
             "(MoE-Lightning's CGOPipe: the KV cache in host memory with decode attention on the host CPU, the "
             "experts paged in with a resident share; for generation batches whose KV does not fit the device)")
    device_memory_gb: float | None = option(
        None, type=float, above=0, help="device memory moejax may use (default: the device's; no cap on CPU)")
    window: int | None = option(None, type=int, minimum=1,
                                help="streamed: MoE layers copied ahead (default: planned)", applies=STREAMED)
    stream: str | None = option(
        None, type=str, choices=STREAMS,
        help="streamed: python (default; per-layer jits, --window layers copied ahead, Θ profiled) or jit (experts "
             "are host-memory inputs of the whole-model jit; XLA schedules the copies)", applies=STREAMED)
    pinned_staging_mb: float | None = option(
        None, type=float, above=0,
        help="streamed (stream python) or cached: keep the experts in pageable host memory and copy them through a "
             "pinned staging buffer of this many MiB (for models larger than the pinned memory a host allows; "
             "default: the experts live in pinned memory)")
    cache_slots: int | None = option(None, type=int, minimum=1, help="cached: expert slots (default: what fits)",
                                     applies=CACHED)
    eviction: str | None = option(None, type=str, choices=POLICIES, help="cached: eviction policy (default lru)",
                                  applies=CACHED)
    # a name in PREDICTORS or a predictor object (_check_predictor checks it)
    predictor: object = option(None, type=str, choices=PREDICTORS, checked=False, fingerprint=True,
                               help="cached: expert predictor for prefetch", applies=CACHED)
    default_vectors: str | None = option(
        None, type=str, path=True, fingerprint=True, applies=CACHED,
        help="cached, --predictor router: directory from `python -m launch.calibrate`; --predictor expert_map without "
             "--maps, or moe_infinity: the router predictor that stands in while the store is empty")
    estimator: str | None = option(
        None, type=str, path=True, fingerprint=True,
        help="cached, --predictor estimator|hybrid: directory from `python -m launch.distill`", applies=CACHED)
    maps: str | None = option(
        None, type=str, path=True,
        help="cached, --predictor expert_map: directory from `python -m launch.calibrate --maps` (without it: "
             "fMoE's online setting, the store starts empty and fills as requests are served; the router predictor "
             "with --default-vectors, else previous_hidden, predicts until it holds maps)", applies=CACHED)
    prefetch_distance: int | None = option(
        None, type=int, minimum=1, fingerprint=True,
        help="router/previous_hidden predictor: MoE layers ahead (default 1; an estimator's is its own)",
        applies=CACHED)
    prefetch_depth: int | None = option(
        None, type=int, minimum=1, applies=CACHED,
        help="cached: prefetch copies on their way at once; the rest wait in a queue that a miss jumps (default 2)")
    prefill_experts: str | None = option(
        None, type=str, choices=PREFILL_EXPERTS, applies=CACHED, fingerprint="given",
        help="cached: how prefill passes get their experts: cache (through the expert cache, as decode does; default) "
             "or stream (every expert of each MoE layer copied in, one layer ahead, the true router's experts run; "
             "the cache and the predictor serve decode: Speculating Experts' setting)")
    speculative: bool = option(
        False, fingerprint=True,
        help="cached: run the predicted experts instead of loading the true router's misses (changes outputs; the "
             "metrics count mispredicted tokens)", applies=CACHED)
    router_free: bool = option(
        False, fingerprint=True,
        help="--speculative: predictions chain from the predicted routing, not the true router's, and the true "
             "router is skipped where a prediction stands in for it", applies=CACHED)
    count_mispredictions: bool = option(
        False, help="--router-free: run the true router anyway, only to count mispredicted tokens in the stats "
                    "(costs a router and a host sync per MoE layer)", applies=CACHED)

    decode_batch: int | None = option(
        None, type=int, minimum=1, applies=LIGHTNING, old_name="batch_size",
        help="lightning: rows decoded together, N (default: the policy search's)")
    micro_batch: int | None = option(
        None, type=int, minimum=1, applies=LIGHTNING,
        help="lightning: rows per micro-batch of the pipeline, mu (default: the policy search's)")
    pipeline_schedule: str | None = option(
        None, type=str, choices=PIPELINE_SCHEDULES, applies=LIGHTNING,
        help="lightning: the pipeline's launch order, cgopipe (default; MoE-Lightning's, the host's attention two "
             "micro-batches ahead of the device's work) or flexgen (FlexGen's: per layer its weights, then each "
             "micro-batch's tasks one after another, no overlap; the paper's ablation baseline)")
    resident_share: float | None = option(
        None, type=float, minimum=0, maximum=1, applies=LIGHTNING,
        help="lightning: share of each layer's experts kept on the device, r_w in [0, 1]; the rest is paged in "
             "(default: the policy search's)")
    kv_device_share: float | None = option(
        None, type=float, minimum=0, maximum=1, applies=LIGHTNING,
        help="lightning: share of the KV cache on the device, r_c in [0, 1]: the first r_c of the layers keep "
             "theirs there and attend there (default: the policy search's)")
    attention_on: str | None = option(
        None, type=str, choices=WHERE, applies=LIGHTNING,
        help="lightning: where decode attention runs, host (A_g = 0, CGOPipe) or device (A_g = 1; the KV of the "
             "layers past --kv-device-share is swapped in per layer, FlexGen's S4) (default: the policy search's)")
    ffn_on: str | None = option(
        None, type=str, choices=WHERE, applies=LIGHTNING,
        help="lightning: where the MoE FFN runs (F_g), device (paged experts) or host (the experts past "
             "--resident-share in host memory, run by the host) (default: device, or the search's when it runs)")
    host_memory_gb: float | None = option(
        None, type=float, above=0, applies=LIGHTNING,
        help="lightning: host memory the KV cache may use (default: this machine's)")

    def __post_init__(self) -> None:
        options.check(self, prefix="moejax.load: ")
        if self.prefill_experts == "cache":  # the default spelled out: the same runs, the same journal fingerprint
            object.__setattr__(self, "prefill_experts", None)
        if self.pinned_staging_mb is not None and self.streams_in_jit:  # the placements refuse the rest at load
            raise _error("pinned_staging_mb applies to placement 'streamed' (stream 'python') or 'cached', not "
                         f"{self.placement!r} with stream 'jit'")
        if self.stream == "jit" and self.window is not None:
            raise _error("window applies to stream='python' (inside the jit XLA schedules the copies)")
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
        if self.maps and predictor != "expert_map":
            raise _error(f"maps applies to predictor 'expert_map', not {predictor!r}")
        if predictor in ("expert_map", "moe_infinity") and self.speculative:
            raise _error(f"predictor {predictor!r} predicts one set of experts per request, not each token's: it "
                         "prefetches only, and speculative=True cannot run it")
        if self.default_vectors and predictor == "expert_map" and self.maps:
            raise _error("default_vectors with predictor 'expert_map' is the fallback of an empty store (no maps); "
                         "with maps it would never run")
        if self.default_vectors and predictor not in ("router", "expert_map", "moe_infinity"):
            raise _error(f"default_vectors applies to predictor 'router', not {predictor!r} (an estimator directory "
                         "holds its own)")
        if self.router_free and not self.speculative:
            raise _error("router_free=True applies to speculative=True (it chains predictions in speculative mode)")
        if self.count_mispredictions and not self.router_free:
            raise _error("count_mispredictions=True applies to router_free=True (speculative mode without it runs "
                         "the router, and counts, anyway)")
        if self.speculative and predictor is None:
            raise _error("speculative=True needs a predictor")

    @property
    def auto(self) -> bool:
        """Whether moejax.load chooses the placement (the option's value auto)."""
        return self.placement == AUTO

    @property
    def streams_in_jit(self) -> bool:
        return self.stream == "jit"

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))
