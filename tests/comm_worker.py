"""Run by tests/sharding/test_comm_accounting.py in a process with 8 simulated CPU devices: the collectives of every
layout's compiled full-logits step, read by moejax.sharding.hlo_comm, and one Engine.explain(). Prints one JSON
line: per case the bytes sent per device by kind, inside the expert programs (shard_map) and outside."""
import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import moejax  # noqa: E402
from moejax.sharding import hlo_comm  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
LAYOUTS = ["attn=dp,experts=replicated", "attn=dp,experts=tp", "attn=dp,experts=ep",
           "attn=dp,experts=ep,exchange=gather", "attn=dp,experts=ep,devices=4", "attn=dp,experts=async_ep",
           "attn=tp,experts=tp,devices=4", "attn=tp,experts=ep,devices=4"]  # the fixtures have 4 heads
# Pipelines (Table 1's PP+PP): 3 layers over 2 stages, 2 micro-batches; over 3 stages, 4 micro-batches
PIPELINES = ["attn=pp,experts=pp,devices=2", "attn=pp,experts=pp,devices=3,microbatches=4"]
# Every layout on qwen3_moe and deepseek_v2_lite (shared experts, a dense first layer, MLA); on gpt_oss those its
# biases change (expert biases gathered, be_down under tp, o_bias after the attn=tp all-reduce). deepseek's attn=tp
# runs 7 tokens, which the expert program pads to a multiple of the devices (attn=dp splits batch rows: its batch
# must divide). Each compile costs CI time (2 cores): keep this list short.
CASES = [("qwen3_moe", spec, (8, 16)) for spec in LAYOUTS] + \
    [("deepseek_v2_lite", spec, (1, 7) if spec.startswith("attn=tp") else (8, 16)) for spec in LAYOUTS] + \
    [("gpt_oss", spec, (8, 16)) for spec in ("attn=dp,experts=tp", "attn=dp,experts=async_ep",
                                             "attn=tp,experts=tp,devices=4")] + \
    [("qwen3_moe", PIPELINES[0], (8, 16)), ("gpt_oss", PIPELINES[1], (8, 16))]
EXPLAIN = ("qwen3_moe", "attn=tp,experts=tp,devices=4")  # attention and experts both modelled


def measure(engine, shape):
    text = engine.steps.logits.lower(engine.params, jnp.zeros(shape, jnp.int32)).compile().as_text()
    found = hlo_comm.collectives(text)
    return dict(experts=hlo_comm.bytes_by_kind(found, in_shard_map=True),
                other=hlo_comm.bytes_by_kind(found, in_shard_map=False), in_loop=sum(c.in_loop for c in found),
                unknown_runs=sum(c.runs is None for c in found))


def main():
    out = {}
    for name, spec, shape in CASES:
        engine = moejax.load(os.path.join(FIXTURES, name), dtype="float32", layout=spec)
        out[f"{name}|{spec}|{shape[0]}x{shape[1]}"] = measure(engine, shape)
    explain = moejax.load(os.path.join(FIXTURES, EXPLAIN[0]), dtype="float32", layout=EXPLAIN[1]).explain()
    return dict(cases=out, explain=explain)


if __name__ == "__main__":
    assert len(jax.devices()) == 8, jax.devices()
    print(json.dumps(main()))
