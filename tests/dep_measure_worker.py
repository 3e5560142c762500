"""Run by tests/plan/test_dep_measure.py in a process with 8 simulated CPU devices: DEP's two A2E routes against the
one-device float32 model, and one split's task micro-benchmarks (moejax.measure.dep). Prints one JSON line."""
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import moejax  # noqa: E402
from moejax.measure.dep import measure_split  # noqa: E402

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "deepseek_v2_lite")
SPEC = "attn=dp,experts=dep,attn_devices=3,expert_devices=4,r1=2,r2=2"


def rel(out, ref) -> float:
    return float(np.max(np.abs(np.asarray(out) - np.asarray(ref))) / np.max(np.abs(np.asarray(ref))))


def routes():
    ids = np.random.default_rng(0).integers(0, 100, (4, 16))
    ref = moejax.load(FIXTURE, dtype="float32").logits(ids)
    engine = moejax.load(FIXTURE, dtype="float32", layout=SPEC)
    placement = engine.layered_steps.placement
    out = {"default": placement.a2e}
    for route in ("straight", "regroup"):
        placement.a2e = route
        placement.stats.__init__()
        out[route] = dict(rel=rel(engine.logits(ids), ref), stats=engine.stats()["total"])
    return out


def fits():
    fit = measure_split(moejax.load, FIXTURE, 4, 4, sequences=(1, 2), seq_lens=(16, 32), dtype="float32", repeats=5)
    return dict(fit=dict(vars(fit), points=[list(p) for p in fit.points]))


if __name__ == "__main__":
    print(json.dumps({"routes": routes(), **fits()}))
