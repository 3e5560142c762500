"""How a file of requests is served, as one frozen dataclass passed whole from launch.serve to
moejax.sched.batch and the runner: the batch token budget, the prefix KV cache, static or continuous batching, the
KV pool and the scheduler's knobs. Each field is an option (moejax.options): launch.serve's flags, their checks and
--explain's listing come from it."""
from __future__ import annotations

import dataclasses

from moejax import options
from moejax.options import option
from moejax.sched.batch_schedule import KV_MODES, ORDERS
from moejax.sched.batch_size import DEFAULT_TOKENS

BATCHING = ("continuous", "static")
SCHEDULER = ("max_rows", "chunk_tokens", "row_tokens", "decode_steps", "mixed")  # the Scheduler's keywords


@dataclasses.dataclass(frozen=True)
class ServingOptions:
    max_batch_tokens: int | None = option(
        None, type=int, minimum=16,
        help="token budget of one batch, padding included (rows x row length; for completions rows x (prompt + new "
             "tokens)). Default: scoring batches on a GPU are sized from the device (Θ of the placement on the "
             "hardware profile, bounded by the memory budget), elsewhere and for completions "
             f"{DEFAULT_TOKENS}; given, it wins everywhere; --explain says which")
    kv_cache: str = option(
        "auto", choices=KV_MODES,
        help="cross-batch prefix KV cache. on: keep every prompt block (LRU, bounded by --prefix-cache-mb); off: "
             "scoring keeps no KV at all; auto (default): on only when some prefix block recurs across batches, "
             "keeping just those blocks")
    prefix_cache_mb: float = option(1024.0, minimum=0,
                                    help="most device memory the prefix KV cache may use, in MiB (default 1024)")
    order: str = option(
        "longest", choices=ORDERS,
        help="scoring batches' order: longest (default: the largest prefix trees first, each batch filled to the "
             "saturation threshold Θ under streamed experts) or spf (shortest prefill first, PrefillOnly's "
             "scheduler, a baseline: the requests of least estimated prefill time first, re-estimated in true FLOPs "
             "before each batch against what the prefix cache holds by then; no Θ floor). Results are the same")
    batching: str = option(
        "continuous", choices=BATCHING,
        help="completions: continuous (default; one scheduler over a paged KV pool admits, decodes, retires and "
             "preempts sequences step by step) or static (each planned batch prefills together and decodes until "
             "its longest row ends: the baseline). Several processes use static")
    kv_pool_mb: float | None = option(
        None, type=float, above=0,
        help="continuous batching's KV pool in MiB (default: the device budget less the weights and 5% for "
             "activations; 1024 where the device reports none, as on CPU; placement lightning: 80% of host "
             "memory); --explain shows it")
    # The continuous scheduler's knobs (moejax.sched.continuous.Scheduler; None: its default). Benchmarks and tests
    # set them; only the batch (max_rows) has a flag.
    max_rows: int | None = option(None, type=int, minimum=1,
                                  help="continuous: most sequences a decode step holds, the batch (default 64)")
    chunk_tokens: int | None = option(
        None, type=int, minimum=1, flag=False,
        help="continuous: a chunk step's token budget (default: the Scheduler's, raised to Θ's tokens under "
             "streamed experts)")
    row_tokens: int | None = option(None, type=int, minimum=1, flag=False,
                                    help="continuous: a chunk step's row length")
    decode_steps: int | None = option(None, type=int, minimum=1, flag=False,
                                      help="continuous: tokens a decode step makes per sequence")
    mixed: bool = option(False, flag=False,
                         help="continuous: decoding sequences ride along in the chunk steps instead of their own")

    def __post_init__(self) -> None:
        options.check(self)

    def scheduler_keywords(self) -> dict:
        """The Scheduler's keywords that were given (the others keep its defaults)."""
        return {name: getattr(self, name) for name in SCHEDULER if getattr(self, name) not in (None, False)}


SERVING_DEFAULTS = ServingOptions()  # every field's default (frozen, so one instance serves)
