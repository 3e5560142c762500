"""Run by tests/lightning/test_lightning_families.py in a process with 2 simulated CPU devices: cpu:0 holds the
weights (the accelerator), cpu:1 is the host (moejax.lightning.host_kv.host_device), which holds the KV cache of the
layers past the r_c share and runs their attention. For each fixture named on the command line, under its policy
(POLICIES: every attention variant meets a different r_w, r_c, μ; one runs the FFN on the host, one attends on the
device over KV swapped in from the host), the scheduler's greedy tokens of the resident
model and of placement lightning, transformers' tokens, and where each array lives. Prints one JSON line."""
import json
import os
import sys

import jax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import fixture_dir, reference  # noqa: E402
from lightning_generate import NEW_TOKENS, scheduled  # noqa: E402

import moejax  # noqa: E402

# (μ, r_w, r_c, attention_on, ffn_on) per family; N = 4 rows, the three prompts and one padding row
POLICIES = {"qwen3_moe": (1, 0.0, 0.0, "host", "device"), "mixtral": (2, 0.5, 0.34, "host", "device"),
            "gpt_oss": (3, 1.0, 0.0, "host", "device"), "qwen2_moe": (2, 0.25, 0.0, "host", "host"),
            "deepseek_v3": (2, 0.5, 1.0, "device", "device"), "deepseek_v2_lite": (4, 0.5, 0.5, "device", "device")}


def shardings(arrays) -> list[str]:
    return sorted({f"{d}:{a.sharding.memory_kind}" for a in arrays for d in a.devices()})


def run(name: str) -> dict:
    ref = reference(name)
    prompts = [ref[f"prompt_{i}"].tolist() for i in range(3)]
    mu, r_w, r_c, attention_on, ffn_on = POLICIES[name]
    resident = moejax.load(fixture_dir(name), dtype="float32")
    engine = moejax.load(fixture_dir(name), dtype="float32", placement="lightning", decode_batch=4, micro_batch=mu,
                         resident_share=r_w, kv_device_share=r_c, attention_on=attention_on,
                         ffn_on=ffn_on)
    steps = engine.steps
    pool = engine.init_pool(2, decode=True)
    store = steps.experts.store
    return dict(tokens=scheduled(engine, prompts), resident=scheduled(resident, prompts),
                transformers=[ref[f"greedy_{i}"][:NEW_TOKENS].tolist() for i in range(3)],
                host=str(steps.host), device=str(steps.device), device_kv_layers=steps.settings.device_kv_layers,
                pool=[shardings(layer.values()) for layer in pool],
                weights=shardings(jax.tree.leaves(engine.params)),
                pages=shardings([a for pages in getattr(store, "paged", {}).values() for page in pages
                                 for a in page.values()]),
                host_experts=shardings([a for layer in getattr(store, "on_host", {}).values() for a in layer.values()]),
                resident_experts=shardings([a for layer in store.resident.values() for a in layer.values()]),
                host_tasks=steps.stats.tasks.get("CPUATTN", 0))


if __name__ == "__main__":
    print(json.dumps({"families": {name: run(name) for name in sys.argv[1:]}}))
