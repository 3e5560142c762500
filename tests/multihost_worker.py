"""One process of tests/sharding/test_multihost.py: joins the others through jax.distributed, loads each fixture
with each layout over the devices of every process, computes logits of fixed random batches and greedy generations
(DP+EP), and (process 0 only) saves them with np.savez, with "topology" = [processes, devices].
`--fail-process I` makes process I raise after joining, before its first collective."""
import argparse
import os
import sys

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import moejax  # noqa: E402
from moejax.sharding import make_mesh, multihost  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
LAYOUTS = ("attn=dp,experts=ep", "attn=dp,experts=async_ep")
ROWS = (4, 3)  # 3: padded to the 8 devices by the multi-process path
TOKENS = 11
PROMPTS = [list(range(1 + i, 4 + i % 5 + i)) for i in range(16)]
GENERATE = 4  # greedy tokens per prompt


def batch(rows: int) -> np.ndarray:
    return np.random.default_rng(rows).integers(0, 100, (rows, TOKENS))


def key(fixture: str, layout: str, rows: int) -> str:
    return f"{fixture}|{layout}|{rows}"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--coordinator", required=True)
    p.add_argument("--num-processes", type=int, required=True)
    p.add_argument("--process-id", type=int, required=True)
    p.add_argument("--fixtures", nargs="+", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--fail-process", type=int, default=None)
    p.add_argument("--init-timeout-s", type=int, default=60, help="for all processes to join")
    p.add_argument("--peer-timeout-s", type=int, default=30, help="heartbeat and shutdown-barrier timeouts")
    args = p.parse_args()
    multihost.initialize(args.coordinator, args.num_processes, args.process_id, init_timeout_s=args.init_timeout_s,
                         heartbeat_timeout_s=args.peer_timeout_s, shutdown_timeout_s=args.peer_timeout_s)
    print(f"process {jax.process_index()}: {jax.local_device_count()} of {jax.device_count()} devices",
          file=sys.stderr, flush=True)
    if args.process_id == args.fail_process:
        raise RuntimeError(f"process {args.process_id} fails on purpose before its first collective")
    out = {"topology": np.array([jax.process_count(), jax.device_count()])}
    # 3 rows do not split over each process's 4 devices: to_host's fallback (process_allgather)
    replicated = jax.device_put(np.arange(3.0), NamedSharding(make_mesh(jax.device_count()), PartitionSpec()))
    out["replicated"] = multihost.to_host(replicated)
    for fixture in args.fixtures:
        for layout in LAYOUTS:
            engine = moejax.load(os.path.join(FIXTURES, fixture), dtype="float32", layout=layout)
            for rows in ROWS:
                out[key(fixture, layout, rows)] = engine.logits(batch(rows))
            if layout == LAYOUTS[0]:  # 16 rows: the decode outputs split by rows over both processes
                out[key(fixture, layout, "generate")] = np.array(engine.generate(PROMPTS, GENERATE))
    if multihost.is_main():
        np.savez(args.out, **out)


if __name__ == "__main__":
    main()
