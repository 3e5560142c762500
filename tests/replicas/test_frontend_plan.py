"""`launch.serve --replicas N --explain`: one engine's plan and the frontend's planned routing, without Ray."""
import json
import os

from launch.serve import main

QWEN3 = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "qwen3_moe")
PREFIX = "The clever fox reads a map of the old city and the river, then walks along the quiet bridge past the market"


def test_explain_plans_the_routing_over_replicas(tmp_path, capsys):
    lines = [json.dumps({"custom_id": f"s{k}", "method": "POST", "url": "/v1/score",
                         "body": {"prompt": f"{PREFIX} {k}", "candidates": [" yes", " no"]}}) for k in range(6)]
    lines += [json.dumps({"custom_id": f"o{k}", "method": "POST", "url": "/v1/score",
                          "body": {"prompt": f"Other words {k} here", "candidates": [" a"]}}) for k in range(2)]
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert main(["--model", QWEN3, "--dtype", "float32", "--input", str(path), "--replicas", "3", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "routing (prefix) of 8 requests over 3 replicas" in out
    per_replica = [line for line in out.splitlines() if line.startswith("  replica ")]
    assert len(per_replica) == 3
    counts = sorted(int(line.split(": ")[1].split(" requests")[0]) for line in per_replica)
    assert sum(counts) == 8
    assert "sharing saves" in out and not (tmp_path / "in.jsonl.partial").exists()


def test_ray_is_imported_only_when_replicas_are_asked_for():
    """Ray is an optional extra: the runner's modules import without it (a subprocess, so nothing else imported
    it first)."""
    import subprocess
    import sys
    code = ("import sys; import launch.serve, moejax.serving.replicated, moejax.replicas.run; "
            "assert 'ray' not in sys.modules, 'ray was imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
