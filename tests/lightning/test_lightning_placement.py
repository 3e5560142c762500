"""placement='lightning' in process, on one device (the host's tasks and the device's share it): generations equal
the resident single-device float32 model's (greedy and sampled, static generate and the continuous scheduler) and
transformers' greedy tokens; the tasks run in Alg. 1's order; stats, --explain's lines and the pool's sizing; the
options' checks and placement auto's choice. Every family, with the cache on a second device, is in
test_lightning_families.py."""
import glob
import os

import jax
import numpy as np
import pytest
from conftest import fixture_dir, reference
from lightning_generate import NEW_TOKENS, scheduled

import moejax
from moejax.lightning.balance import BatchLimit
from moejax.lightning.schedule import PAGE, cgopipe_order, flexgen_order
from moejax.measure.lightning_probe import explain_lines, probe_decode
from moejax.plan.lightning import predict_policy
from moejax.plan.resolve import load_profile
from moejax.sched.continuous import GenRequest, Scheduler
from moejax.sched.pool_size import pool_size

NAME = "qwen3_moe"
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples",
                        "requests.jsonl")
POLICY = dict(decode_batch=4, micro_batch=2, resident_share=0.5, kv_device_share=0.0, attention_on="host")


@pytest.fixture(scope="module")
def prompts():
    ref = reference(NAME)
    return [ref[f"prompt_{i}"].tolist() for i in range(3)], [ref[f"greedy_{i}"][:NEW_TOKENS].tolist()
                                                              for i in range(3)]


@pytest.fixture(scope="module")
def resident():
    return moejax.load(fixture_dir(NAME), dtype="float32")


@pytest.fixture(scope="module")
def lightning():
    return moejax.load(fixture_dir(NAME), dtype="float32", placement="lightning", **POLICY)


def test_greedy_generations_equal_transformers(lightning, prompts):
    texts, transformers = prompts  # the resident model's tokens too (tests/test_engine.py)
    lightning.steps.trace(True)  # every task timed: the tokens are the same
    assert scheduled(lightning, texts) == transformers
    lightning.steps.trace(False)
    stats = lightning.stats()
    assert stats["placement"] == "lightning"
    pipeline = stats["pipeline"]
    assert pipeline["passes"] == pipeline["traced_passes"] > 0 and pipeline["wait_s"] > 0
    assert set(pipeline["busy_s_per_step"]) == {"device", "host", "link h2d", "link d2h"}
    assert all(b > 0 for b in pipeline["busy_s"].values())
    assert pipeline["bytes_d2h"] > 0 and pipeline["bytes_h2d"] > 0
    assert pipeline["tasks"]["CPUATTN"] == pipeline["tasks"]["OFFLOADQKV"] > 0
    assert stats["total"]["bytes_h2d"] > 0  # pages moved: half of each layer's experts is paged (r_w = 0.5)
    assert stats["total"]["misses"] == 0 and stats["total"]["hits"] > 0  # every page moved ahead of its layer
    lightning.reset_stats()
    assert lightning.stats()["pipeline"]["passes"] == 0


@pytest.mark.slow
def test_sampled_chunked_static_and_scoring_equal_the_resident_models(resident, lightning, prompts):
    texts, transformers = prompts
    assert scheduled(lightning, texts, temperature=0.9) == scheduled(resident, texts, temperature=0.9)
    # prompts cut into chunks of 4 tokens: the later chunks attend over the host pool (not only their own keys). In
    # micro-batches of one row, balanced longest first, A's second row would attend before its first row's keys are
    # stored: such a chunk step runs as one micro-batch
    one_row = moejax.load(fixture_dir(NAME), dtype="float32", placement="lightning", **{**POLICY, "micro_batch": 1})
    cut = [texts[1][:8], texts[0][:4], texts[2][:2]]
    assert scheduled(one_row, cut, row_tokens=4, chunk_tokens=16) == scheduled(resident, cut)
    assert one_row.stats()["total"]["misses"] == 0  # a one-micro-batch pass moves all 4 pages ahead, not 1
    assert lightning.generate(texts, NEW_TOKENS) == resident.generate(texts, NEW_TOKENS) == transformers
    ids = np.array([t[:3] for t in texts], np.int32)  # no cache: LayeredSteps' loop with the paged experts
    np.testing.assert_allclose(lightning.logits(ids), resident.logits(ids), rtol=1e-5, atol=1e-5)


def test_flexgen_order_runs_the_same_tokens(lightning, prompts):
    """The §6.1 ablation's baseline, FlexGen's launch order with this policy: the tasks run in that order and the
    greedy tokens are transformers' (the resident model's too), as under CGOPipe's order."""
    texts, transformers = prompts
    steps = lightning.steps
    steps.settings.schedule, steps.settings.record, steps.log = "flexgen", True, []
    try:
        assert scheduled(lightning, texts) == transformers
        log = list(steps.log)
    finally:
        steps.settings.schedule, steps.settings.record = "cgopipe", False
    work = [t for t in log if t.op != PAGE]  # pages run only when a page is not on its way yet
    want = [t for t in flexgen_order(3, 2) if t.op != PAGE]  # a decode pass: 4 rows in 2 micro-batches
    assert work[len(work) - len(want):] == want


def test_a_batch_over_alg2s_kv_limit_defers_the_rest_to_a_later_batch(lightning, prompts):
    """Alg. 2's abort path in the scheduler: prompts of 5, 11 and 3 tokens, 5 new each (KV 10, 16, 8), micro-batches
    of at most 12 KV tokens, raised to the longest request's 16 so that each can run. The first two fit one per
    micro-batch; the third would join the 10's (18 > 16), so it waits, though rows and blocks are free, and runs when
    they retire. Every token is transformers' (the resident model's). Without the limit all three ran in one
    batch."""
    texts, transformers = prompts
    out, order, failed = {}, [], []
    items = [GenRequest(p, NEW_TOKENS, np.asarray(jax.random.key_data(jax.random.key(r))), tag=r)
             for r, p in enumerate(texts)]
    options = {**lightning.placement.scheduler_defaults(), "decode_steps": 2, "batch_limit": BatchLimit(2, 2, 12)}
    stats = Scheduler(lightning, 64, **options).run(
        items, lambda g, tokens, cached: (out.__setitem__(g.tag, list(tokens)), order.append(g.tag)),
        lambda g, message: failed.append(message))
    assert not failed and [out[r] for r in range(3)] == transformers
    assert stats.kv_deferred == 1 and stats.peak_rows == 2 and stats.preemptions == 0
    assert order[-1] == 2  # the deferred request ran in the next batch


def test_the_placement_sizes_alg2s_limit_from_the_plan():
    engine = moejax.load(fixture_dir(NAME), dtype="float32", placement="lightning", plan_seq_len=8, plan_gen_len=4,
                         **POLICY)
    assert engine.placement.scheduler_defaults()["batch_limit"] == BatchLimit(2, 2, 2 * (8 + 4))


def test_the_pipeline_schedule_option():
    engine = moejax.load(fixture_dir(NAME), dtype="float32", placement="lightning", pipeline_schedule="flexgen",
                         **POLICY)
    assert engine.steps.settings.schedule == "flexgen" and "flexgen launch order" in engine.explain()
    with pytest.raises(ValueError, match="pipeline_schedule applies to placement 'lightning'"):
        moejax.load(fixture_dir(NAME), dtype="float32", placement="streamed", pipeline_schedule="flexgen")
    with pytest.raises(ValueError, match="pipeline_schedule must be one of"):
        moejax.load(fixture_dir(NAME), dtype="float32", placement="lightning", pipeline_schedule="gpipe", **POLICY)


def test_tasks_run_in_alg1_order_and_the_probe_times_them(lightning):
    steps = lightning.steps
    steps.settings.record, steps.log = True, []
    try:
        probe = probe_decode(lightning, rows=4, context=20, tokens=1)
    finally:
        steps.settings.record = False
    layers, micro_batches = len(steps.layers), 2  # 4 rows in micro-batches of 2
    order = cgopipe_order(layers, micro_batches)
    assert len(steps.log) % 3 == 0  # three calls (two warm-ups, one traced) of one pass each
    one_pass = steps.log[len(steps.log) // 3 * 2:]
    assert [t for t in one_pass if t.op != PAGE] == [t for t in order if t.op != PAGE]
    it = iter(order)
    assert all(t in it for t in one_pass)  # a subsequence: the pages that moved, at Alg. 1's places
    assert {t.op for t in one_pass} >= {"PREATTN", "OFFLOADQKV", "CPUATTN", "LOADH", "W_PINTOG", "POSTATTN"}
    assert probe.tokens_per_s > 0 and len(probe.events) == len(one_pass)
    assert set(probe.busy_s) == {"device", "host", "link h2d", "link d2h"}
    assert all(0 <= e.start <= e.end for e in probe.events)
    per_token = 3 * 2 * 2 * 16 * 4  # 3 layers of k and v, 2 kv heads of 16 dims, float32
    assert probe.host_kv_bytes == 4 * 21 * per_token  # one step of 4 rows reads 20 + 1 keys each
    assert probe.host_attention_gb_per_s > 0 and probe.host_read_gb_per_s > 0
    predicted = predict_policy(lightning.config, load_profile("l4"), N=4, mu=2, A_g=0, F_g=1, r_w=0.5, r_c=0.0,
                               prompt_len=16, gen_len=8)
    text = "\n".join(explain_lines(probe, predicted))
    assert "ms per layer per step" in text and "measured / predicted" in text and "L4" in text
    assert "a streaming read of the host pool reaches" in text
    assert "no hardware profile" in "\n".join(explain_lines(probe, None))


def test_explain_and_the_pool_in_host_memory(lightning):
    text = lightning.explain()
    assert "placement lightning: N=4 mu=2 (2 micro-batches) A_g=0" in text
    assert "KV cache of 3 of 3 layers on the host" in text and "4 of 8 experts per layer resident" in text
    assert "cgopipe launch order; Alg. 2 admits a request where its micro-batch's KV stays within 2304 tokens" in text
    size = pool_size(lightning, [(10, 6)] * 3)
    assert "host memory" in size.source and size.blocks == 3
    # Alg. 2's limit: 2 micro-batches of 2 rows, each the KV of 2 rows of the default plan's 1024 + 128 tokens
    assert lightning.placement.scheduler_defaults() == {"max_rows": 4, "decode_calls": 1,
                                                        "batch_limit": BatchLimit(2, 2, 2 * (1024 + 128))}
    pool = lightning.init_pool(2, decode=True)
    assert all(a.devices() == {lightning.steps.host} for layer in pool for a in layer.values())


@pytest.mark.parametrize("options, message", [
    (dict(host_memory_gb=1e-6), "needs .* of host memory, over the limit of .* host_memory_gb sets it"),
    (dict(micro_batch=8), "micro_batch 8 exceeds decode_batch 4"),
    (dict(resident_share=1.5), "resident_share must be a number in \\[0, 1\\], got 1.5"),
    (dict(device_memory_gb=1e-4), "exceed the budget"),
])
def test_bad_policies_are_refused_at_load(options, message):
    with pytest.raises(ValueError, match=message):
        moejax.load(fixture_dir(NAME), dtype="float32", placement="lightning", **{**POLICY, **options})


def test_options_need_placement_lightning():
    with pytest.raises(ValueError, match="decode_batch"):
        moejax.load(fixture_dir(NAME), dtype="float32", placement="streamed", decode_batch=4)


def test_decode_batch_was_batch_size_which_still_works_with_a_warning(capsys):
    with pytest.warns(FutureWarning, match="batch_size is renamed decode_batch; the old name is accepted for this "
                                           "release only"):
        engine = moejax.load(fixture_dir(NAME), dtype="float32", placement="lightning",
                             **{("batch_size" if k == "decode_batch" else k): v for k, v in POLICY.items()})
    assert engine.memory_budget.lightning.N == 4
    with pytest.raises(TypeError, match="give decode_batch, not both it and batch_size"):
        moejax.load(fixture_dir(NAME), placement="lightning", batch_size=4, **POLICY)
    from launch.serve import parse_args
    args = parse_args(["--input", "x", "--batch-size", "3"])
    assert args.decode_batch == 3
    assert "note: --batch-size is renamed --decode-batch" in capsys.readouterr().err
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    pages = [os.path.join(root, "README.md")] + glob.glob(os.path.join(root, "docs", "*.md"))
    assert len(pages) > 1
    for page in pages:
        assert "--batch-size" not in open(page, encoding="utf-8").read(), page


def test_auto_chooses_lightning_when_the_planned_kv_does_not_fit(resident):
    kv = resident.kv_bytes_per_token() * 8 * (1024 + 128)  # the default plan: 8 rows of 1024 + 128 tokens
    gb = (resident.param_bytes() + kv / 2) / 0.9 / 2**30  # the weights fit, the KV only half
    engine = moejax.load(fixture_dir(NAME), dtype="float32", placement="auto", device_memory_gb=gb, profile="l4")
    assert engine.placement.name == "lightning"
    assert any("placement auto: lightning, because the KV cache of 8 rows x 1152 tokens" in d
               for d in engine.decisions)
    assert engine.memory_budget.lightning.source.startswith("decode_batch, micro_batch")  # from the search
    fits = moejax.load(fixture_dir(NAME), dtype="float32", placement="auto", device_memory_gb=gb * 4, profile="l4")
    assert fits.placement.name == "resident"



@pytest.mark.slow  # a serve run with a probe: the probe itself is the fast test above
def test_serve_explain_probes_and_plots_lightning(tmp_path, capsys):
    from launch import serve as serve_cli
    pytest.importorskip("matplotlib")
    serve_cli.main(["--model", fixture_dir(NAME), "--dtype", "float32", "--input", EXAMPLES, "--explain",
                    "--placement", "lightning", "--decode-batch", "4", "--micro-batch", "2", "--resident-share", "0.5",
                    "--kv-device-share", "0", "--attention-on", "host", "--seq-len", "16", "--gen-len", "8",
                    "--profile", "l4", "--plot", str(tmp_path)])
    out = capsys.readouterr().out
    assert "placement lightning: N=4 mu=2" in out
    assert "lightning decode measured here: 4 rows at 20 tokens of context" in out and "measured / predicted" in out
    assert (tmp_path / "lightning-gantt.png").stat().st_size > 0


def test_static_batches_with_the_prefix_cache_on_equal_resident(lightning, resident, tmp_path):
    """--batching static --kv-cache on: lightning's static prefill computes every prompt token instead of reading
    and storing prefix blocks (it used to answer each such completion 500), with the resident engine's tokens."""
    import json

    from moejax.sched.batch import serve_lines
    from moejax.sched.serving_options import ServingOptions
    shared = list(range(1, 40))  # two full blocks every prompt shares
    lines = [json.dumps({"custom_id": f"c{i}", "url": "/v1/completions",
                         "body": {"prompt": shared + [50 + i], "max_tokens": 3}}) for i in range(4)]
    options = ServingOptions(batching="static", kv_cache="on", max_batch_tokens=64)
    outs = {}
    for tag, engine in (("lightning", lightning), ("resident", resident)):
        summary = serve_lines(engine, lines, str(tmp_path / f"{tag}.jsonl"), options, seed_nonce=0)
        assert summary["requests_failed"] == 0, summary
        outs[tag] = [json.loads(x)["response"]["body"]["choices"][0]["text"]
                     for x in (tmp_path / f"{tag}.jsonl").read_text().splitlines()]
        assert summary["batches_planned"] > 1  # the shared blocks are stored by one batch and read by a later one
    assert outs["lightning"] == outs["resident"]


def test_the_policy_search_sizes_the_kv_for_this_host_and_dtype():
    """The search plans on the profile (t4: a host of another size, 16-bit KV) but the batch must fit here, in the
    engine's dtype: it searches with host_memory_gb and float32's bytes, as the load's check counts them (it used
    to pick 11492 rows and then refuse them)."""
    engine = moejax.load(fixture_dir(NAME), dtype="float32", placement="lightning", profile="t4", host_memory_gb=0.05)
    plan = engine.memory_budget.lightning
    kv = engine.kv_bytes_per_token() * plan.N * (1024 + 128)  # the default workload's rows
    L = engine.config.num_layers
    on_host = kv * (L - plan.device_kv_layers(L)) / L  # all of it unless the search keeps some on the device
    assert plan.source.startswith("decode_batch, micro_batch") and kv > 0 and on_host <= 0.8 * 0.05 * 2**30


def test_the_ffn_reads_experts_from_their_pages_and_the_device_holds_two_layers_of_pages(resident, lightning,
                                                                                         prompts):
    """The page table (MoE-Lightning App. A.1's double buffer, no third copy): while each MoE layer's FFN is
    dispatched, no device array holds a layer's experts whole (the resident share, r_w = 0.5, holds half; a page a
    quarter); the pages on the device never exceed two layers' worth; the tokens stay the resident model's.
    Before, each layer's pages were concatenated into an assembled layer: this failed."""
    import jax

    from moejax.models.moe import is_routed_expert
    texts, _ = prompts
    experts = lightning.steps.experts
    store = experts.store
    E = lightning.config.num_experts
    layer_pages = max(sum(store.page_bytes(layer, p) for p in range(len(store.paged[layer]))) for layer in store.layers)
    expert_names = {p[3] for p in resident.param_shapes() if is_routed_expert(p)}
    whole = []
    release = experts.release
    shapes = {tuple(a.shape[1:]) for layer in store.layers for page in store.paged[layer] for a in page.values()}

    def watching(layer):  # the layer's FFN is dispatched for every micro-batch and its experts not yet dropped
        whole.extend(a.shape for a in jax.live_arrays() if a.ndim >= 3 and a.shape[0] == E
                     and tuple(a.shape[1:]) in shapes)
        return release(layer)
    experts.release = watching
    try:
        assert lightning.generate(texts, NEW_TOKENS) == resident.generate(texts, NEW_TOKENS)
    finally:
        del experts.release
    assert expert_names and not whole, whole
    assert 0 < experts.peak_paged_bytes <= 2 * layer_pages
