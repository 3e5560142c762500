"""Several processes as one set of devices (moejax.sharding.multihost): 2 processes x 4 simulated CPU devices,
joined by jax.distributed on 127.0.0.1 (gloo collectives), run the DP+EP and AsyncEP layouts over all 8 devices.
Their logits must equal the one-process, one-device float32 model's (computed here) within a relative max error
of 1e-5 (max |got - want| / max |want|; the partitioned program may sum floats in another order), for 4 rows
and for 3 (padded to the 8 devices), and DP+EP's greedy generations of 16 prompts must be the same. A failing or
missing process must not hang the others: each run of the workers has a deadline past which they are killed,
and the JAX runtime itself ends the survivors after the heartbeat / shutdown / initialization timeouts; failures
are reported with each process's exit and last error."""
import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import multihost_worker as worker  # tests/ is on sys.path under pytest
import numpy as np
import pytest

import moejax

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = 1e-5


@dataclasses.dataclass
class Finished:
    process: int
    returncode: int
    killed: bool  # by the test, at the deadline
    stderr: str

    def summary(self) -> str:
        """'process 1: exit 1' or 'process 0: signal SIGABRT', then its Python error and/or the JAX runtime's
        reason for ending it."""
        how = f"exit {self.returncode}" if self.returncode >= 0 else f"signal {signal.Signals(-self.returncode).name}"
        if self.killed:
            how += " (killed by the test at the deadline)"
        errors = [line for line in self.stderr.splitlines()
                  if re.match(r"\w+(Error|Exception): ", line) or "Terminating process because" in line]
        return f"process {self.process}: {how}" + "".join(f"\n  {line}" for line in errors)


def report(finished: list[Finished]) -> str:
    return "\n".join(f.summary() + "\n  stderr tail: " + f.stderr[-1500:].replace("\n", "\n    ") for f in finished)


def run_workers(tmp_path, *args, processes=(0, 1), num_processes=2, deadline_s=240, serve=None,
                worker="multihost_worker.py", per_process=lambda i: []) -> list[Finished]:
    """Start tests/<worker> (or `python -m launch.serve *serve`, with "{i}" the process index) as the given
    processes of `num_processes`, process i with the arguments per_process(i) too, and wait for all of them; past
    `deadline_s` kill every one still running and fail with what each printed. Each process's stdout:
    tmp_path / "worker{i}.stdout"."""
    with socket.socket() as s:  # a free port for the coordinator
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4")
    procs, logs, outs, timed_out = [], [], [], False
    try:
        for i in processes:
            logs.append(open(tmp_path / f"worker{i}.stderr", "w+"))  # a file, not a pipe: no buffer to fill up
            outs.append(open(tmp_path / f"worker{i}.stdout", "w"))
            program = ["-m", "launch.serve", *(a.replace("{i}", str(i)) for a in serve)] if serve else \
                [os.path.join(HERE, worker), "--out", str(tmp_path / f"logits{i}.npz"), *args]
            procs.append(subprocess.Popen(
                [sys.executable, *program, "--coordinator", f"127.0.0.1:{port}", "--num-processes",
                 str(num_processes), "--process-id", str(i), *per_process(i)], stdout=outs[-1], stderr=logs[-1],
                env=env, cwd=os.path.dirname(HERE)))
        end = time.monotonic() + deadline_s
        for p in procs:
            p.wait(timeout=max(0.0, end - time.monotonic()))
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        killed = []
        for p in procs:
            killed.append(p.poll() is None)
            if killed[-1]:
                p.kill()
            p.wait()
        for out in outs:
            out.close()
    finished = []
    for i, p, log, k in zip(processes, procs, logs, killed, strict=True):
        log.seek(0)
        finished.append(Finished(i, p.returncode, k, log.read()))
        log.close()
    if timed_out:
        pytest.fail(f"the workers did not finish within {deadline_s}s; killed:\n{report(finished)}")
    return finished


def rel(got, want) -> float:
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


@pytest.mark.slow
def test_dp_ep_and_async_ep_over_two_processes_equal_one_device(tmp_path):
    finished = run_workers(tmp_path, "--fixtures", "qwen3_moe")
    assert all(f.returncode == 0 for f in finished), report(finished)
    assert not (tmp_path / "logits1.npz").exists(), "only process 0 writes results"
    with np.load(tmp_path / "logits0.npz") as z:
        got = dict(z)
    assert got.pop("topology").tolist() == [2, 8]
    assert got.pop("replicated").tolist() == [0.0, 1.0, 2.0]
    ref = moejax.load(os.path.join(HERE, "fixtures", "qwen3_moe"), dtype="float32")
    generated = got.pop(worker.key("qwen3_moe", worker.LAYOUTS[0], "generate"))
    assert generated.tolist() == ref.generate(worker.PROMPTS, worker.GENERATE)
    cases = [(layout, rows) for layout in worker.LAYOUTS for rows in worker.ROWS]
    assert sorted(got) == sorted(worker.key("qwen3_moe", layout, rows) for layout, rows in cases)
    for layout, rows in cases:
        want = ref.logits(worker.batch(rows))
        out = got[worker.key("qwen3_moe", layout, rows)]
        assert out.shape == want.shape == (rows, worker.TOKENS, ref.config.vocab_size)
        assert rel(out, want) <= TOL, (layout, rows)


@pytest.mark.slow
def test_a_failing_process_ends_every_process_within_the_timeouts(tmp_path):
    """Process 1 raises before the first collective. It waits at the shutdown barrier for process 0 (stuck in its
    first collective, waiting for process 1) for the 3 s shutdown timeout; then the JAX runtime ends both."""
    start = time.monotonic()
    finished = run_workers(tmp_path, "--fixtures", "qwen3_moe", "--fail-process", "1", "--peer-timeout-s", "3",
                           deadline_s=90)
    elapsed, text = time.monotonic() - start, report(finished)
    assert elapsed < 45, f"{elapsed:.0f}s\n{text}"
    assert not any(f.killed for f in finished), text  # both ended by themselves
    assert all(f.returncode != 0 for f in finished), text
    assert "RuntimeError: process 1 fails on purpose before its first collective" in finished[1].summary(), text
    assert "JAX distributed service detected fatal errors" in finished[0].summary(), text
    assert not (tmp_path / "logits0.npz").exists()


@pytest.mark.slow
def test_a_missing_process_ends_the_others_after_the_initialization_timeout(tmp_path):
    start = time.monotonic()
    finished = run_workers(tmp_path, "--fixtures", "qwen3_moe", "--init-timeout-s", "1", processes=(0,),
                           deadline_s=60)
    elapsed, text = time.monotonic() - start, report(finished)
    assert elapsed < 30, f"{elapsed:.0f}s\n{text}"
    assert not finished[0].killed and finished[0].returncode != 0, text
    assert "DEADLINE_EXCEEDED" in finished[0].summary(), text


@pytest.mark.slow
def test_serve_over_two_processes_gives_the_one_process_output(tmp_path):
    """launch.serve with --coordinator: both processes run every batch (completions and scores), only process 0
    writes, and what it writes equals a one-process run's output."""
    write_requests(tmp_path / "in.jsonl", 6)
    model = os.path.join(HERE, "fixtures", "qwen3_moe")
    common = ["--model", model, "--dtype", "float32", "--input", str(tmp_path / "in.jsonl")]
    finished = run_workers(tmp_path, serve=[*common, "--output", str(tmp_path / "out{i}.jsonl"), "--layout",
                                            "attn=dp,experts=ep"])
    assert all(f.returncode == 0 for f in finished), report(finished)
    assert not (tmp_path / "out1.jsonl").exists(), "only process 0 writes results"
    from launch.serve import main
    assert main([*common, "--output", str(tmp_path / "one.jsonl")]) == 0  # one process: this one
    assert_same_results(tmp_path / "out0.jsonl", tmp_path / "one.jsonl")


def write_requests(path, pairs: int) -> None:
    """`pairs` completion requests and as many score requests, interleaved, as launch.serve input lines."""
    lines = []
    for i in range(pairs):
        lines.append({"custom_id": f"c{i}", "url": "/v1/completions",
                      "body": {"prompt_token_ids": [1 + i, 2, 3, 4 + i], "max_tokens": 4}})
        lines.append({"custom_id": f"s{i}", "url": "/v1/score",
                      "body": {"prompt_token_ids": [5, 6 + i, 7], "candidate_token_ids": [[8], [9, 10]]}})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def assert_same_results(got_path, want_path) -> None:
    """Two launch.serve outputs hold the same requests' results: equal generated tokens, scores to 1e-5."""
    got, want = ([json.loads(line) for line in path.read_text().splitlines()] for path in (got_path, want_path))
    assert [r["custom_id"] for r in got] == [r["custom_id"] for r in want] and not any(r.get("error") for r in got)
    for g, w in zip(got, want, strict=True):
        g, w = g["response"]["body"], w["response"]["body"]
        if "choices" in w:
            assert g["choices"][0]["token_ids"] == w["choices"][0]["token_ids"]
        else:
            for a, b in zip(g["results"][0]["candidates"], w["results"][0]["candidates"], strict=True):
                assert a["logprob"] == pytest.approx(b["logprob"], rel=1e-5, abs=1e-5)


@pytest.mark.parametrize("argv, message", [
    (["--coordinator", "127.0.0.1:1234", "--num-processes", "2"], "go together; missing --process-id"),
    (["--num-processes", "2", "--process-id", "0"], "go together; missing --coordinator"),
    (["--coordinator", "127.0.0.1:1234", "--num-processes", "2", "--process-id", "0"],
     "writes its results to --output"),
    (["--transfer-address", "127.0.0.1:1234"], "--transfer-address applies to a run over several processes"),
])
def test_serve_multiprocess_flags_are_checked_before_joining(argv, message, capsys):
    from conftest import serve_stopped
    status, text = serve_stopped(capsys, ["--input", "-", *argv])
    assert status == 2 and message in text
