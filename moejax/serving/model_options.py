"""launch.serve's own options beside the serving, placement and plan ones: which model it loads and how, and the
processes of a run over several hosts. Each field is an option (moejax.options): its flag and checks come from it."""
from __future__ import annotations

import dataclasses

import moejax
from moejax import options
from moejax.options import option
from moejax.presets import DEFAULT_MODEL


@dataclasses.dataclass(frozen=True)
class ModelOptions:
    """What moejax.load is given besides the plan."""
    model: str = option(DEFAULT_MODEL,
                        help=f"HF checkpoint directory, embedded model or preset ({', '.join(moejax.presets())}); "
                             f"default {DEFAULT_MODEL}")
    dtype: str = option("auto", choices=("auto", "bfloat16", "float32", "float16"),
                        help="default auto: the checkpoint's own (config.json's dtype / torch_dtype; presets: "
                             "bfloat16)")
    num_layers: int | None = option(None, type=int, minimum=1, help="run only the first N layers (for trials)")
    kernels: str = option("auto",
                          help="kernel backends: auto (Pallas on GPU, XLA on CPU), one name for every op (xla, "
                               "pallas, pallas_interpret) or per op, e.g. experts=ragged_dot,attention=xla")
    batch_invariant: bool = option(
        False, help="each request's scores, log-probabilities and greedy tokens bit-identical whether it runs alone, "
                    "in any batch or on another replica (fixed-shape kernels; one device per replica, placement "
                    "resident; slower: see bench/results/invariant_*.json)")

    def __post_init__(self) -> None:
        options.check(self)


@dataclasses.dataclass(frozen=True)
class Processes:
    """Several processes (hosts), one per host: all three or none (launch.serve checks that they go together)."""
    coordinator: str | None = option(None, type=str, help="HOST:PORT of process 0, which serves the coordinator")
    num_processes: int | None = option(None, type=int, minimum=1, help="how many processes take part")
    process_id: int | None = option(
        None, type=int, minimum=0,
        help="this process's index, 0..N-1; every process runs the same batches, only process 0 writes --output and "
             "--metrics")
    transfer_address: str | None = option(
        None, type=str,
        help="HOST:PORT (this host's address, a fixed free port) where this process serves JAX's socket transfers: "
             "--layout experts=dep with its groups in different processes copies activations between them so on "
             "backends that cannot themselves (CPU)")

    def __post_init__(self) -> None:
        options.check(self)
