"""One process of tests/sharding/test_dep_processes.py: joins the others through jax.distributed with its socket
transfers on (multihost.initialize(transfer_address=...)), loads the fixture with each DEP layout (the attention
group on process 0's devices, the expert group on process 1's), computes the logits of fixed random batches and
greedy generations, and saves them with np.savez, with "topology" = [processes, devices] and the groups' device
processes. Every process saves its own file: each must hold the whole value (multihost.to_host).
`--layouts SPEC...`: only load each and print their errors (the checks at load), one JSON line.
"""
import argparse
import json
import os
import sys

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import moejax  # noqa: E402
from moejax.sharding import multihost  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
FIXTURE = "deepseek_v2_lite"  # shared experts: every order does something different with them
LAYOUTS = ("attn=dp,experts=dep", "attn=dp,experts=dep,attn_devices=4,expert_devices=4,r1=2,r2=2,order=aass")
ROWS = (4, 3)  # 3: padded to the 4 attention devices
TOKENS = 16  # a length bucket: no padded positions
PROMPTS = [[1, 2, 3, 4], [5, 6], [7, 8, 9], [10, 11, 12, 13, 14]]
GENERATE = 4  # greedy tokens per prompt


def batch(rows: int) -> np.ndarray:
    return np.random.default_rng(rows).integers(0, 100, (rows, TOKENS))


def key(layout: str, rows) -> str:
    return f"{layout}|{rows}"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--coordinator", required=True)
    p.add_argument("--num-processes", type=int, required=True)
    p.add_argument("--process-id", type=int, required=True)
    p.add_argument("--transfer-ports", default=None, help="one free port per process, comma-separated")
    p.add_argument("--layouts", nargs="+", default=None, help="only load these layouts: print each one's error")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    transfer = None
    if args.transfer_ports:
        transfer = f"127.0.0.1:{args.transfer_ports.split(',')[args.process_id]}"
    multihost.initialize(args.coordinator, args.num_processes, args.process_id, init_timeout_s=60,
                         heartbeat_timeout_s=30, shutdown_timeout_s=30, transfer_address=transfer)
    path = os.path.join(FIXTURES, FIXTURE)
    if args.layouts is not None:
        errors = {}
        for layout in args.layouts:
            try:
                moejax.load(path, dtype="float32", layout=layout)
                errors[layout] = None
            except ValueError as e:
                errors[layout] = str(e)
        print(json.dumps(errors), flush=True)
        return
    out = {"topology": np.array([jax.process_count(), jax.device_count()])}
    for layout in LAYOUTS:
        engine = moejax.load(path, dtype="float32", layout=layout)
        for rows in ROWS:
            out[key(layout, rows)] = engine.logits(batch(rows))
        store = engine.store  # the expert group (made with the weights, at the first step)
        out[key(layout, "processes")] = np.array([
            sorted({d.process_index for a in jax.tree.leaves(engine.params) for d in a.sharding.device_set}),
            sorted({d.process_index for l in store.layers for a in store.fetch(l).values()
                    for d in a.sharding.device_set})])
        out[key(layout, "generate")] = np.array(engine.generate(PROMPTS, GENERATE))
    np.savez(args.out, **out)


if __name__ == "__main__":
    main()
