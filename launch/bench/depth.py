"""`python -m launch.bench depth`: what depth costs a first run. `launch.serve` on a deep checkpoint of tiny widths
(a Qwen3-MoE made with transformers: every layer's weights are real tensors in a real checkpoint directory) and a
file of a few completions, each run a fresh process with an empty JAX compilation cache, against the same command
with `--num-layers` cut to a few layers. Runs alternate, the shallow first; the ratio is of the median wall times.

Most of such a run is compiling: a model whose like layers are one scan over stacked weights compiles one copy of
each kind of layer (moejax.models.layer_runs), so its first run should cost about what the cut model's does."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np

from launch.bench.util import hf_checkpoint

# The shipped model's tokenizer, so that text prompts work; the checkpoint's vocabulary is its size.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENIZER_DIR = os.path.join(ROOT, "moejax", "assets", "pycode-moe")
EXAMPLES = os.path.join(ROOT, "examples", "requests.jsonl")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = sub.add_parser("depth", help="launch.serve's first run (empty compilation cache) on a deep checkpoint of "
                                     "tiny widths against the same model cut to a few layers")
    p.add_argument("--layers", type=int, default=48, help="the deep checkpoint's layers")
    p.add_argument("--cut", type=int, default=4, help="--num-layers of the shallow run")
    p.add_argument("--hidden", type=int, default=48)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--requests", type=int, default=4, help="completions from examples/requests.jsonl")
    p.add_argument("--repeats", type=int, default=2, help="runs of each command, alternating")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--out", default=None, help="JSON file (default bench/results/depth-<device>.json)")
    return p


def hf_config(layers: int, hidden: int, experts: int, vocab: int) -> dict:
    return dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=vocab,
                hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=hidden // 2,
                num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                num_experts=experts, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                mlp_only_layers=[], max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
                eos_token_id=0, bos_token_id=0)


def make_checkpoint(directory: str, args: argparse.Namespace) -> None:
    with open(os.path.join(TOKENIZER_DIR, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    hf_checkpoint(hf_config(args.layers, args.hidden, args.experts, vocab), directory, seed=0)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(TOKENIZER_DIR, name), directory)


def completions(path: str, count: int) -> int:
    """The first `count` completion requests of the examples file, written to `path`; -> how many."""
    lines: list[str] = []
    with open(EXAMPLES) as f:
        for line in f:
            if '"/v1/completions"' in line and len(lines) < count:
                lines.append(line)
    with open(path, "w") as f:
        f.writelines(lines)
    return len(lines)


def serve_seconds(checkpoint: str, requests: str, output: str, dtype: str, num_layers: int | None) -> float:
    """One `launch.serve` process with an empty compilation cache: its wall seconds."""
    cache = tempfile.mkdtemp(prefix="moejax-depth-cache-")
    cmd = [sys.executable, "-m", "launch.serve", "--model", checkpoint, "--input", requests, "--output", output,
           "--dtype", dtype] + ([] if num_layers is None else ["--num-layers", str(num_layers)])
    env = dict(os.environ, XDG_CACHE_HOME=cache)
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    shutil.rmtree(cache, ignore_errors=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    return seconds


def depth(args: argparse.Namespace, env: dict, partial: Callable[[dict, str], None]) -> dict:
    work = tempfile.mkdtemp(prefix="moejax-depth-")
    try:
        checkpoint = os.path.join(work, "model")
        t0 = time.perf_counter()
        make_checkpoint(checkpoint, args)
        made_s = time.perf_counter() - t0
        requests = os.path.join(work, "requests.jsonl")
        n = completions(requests, args.requests)
        record = dict(env, benchmark="depth", model=dict(family="qwen3_moe", layers=args.layers, cut=args.cut,
                                                         hidden=args.hidden, experts=args.experts),
                      dtype=args.dtype, requests=n, checkpoint_made_s=round(made_s, 2), runs={"deep": [], "cut": []})
        for r in range(args.repeats):
            for name, layers in (("cut", args.cut), ("deep", None)):
                s = serve_seconds(checkpoint, requests, os.path.join(work, f"{name}-{r}.jsonl"), args.dtype, layers)
                record["runs"][name].append(round(s, 2))
                print(f"  {name:4s} run {r}: {s:.1f} s", flush=True)
                partial(record, f"{name} {r}")
        deep, cut = (float(np.median(record["runs"][k])) for k in ("deep", "cut"))
        record.update(deep_median_s=round(deep, 2), cut_median_s=round(cut, 2), ratio=round(deep / cut, 3))
        print(f"  {args.layers} layers / {args.cut} layers: {deep:.1f} s / {cut:.1f} s = {deep / cut:.2f}x")
        return record
    finally:
        shutil.rmtree(work, ignore_errors=True)
