"""Run by tests/sharding/test_pipeline_steps.py in a process with 8 simulated CPU devices: the pipeline layout
(attn=pp,experts=pp) against the one-device float32 model on fixtures whose layers split evenly and unevenly over
the stages, where each stage's weights live, and what it refuses. Prints one JSON line of results."""
import json
import os
import sys

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import moejax  # noqa: E402
from moejax.sched.packing import ScoreSeq, assemble, pack_row  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
# 4 layers over 4 stages, micro-batches 4 (even); 3 layers over 2 stages, the dense middle layer with the first
# MoE one (uneven, two layer kinds); MLA with a dense first layer over 2 stages, 3 micro-batches (a padding slot);
# sliding and full attention layers over 3 stages, 2 micro-batches (fewer micro-batches than stages)
CASES = [("qwen3_moe_nonorm", "attn=pp,experts=pp,devices=4"), ("qwen3_moe", "attn=pp,experts=pp,devices=2"),
         ("deepseek_v2_lite", "attn=pp,experts=pp,devices=2,microbatches=3"),
         ("gpt_oss", "attn=pp,experts=pp,devices=3,microbatches=2")]
SEQUENCES = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12, 13, 14, 15]]


def rel(out, ref) -> float:
    return float(np.max(np.abs(np.asarray(out) - np.asarray(ref))) / np.max(np.abs(np.asarray(ref))))


def case(name: str, spec: str) -> dict:
    path = os.path.join(FIXTURES, name)
    ids = np.random.default_rng(0).integers(0, 100, (3, 11))
    ref = moejax.load(path, dtype="float32")
    engine = moejax.load(path, dtype="float32", layout=spec)
    out = dict(layout=str(engine.layout), rel=rel(engine.logits(ids), ref.logits(ids)))
    if name == "qwen3_moe_nonorm":  # the other full-sequence step: log-probabilities and top-k
        got, want = engine.token_logprobs(SEQUENCES, 3), ref.token_logprobs(SEQUENCES, 3)
        out["logprobs_rel"] = max(rel(np.concatenate([np.ravel(x) for x in g[:2]]),
                                      np.concatenate([np.ravel(x) for x in w[:2]]))
                                  for g, w in zip(got, want, strict=True))
        out["same_top_ids"] = all(np.array_equal(g[2], w[2]) for g, w in zip(got, want, strict=True))
        out["explain"] = engine.explain((4, 16))
    if name == "gpt_oss":  # packed-tree scoring (sliding windows too) without a prefix pool; with one it is refused
        arrays, _, span = assemble(score_rows(), 0, engine.row_multiple)
        got, pool = engine.score_packed(arrays, None, span)
        out["score_rel"] = rel(got, ref.score_packed(arrays, None, span)[0])
        out["score_pool"] = pool
        try:
            engine.score_packed(arrays, engine.init_pool(4), span)
            out["score_with_pool"] = "ran"
        except ValueError as e:
            out["score_with_pool"] = str(e)
    steps = engine.steps
    stages = engine.layout.devices
    mesh = list(engine.placement.layout_setup.mesh.devices.flat)
    # every stacked array's block of stage s is on the mesh's device s, and nowhere else
    out["blocks_on_their_stage"] = all(sorted((s.index[0].start or 0, s.device.id) for s in a.addressable_shards)
                                       == [(i, d.id) for i, d in enumerate(mesh)] for kind in steps.weights
                                       for a in kind)
    out["slots"] = [list(kind[0].shape[:2]) for kind in steps.weights]  # [stages, slots] per layer kind
    out["layer_params_in_state"] = max(int(np.prod(v.get_value().shape)) for p, v in
                                       nnx.to_flat_state(engine.params) if p[0] == "layers")
    out["stages"] = stages
    try:
        engine.generate([[1, 2, 3]], 2)
        out["generate"] = "ran"
    except ValueError as e:
        out["generate"] = str(e)
    return out


def score_rows():
    """Three packed rows, each a shared context of 12 tokens and three 2-token candidates read at both positions."""
    rng = np.random.default_rng(3)
    rows = []
    for r in range(3):
        ctx = tuple(rng.integers(1, 100, 12).tolist())
        rows.append(pack_row([ScoreSeq(ctx + (a, b), 12, r, ((11, a, (r, i, 0)), (12, b, (r, i, 1))))
                              for i, (a, b) in enumerate(rng.integers(1, 100, (3, 2)).tolist())]))
    return rows


def too_few_layers() -> str:
    try:
        moejax.load(os.path.join(FIXTURES, "qwen3_moe"), dtype="float32", layout="attn=pp,experts=pp,devices=4")
    except ValueError as e:
        return str(e)
    return "loaded"


if __name__ == "__main__":
    assert len(jax.devices()) == 8, jax.devices()
    print(json.dumps(dict(cases={f"{n}|{s}": case(n, s) for n, s in CASES}, too_few_layers=too_few_layers())))
