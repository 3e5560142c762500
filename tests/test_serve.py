"""The quick-start runner: `python -m launch.serve` on the embedded default preset."""
import json
import os
import subprocess
import sys

from conftest import fixture_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def serve(*args):
    return subprocess.run([sys.executable, "-m", "launch.serve", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def test_default_run_generates_for_demo_prompts():
    r = serve("--max-new-tokens", "4", "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(rows) == 3 and all(len(row["token_ids"]) == 4 for row in rows)


def test_text_prompt_with_tokenizer_and_errors():
    r = serve("--model", fixture_dir("qwen3_moe"), "--prompt", "the cat", "--max-new-tokens", "3", "--no-stop")
    assert r.returncode == 0, r.stderr
    row = json.loads(r.stdout)
    assert len(row["token_ids"]) == 3 and isinstance(row["text"], str)
    r = serve("--prompt", "hello")
    assert r.returncode != 0 and "has no tokenizer.json" in r.stderr
    r = serve("--prompt-ids", "1,x")
    assert r.returncode != 0 and "not a comma-separated list of ints" in r.stderr
