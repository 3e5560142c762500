"""Run by tests/steps/test_steps_protocol.py in a process with 8 simulated CPU devices: every placement's engine
loaded on the qwen3_moe fixture, its steps checked against the Steps protocol at run time and its logits (through
the protocol's `logits`) against the one-device float32 engine. Prints one JSON line: placement class -> result."""
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import moejax  # noqa: E402
from moejax.steps import Steps  # noqa: E402

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "qwen3_moe")
# one load per placement class (moejax.placements.PLACEMENTS)
OPTIONS = {
    "Resident": dict(),
    "Streamed": dict(placement="streamed", window=1),
    "StreamedInJit": dict(placement="streamed", stream="jit"),
    "Cached": dict(placement="cached", cache_slots=8),
    "Lightning": dict(placement="lightning", decode_batch=4, micro_batch=2, resident_share=0.5, kv_device_share=0.0,
                      attention_on="host"),
    "Pipeline": dict(layout="attn=pp,experts=pp,devices=2"),
    "DEP": dict(layout="attn=dp,experts=dep,attn_devices=2,expert_devices=4,r1=2,r2=2,order=aass"),
    "Gathered": dict(layout="attn=dp,experts=async_ep", placement="streamed", window=1),
    "CachedEP": dict(layout="attn=dp,experts=ep,devices=4", placement="cached", cache_slots=4),
    "ResidentAsyncEP": dict(layout="attn=dp,experts=async_ep"),
}


def main() -> None:
    ids = np.random.default_rng(0).integers(0, 100, (4, 11))
    ref = moejax.load(FIXTURE, dtype="float32").logits(ids)
    out = {}
    for options in OPTIONS.values():
        engine = moejax.load(FIXTURE, dtype="float32", **options)
        got = engine.logits(ids)
        out[type(engine.placement).__name__] = dict(
            steps=type(engine.steps).__name__, is_steps=isinstance(engine.steps, Steps),
            rel=float(np.max(np.abs(got - ref)) / np.max(np.abs(ref))))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
