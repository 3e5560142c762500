"""Run by tests/sharding/test_cached_ep.py in a process with 8 simulated CPU devices: the cached placement under
layout experts=ep (fMoE's experts round robin over the devices) against the one-device float32 resident model, and
what each device's cache holds. Prints one JSON line of results."""
import json
import os
import sys

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import moejax  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
PROMPTS = [[1, 2, 3, 4], [5, 6], [7, 8, 9]]


def rel(out, ref) -> float:
    return float(np.max(np.abs(np.asarray(out) - np.asarray(ref))) / np.max(np.abs(np.asarray(ref))))


def held(engine, ref_experts):
    """Per device: what its cache holds, on which devices its arrays are, and whether they are the model's."""
    runtime = engine.layered_steps.placement
    mesh_devices = list(runtime.mesh.devices.flat)
    out = []
    for items in runtime.resident().values():
        out.append([dict(layer=layer, expert=expert,
                         on=sorted({mesh_devices.index(dev) for a in arrays.values() for dev in a.devices()}),
                         equal=all(np.array_equal(np.asarray(a)[0], ref_experts[layer][name][expert])
                                   for name, a in arrays.items()))
                    for layer, expert, arrays in items])
    return out


def run(name, spec, **options):
    path = os.path.join(FIXTURES, name)
    ids = np.random.default_rng(0).integers(0, 100, (3, 11))
    ref = moejax.load(path, dtype="float32")
    ref_experts = {layer: {name: np.asarray(a) for name, a in ref.layer_experts(layer).items()}
                   for layer in range(ref.config.num_layers) if ref.config.is_moe(layer)}
    engine = moejax.load(path, dtype="float32", layout=spec, placement="cached", **options)
    out = dict(placement=engine.stats()["placement"], rel=rel(engine.logits(ids), ref.logits(ids)),
               same_tokens=engine.generate(PROMPTS, 5) == ref.generate(PROMPTS, 5),
               devices=len(engine.layered_steps.placement.shards), held=held(engine, ref_experts),
               stats=engine.stats()["total"], describe=engine.explain())
    engine.reset_stats()
    engine.logits(ids)
    after = engine.stats()["total"]
    out["lookups_after_reset"] = (after["hits"] + after["misses"], after["cache"]["hits"] + after["cache"]["misses"])
    engine.logits(ids)
    again = engine.stats()["total"]
    out["lookups_twice"] = (again["hits"] + again["misses"], again["cache"]["hits"] + again["cache"]["misses"])
    return out


def errors():
    out = {}
    try:
        moejax.load(os.path.join(FIXTURES, "qwen3_moe"), dtype="float32", layout="attn=dp,experts=ep,devices=3",
                    placement="cached", cache_slots=2)
    except ValueError as e:
        out["uneven"] = str(e)
    return out


PARTS = {"exact": lambda: run("qwen3_moe", "attn=dp,experts=ep", cache_slots=2),
         "evicting": lambda: run("qwen3_moe", "attn=dp,experts=ep,devices=4", cache_slots=2),
         "predicted": lambda: run("gpt_oss", "attn=dp,experts=ep,devices=4", cache_slots=2, predictor="oracle"),
         "speculative": lambda: run("qwen3_moe", "attn=dp,experts=ep", cache_slots=2, predictor="oracle",
                                    speculative=True, eviction="priority"),
         "errors": errors}

if __name__ == "__main__":  # arguments: parts to run
    assert len(jax.devices()) == 8, jax.devices()
    print(json.dumps({part: PARTS[part]() for part in sys.argv[1:]}))
