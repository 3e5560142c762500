"""Worker processes for the multi-device tests: a script under tests/ run once per argument list, side by side
(compiling is mostly one thread each), each with its own count of simulated CPU devices."""
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def run_workers(script: str, arg_lists, devices: int, timeout: float) -> list[dict]:
    """tests/<script> once per argument list with `devices` CPU devices -> each run's last stdout line, as JSON. A
    run that fails fails the test with the end of its stderr; every run is killed on the way out."""
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
    runs = [subprocess.Popen([sys.executable, os.path.join(HERE, script), *args], env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE) for args in arg_lists]
    results = []
    try:
        for run in runs:
            stdout, stderr = run.communicate(timeout=timeout)
            assert run.returncode == 0, stderr[-3000:]
            results.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for run in runs:
            run.kill()
    return results
