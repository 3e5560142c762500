"""DEP with its groups in different processes: 2 processes x 4 simulated CPU devices joined by jax.distributed on
127.0.0.1, the attention group on process 0's devices and the expert group on process 1's, activations copied
between them by cross-process device_put (JAX's socket transfers, multihost.initialize(transfer_address=)). The
logits (4 rows, and 3 padded to the 4 attention devices) must equal the one-process, one-device float32 model's
within a relative max error of 1e-5, on both processes, for the default split and for r1=2, r2=2, order=aass, and
the greedy generations must be the same; so must launch.serve's output (completions and scores) with the groups
in two processes. Layouts whose groups do not divide the processes, or that cannot copy between them, are refused
at load with the numbers."""
import json
import os
import socket

import dep_procs_worker as worker  # tests/ is on sys.path under pytest
import numpy as np
import pytest
from test_multihost import HERE, TOL, assert_same_results, rel, report, run_workers, write_requests

import moejax


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@pytest.mark.slow
def test_dep_groups_in_two_processes_equal_one_device(tmp_path):
    ports = ",".join(map(str, free_ports(2)))
    finished = run_workers(tmp_path, "--transfer-ports", ports, worker="dep_procs_worker.py", deadline_s=400)
    assert all(f.returncode == 0 for f in finished), report(finished)
    got = []
    for i in (0, 1):
        with np.load(tmp_path / f"logits{i}.npz") as z:
            got.append(dict(z))
    assert got[0].pop("topology").tolist() == got[1].pop("topology").tolist() == [2, 8]
    ref = moejax.load(os.path.join(HERE, "fixtures", worker.FIXTURE), dtype="float32")
    want_tokens = ref.generate(worker.PROMPTS, worker.GENERATE)
    want = {rows: ref.logits(worker.batch(rows)) for rows in worker.ROWS}
    for layout in worker.LAYOUTS:
        for process in got:
            # the parameters on process 0's devices only, the routed experts on process 1's only
            assert process[worker.key(layout, "processes")].tolist() == [[0], [1]], layout
            assert process[worker.key(layout, "generate")].tolist() == want_tokens, layout
            for rows in worker.ROWS:
                out = process[worker.key(layout, rows)]
                assert out.shape == want[rows].shape == (rows, worker.TOKENS, ref.config.vocab_size)
                assert rel(out, want[rows]) <= TOL, (layout, rows)


@pytest.mark.slow
def test_dep_groups_that_do_not_divide_the_processes_are_refused(tmp_path):
    """Without transfer_address: groups sharing a process, groups of unequal sizes, then (groups right) the missing
    way to copy between processes, each named with its numbers by both processes."""
    layouts = ["attn=dp,experts=dep,attn_devices=6,expert_devices=2", "attn=dp,experts=dep,attn_devices=4,"
               "expert_devices=2", "attn=dp,experts=dep"]
    finished = run_workers(tmp_path, "--layouts", *layouts, worker="dep_procs_worker.py", deadline_s=120)
    assert all(f.returncode == 0 for f in finished), report(finished)
    for i in (0, 1):
        errors = json.loads((tmp_path / f"worker{i}.stdout").read_text().splitlines()[-1])
        shared, unequal, no_transfers = (errors[layout] for layout in layouts)
        assert shared.startswith("moejax.load: layout attn=dp,experts=dep,devices=8,attn_devices=6,expert_devices=2,"
                                 "r1=1,r2=1,order=asas,exchange=all_to_all: experts=dep over 2 processes of 4 devices "
                                 "each runs each group on whole processes"), shared
        assert ("attention group (attn_devices=6: devices 0..5, processes [0, 1]) and the expert group "
                "(expert_devices=2: devices 6..7, processes [1]) share process(es) [1]") in shared, shared
        assert "e.g. attn_devices=4,expert_devices=4" in shared, shared
        assert "needs attn_devices = expert_devices, got 4 and 2" in unequal, unequal
        assert "pass transfer_address='HOST:PORT'" in no_transfers and "cpu backend" in no_transfers, no_transfers


@pytest.mark.slow
def test_serve_with_dep_groups_in_two_processes_gives_the_one_process_output(tmp_path):
    write_requests(tmp_path / "in.jsonl", 4)
    common = ["--model", os.path.join(HERE, "fixtures", worker.FIXTURE), "--dtype", "float32", "--input",
              str(tmp_path / "in.jsonl")]
    ports = free_ports(2)
    finished = run_workers(tmp_path, serve=[*common, "--output", str(tmp_path / "out{i}.jsonl"), "--layout",
                                            "attn=dp,experts=dep"],
                           per_process=lambda i: ["--transfer-address", f"127.0.0.1:{ports[i]}"])
    assert all(f.returncode == 0 for f in finished), report(finished)
    assert not (tmp_path / "out1.jsonl").exists(), "only process 0 writes results"
    from launch.serve import main
    assert main([*common, "--output", str(tmp_path / "one.jsonl")]) == 0  # one process: this one, one device
    assert_same_results(tmp_path / "out0.jsonl", tmp_path / "one.jsonl")
