"""The two policies of MoE-Lightning's search that moejax used to refuse, run by placement='lightning': the MoE FFN on
the host over the experts in host memory (ffn_on='host', F_g = 0) and attention on the device over a KV cache partly
on the host, swapped in per layer (attention_on='device' with kv_device_share < 1, FlexGen's S4). Their tokens and
logits equal the resident single-device float32 model's; the policy checks now pass them, and still refuse what
cannot run."""
import numpy as np
import pytest
from conftest import fixture_dir, reference
from lightning_generate import NEW_TOKENS, scheduled

import moejax
from moejax.config import ModelConfig
from moejax.lightning.policy import FIELDS, resolve_plan
from moejax.offload.memory_budget import MemoryBudgetError
from moejax.plan.datasheets import load_profile
from moejax.plan.lightning import predict_policy
from moejax.presets import preset_config

NAME = "qwen3_moe"
BASE = dict(decode_batch=4, micro_batch=2, resident_share=0.5, kv_device_share=0.0, attention_on="host")
HOST_FFN = {**BASE, "ffn_on": "host"}
SWAPPED_KV = {**BASE, "attention_on": "device", "kv_device_share": 0.5}  # 2 of 3 layers' KV on the device
MIXTRAL = ModelConfig.from_hf(preset_config("mixtral-8x7b"))


def _resolve(given: dict, profile: str = "l4"):
    return resolve_plan(MIXTRAL, {f: given.get(f) for f in FIELDS}, prompt_len=64, gen_len=16,
                        profile=lambda: load_profile(profile))


def test_both_policies_resolve_and_the_search_calls_them_executable():
    host_ffn, swapped = _resolve(HOST_FFN), _resolve(SWAPPED_KV)
    assert (host_ffn.A_g, host_ffn.F_g) == (0, 0) and "FFN on the host" in host_ffn.describe()
    assert (swapped.A_g, swapped.F_g, swapped.r_c) == (1, 1, 0.5)
    assert swapped.device_kv_layers(3) == 2 and swapped.swaps_kv(3) and not host_ffn.swaps_kv(3)
    assert _resolve({**SWAPPED_KV, "kv_device_share": 1.0}).swaps_kv(3) is False  # every layer's KV on the device
    for A_g, F_g, r_c in ((0, 0, 0.0), (1, 1, 0.5), (1, 0, 0.25)):
        p = predict_policy(MIXTRAL, load_profile("l4"), N=64, mu=16, A_g=A_g, F_g=F_g, r_w=0.0, r_c=r_c,
                           prompt_len=64, gen_len=16)
        assert p.executable and "placement 'lightning'" in p.note and "no executor" not in p.note
    # the search's best runs as found: no fallback to a runner-up (ffn_on comes from it when it runs)
    searched = _resolve({})
    assert searched.searched is not None and "ffn_on" in searched.source
    best = searched.searched
    assert (searched.A_g, searched.F_g, searched.N, searched.mu) == (best.A_g, best.F_g, best.N, best.mu)
    assert _resolve({**BASE}).F_g == 1  # every other field given: the FFN stays on the device, no search


@pytest.mark.parametrize("given, message", [
    ({**HOST_FFN, "micro_batch": 8}, "micro_batch 8 exceeds decode_batch 4"),
    ({**SWAPPED_KV, "micro_batch": 8}, "micro_batch 8 exceeds decode_batch 4"),
])
def test_what_cannot_run_is_still_refused(given, message):
    with pytest.raises(MemoryBudgetError, match=message):
        _resolve(given)


@pytest.fixture(scope="module")
def prompts():
    ref = reference(NAME)
    return [ref[f"prompt_{i}"].tolist() for i in range(3)], [ref[f"greedy_{i}"][:NEW_TOKENS].tolist()
                                                              for i in range(3)]


@pytest.mark.slow  # two engines' compiles (~50 s each on 2 CPU cores)
@pytest.mark.parametrize("options", [HOST_FFN, SWAPPED_KV], ids=["ffn_on_host", "attention_on_device_swapped_kv"])
def test_tokens_and_logits_equal_the_resident_models(options, prompts):
    texts, transformers = prompts  # the resident float32 model's greedy tokens too (tests/test_engine.py)
    resident = moejax.load(fixture_dir(NAME), dtype="float32")
    engine = moejax.load(fixture_dir(NAME), dtype="float32", placement="lightning", **options)
    assert scheduled(engine, texts) == transformers
    assert scheduled(engine, texts, temperature=0.9) == scheduled(resident, texts, temperature=0.9)
    assert engine.generate(texts, NEW_TOKENS) == transformers
    ids = np.array([t[:3] for t in texts], np.int32)  # no cache: LayeredSteps' loop with the placement's experts
    np.testing.assert_allclose(engine.logits(ids), resident.logits(ids), rtol=1e-5, atol=1e-5)
    stats, text = engine.stats(), engine.explain()
    pipeline = stats["pipeline"]
    if options is HOST_FFN:
        assert stats["total"]["bytes_h2d"] == 0 and stats["total"]["hits"] > 0  # no expert page moved
        assert stats["host_ffn"]["bytes_d2h"] > 0 and stats["host_ffn"]["bytes_h2d"] > 0
        assert "4 of 8 experts per layer resident" in text and "run by the host" in text
        assert pipeline["bytes_kv_swap"] == 0
    else:
        # 1 of 3 layers swapped in per read pass; only its new KV goes to the host, where nothing attends
        assert pipeline["bytes_kv_swap"] > 0 and pipeline["tasks"]["CPUATTN"] == pipeline["tasks"]["OFFLOADQKV"] > 0
        assert "KV cache of 1 of 3 layers on the host" in text and "swapped in to the device per pass" in text
    engine.steps.settings.schedule = "flexgen"  # FlexGen's launch order (the §6.1 ablation) runs either policy too
    assert scheduled(engine, texts) == transformers
