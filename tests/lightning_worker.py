"""Run by tests/lightning/test_host_attention.py in a process with 2 simulated CPU devices: cpu:0 is the host, which
holds the KV cache and runs attention, cpu:1 stands in for the accelerator, which holds the weights. For each fixture
named on the command line, tests/host_decode.run_family's numbers; also the refusal of weights on two devices. Prints
one JSON line of results."""
import json
import os
import sys

import jax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import fixture_dir  # noqa: E402
from flax import nnx  # noqa: E402
from host_decode import run_family  # noqa: E402

import moejax  # noqa: E402
from moejax.lightning.host_attention import HostAttention  # noqa: E402


def split_weights_refused() -> str:
    """HostAttention's message for a layer whose attention weights are spread over two devices."""
    engine = moejax.load(fixture_dir("qwen3_moe"), dtype="float32")
    attn = nnx.merge(engine.graphdef, engine.params).layer(0).attn
    attn.wq.set_value(jax.device_put(attn.wq.get_value(), jax.devices()[1]))
    try:
        HostAttention(attn)
    except ValueError as e:
        return str(e)
    return ""


if __name__ == "__main__":
    host, accelerator = jax.devices("cpu")[0], jax.devices()[-1]
    assert host != accelerator, jax.devices()
    out: dict = {"families": {name: run_family(name, accelerator, host) for name in sys.argv[1:]}}
    if "qwen3_moe" in sys.argv[1:]:
        out["split_weights"] = split_weights_refused()
    print(json.dumps(out))
