"""FinDEP's planner (moejax.plan.findep) and the DEP pipeline simulator (moejax.plan.dep_sim) on datasheet profiles
and random α-β coefficients: pure Python, no JAX devices."""
import json
import random
import time

import pytest

from moejax.config import ModelConfig
from moejax.costs import _attn_proj_params
from moejax.layout import Layout
from moejax.plan import findep, findep_costs
from moejax.plan.datasheets import load_profile
from moejax.plan.dep_sim import RESOURCES, TaskTimes, simulate, simulate_schedule
from moejax.presets import preset_config


def _preset(name: str) -> ModelConfig:
    return ModelConfig.from_hf(preset_config(name))


def _deepseek_v2(layers: int = 2) -> ModelConfig:
    """DeepSeek-V2 (236B)'s dimensions on the V2-Lite preset (MLA, 2 shared experts), `layers` MoE layers: the
    paper's Tables 3-4 shrink it to 2."""
    return _preset("deepseek-v2-lite").replace(
        hidden_size=5120, num_heads=128, num_kv_heads=128, num_experts=160, moe_intermediate_size=1536,
        shared_expert_size=2 * 1536, q_lora_rank=1536, num_layers=layers, moe_layers=(True,) * layers,
        layer_types=("full",) * layers)


def _random_coefficients(rng: random.Random, A: int, B: int, S: int) -> findep_costs.DepCoefficients:
    """α, β >= 0 spread over orders of magnitude (cubed uniforms); no shared expert 30% of the time."""
    u = lambda scale: scale * rng.uniform(0, 1) ** 3  # noqa: E731
    shared = rng.random() < 0.7
    return findep_costs.DepCoefficients(
        A, B, S, alpha_a=u(1e-4), beta_a=u(1e-3), alpha_s=u(1e-4) if shared else 0.0,
        beta_s=u(1e-3) if shared else 0.0, alpha_e=u(3e-4), beta_e=u(2e-6), alpha_c=u(1e-4), beta_c=u(2e-6),
        alpha_d=u(1e-4), beta_d=u(1e-3))


def _segments(layers) -> tuple[int, ...]:
    out, run = [], 0
    for moe in layers:
        if moe:
            run += 1
        elif run:
            out, run = out + [run], 0
    return tuple(out + ([run] if run else []))


def _workload(layers, *, sequences=100, seq_len=64, top_k=2, experts=8, free=1e12, resident=1.0, working=1.0):
    return findep.DepWorkload(sequences=sequences, seq_len=seq_len, top_k=top_k, experts=experts,
                              moe_segments=_segments(layers), dense_layers=list(layers).count(False), free_bytes=free,
                              resident_bytes_per_sequence=resident, working_bytes_per_sequence=working)


# -- time models and fits -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["deepseek-v2-lite", "qwen3-30b-a3b", "tiny-qwen3-moe", "gpt-oss-20b"])
def test_attention_gemms_are_costs_projections(name):
    cfg = _preset(name)
    assert sum(k * n for k, n in findep_costs.attention_gemms(cfg)) == _attn_proj_params(cfg)


def test_fit_line_recovers_a_line_and_keeps_alpha_beta_nonnegative():
    fit = findep_costs.fit_line("t", "x", [1, 10, 100, 1000], [3e-6 + 2e-9 * x for x in (1, 10, 100, 1000)])
    assert fit.alpha == pytest.approx(3e-6) and fit.beta == pytest.approx(2e-9) and fit.r_squared > 0.999999
    falling = findep_costs.fit_line("t", "x", [1, 2, 3], [3.0, 2.0, 1.0])
    assert falling.beta == 0.0 and falling.alpha > 0
    through_origin = findep_costs.fit_line("t", "x", [1, 2, 3], [0.5, 2.0, 3.5])
    assert through_origin.alpha == 0.0 and through_origin.beta > 0


def test_fitted_coefficients_follow_the_roofline_where_it_is_affine():
    """Prefill GEMMs and attention are compute-bound on an H100 datasheet: t_a, t_s are affine in m_a and the fit
    reproduces them; the grouped expert GEMMs bend (weights read per chunk, then compute), so α_e carries the
    weight reads."""
    cfg, prof = _preset("deepseek-v2-lite"), load_profile("h100")
    coef = findep_costs.fit_coefficients(cfg, prof, attn_devices=4, expert_devices=4, seq_len=2048, max_m_a=8)
    for m in (1, 3, 8):
        t = coef.task_times(m, 100.0)
        assert t.attention == pytest.approx(findep_costs.attention_seconds(cfg, prof, m, 2048), rel=1e-6)
        assert t.shared == pytest.approx(findep_costs.shared_seconds(cfg, prof, m, 2048), rel=1e-6)
    assert coef.alpha_c == pytest.approx(prof.d2d.alpha_s)
    weights = 16 * 3 * 2048 * 1408 * 2 / prof.device.bandwidth  # 64 / 4 local experts, bf16
    assert 0.5 * weights < coef.alpha_e < 2 * weights
    assert all(f.alpha >= 0 and f.beta >= 0 for f in coef.fits)


# -- the objective ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("devices", [(3, 5), (8, 32)])
@pytest.mark.parametrize("seq_len", [1024, 2048, 4096])
def test_throughput_monotone_in_m_a_and_in_r1(devices, seq_len):
    """Theorems 1 and 3 / Tables 3-4: at fixed r1 more sequences per micro-batch never lower the predicted
    throughput, nor do more micro-batches at fixed m_a (r2 and the order chosen for each point; chunk padding
    included)."""
    A, B = devices
    cfg, prof = _deepseek_v2(), load_profile("h100")
    work = findep.dep_workload(cfg, prof, tokens=seq_len, seq_len=seq_len)
    coef = findep_costs.fit_coefficients(cfg, prof, attn_devices=A, expert_devices=B, seq_len=seq_len, max_m_a=16)
    grid = (1, 2, 4, 8, 16)
    tps = {(m, r): findep.evaluate(coef, work, m_a=m, r1=r).predicted_tokens_per_s for m in grid for r in grid}
    for r in grid:
        along_m = [tps[(m, r)] for m in grid]
        assert along_m == sorted(along_m), (r, along_m)
    for m in grid:
        along_r = [tps[(m, r)] for r in grid]
        assert along_r == sorted(along_r), (m, along_r)
    assert tps[(16, 16)] > tps[(1, 1)]


def test_objective_equals_the_simulation_for_each_order():
    """The closed forms (findep module docstring) against the discrete-event simulation of Eq. 5's rules, on
    random durations, r1 <= 8, r2 <= 8, up to 10 MoE layers and 0-2 leading dense layers (DeepSeek's shape):
    measured worst relative disagreement over these 900 cases 1.7e-14 (rounding), so tolerance 1e-9. The paper's
    printed Eq. 13 is up to 30% off on the same cases (82% on uniformly drawn durations: the r2 tail counted
    twice, the last shared segments missed)."""
    rng = random.Random(1)
    worst = dict.fromkeys(findep.PLAN_ORDERS, 0.0)
    for _ in range(300):
        layers = [False] * rng.randint(0, 2) + [True] * rng.randint(1, 10)
        A, B = rng.randint(1, 6), rng.choice([1, 2, 4, 8])
        work = _workload(layers, seq_len=rng.choice([16, 64, 256]))
        coef = _random_coefficients(rng, A, B, work.seq_len)
        m_a, r1 = rng.randint(1, 4), rng.randint(1, 8)
        for order in findep.PLAN_ORDERS:
            r2 = 1 if order == "pppipe" else rng.randint(1, 8)
            sim = simulate(findep.task_times(coef, work, m_a=m_a, r2=r2), layers=layers, r1=r1, r2=r2, order=order)
            predicted = findep.predicted_seconds(coef, work, m_a=m_a, r1=r1, r2=r2, order=order)
            worst[order] = max(worst[order], abs(predicted - sim.makespan) / sim.makespan)
    assert max(worst.values()) < 1e-9, worst


def test_dense_layers_between_moe_layers_are_overestimated_within_a_bound():
    """A dense layer between MoE runs is counted as a drain and a restart of the pipeline: never below the
    simulation; measured worst over-estimate on these 600 random cases 22% (47% on uniformly drawn durations:
    an AG-only layer among short MoE runs), tolerance 30%. No preset has one (DeepSeek's dense layer leads)."""
    rng = random.Random(2)
    worst = 0.0
    for _ in range(200):
        layers = [rng.random() < 0.75 for _ in range(rng.randint(2, 10))]
        layers[-1] = True
        work = _workload(layers)
        coef = _random_coefficients(rng, rng.randint(1, 4), rng.choice([1, 2, 4]), work.seq_len)
        m_a, r1 = rng.randint(1, 3), rng.randint(1, 6)
        for order in findep.PLAN_ORDERS:
            r2 = 1 if order == "pppipe" else rng.randint(1, 6)
            times = findep.task_times(coef, work, m_a=m_a, r2=r2)
            sim = simulate(times, layers=layers, r1=r1, r2=r2, order=order).makespan
            predicted = findep.predicted_seconds(coef, work, m_a=m_a, r1=r1, r2=r2, order=order)
            assert predicted >= sim * (1 - 1e-9)
            worst = max(worst, predicted / sim - 1)
    assert worst < 0.3


def test_a_plan_simulates_to_its_prediction():
    """End to end on DeepSeek-V2-Lite (a leading dense layer, 26 MoE layers): simulate the plan's pass."""
    cfg, prof = _preset("deepseek-v2-lite"), load_profile("h100")
    for order in findep.PLAN_ORDERS:
        plan = findep.solve_dep(cfg, prof, devices=8, tokens=32 * 1024, seq_len=1024, order=order)
        makespan, events = simulate_schedule(cfg, prof, plan)
        assert makespan * plan.passes == pytest.approx(plan.predicted_s, rel=1e-9)
        assert {e.resource for e in events} == set(RESOURCES)
    first = simulate_schedule(cfg, prof, plan, layers=3)
    assert {int(e.label.split()[1][1:]) for e in first.events} == {0, 1, 2}
    with pytest.raises(ValueError, match="profile"):
        simulate_schedule(cfg, load_profile("a100"), plan)


# -- the solver ---------------------------------------------------------------------------------------------------

def test_solver_equals_exhaustive_search_on_random_coefficients():
    """Alg. 1 (Pareto scan, convex r2 search widened to exactness, bound pruning) against the brute force over the
    same space: 80 seeded draws of coefficients, workloads, layer structures and memory (some needing several
    passes), both FinDEP's orders and PPPipe."""
    rng = random.Random(0)
    checked = 0
    for _ in range(40):
        seq_len, experts = rng.choice([8, 32, 128, 512]), rng.choice([4, 8, 16])
        work = findep.DepWorkload(
            sequences=rng.randint(1, 40), seq_len=seq_len, top_k=rng.randint(1, min(4, experts)), experts=experts,
            moe_segments=rng.choice([(1,), (2,), (5,), (3, 2)]), dense_layers=rng.randint(0, 2),
            free_bytes=rng.choice([1e12, 100.0, 40.0]), resident_bytes_per_sequence=rng.uniform(1, 4),
            working_bytes_per_sequence=rng.uniform(0, 8))
        for orders in (findep.ORDERS, ("pppipe",)):
            coefs = [_random_coefficients(rng, A, B, seq_len) for A, B in ((1, 4), (3, 2), (2, 2), (5, 1))]
            solved = findep.fastest(c for coef in coefs for c in findep.search_split(coef, work, orders=orders)
                                     .values())
            brute = findep.fastest(c for coef in coefs for c in findep.exhaustive_split(coef, work, orders=orders)
                                    .values())
            assert solved.predicted_s == pytest.approx(brute.predicted_s, rel=1e-12)
            if solved != brute:  # a tie: another configuration with the same predicted time
                assert solved.predicted_s == brute.predicted_s
            checked += 1
    assert checked == 80


def test_solve_dep_exhaustive_agrees_and_is_json():
    cfg, prof = _preset("qwen3-30b-a3b"), load_profile("h100")
    plan = findep.solve_dep(cfg, prof, devices=8, tokens=16 * 2048, seq_len=2048, exhaustive=True)
    d = json.loads(json.dumps(plan.as_dict()))
    for key in ("attn_devices", "expert_devices", "r1", "r2", "order", "predicted_tokens_per_s", "solve_ms"):
        assert key in d and key in d["exhaustive"]
    assert d["exhaustive"]["predicted_s"] == pytest.approx(plan.predicted_s, rel=1e-12)
    assert plan.predicted_tokens_per_s == pytest.approx(plan.tokens / plan.predicted_s)
    assert plan.alternatives and all(a.predicted_s >= plan.predicted_s for a in plan.alternatives)
    assert {(a.attn_devices, a.order) for a in plan.alternatives} | {(plan.attn_devices, plan.order)} == {
        (A, o) for A in (4, 6, 7) for o in findep.ORDERS}  # B in {4, 2, 1} divide 128 experts
    assert "runner-ups" in plan.describe() and plan.layout_spec() in plan.describe()
    layout = Layout.parse(plan.layout_spec()).resolve(cfg.num_experts, 8)
    assert (layout.attn_devices, layout.expert_devices, layout.r1, layout.r2, layout.order) == (
        plan.attn_devices, plan.expert_devices, plan.r1, plan.r2, plan.order)


@pytest.mark.parametrize("devices", [8, 16, 32, 64])
def test_solve_time(devices):
    """The target is < 50 ms for 8-64 devices (measured 1-26 ms on one CPU core for four presets and workloads from
    8K to 4M tokens); asserted loosely, < 200 ms, as CI machines are slow and shared."""
    cfg, prof = _preset("deepseek-v2-lite"), load_profile("h100")
    best = min(findep.solve_dep(cfg, prof, devices=devices, tokens=1 << 20, seq_len=512).solve_ms for _ in range(3))
    assert best < 200


@pytest.mark.parametrize("name,profile", [("deepseek-v2-lite", "h100"), ("qwen3-30b-a3b", "a100"),
                                          ("deepseek-v2-lite", "l4")])
@pytest.mark.parametrize("seq_len", [512, 4096])
def test_findep_at_least_pppipe(name, profile, seq_len):
    """PPPipe is FinDEP's r2 = 1 with the shared expert serialised before the sends: FinDEP's best is never
    slower, and at equal (m_a, r1) ASAS with r2 = 1 is never slower than PPPipe."""
    cfg, prof = _preset(name), load_profile(profile)
    kw = dict(devices=8, tokens=64 * seq_len, seq_len=seq_len)
    fin, pp = findep.solve_dep(cfg, prof, **kw), findep.pppipe_plan(cfg, prof, **kw)
    assert pp.order == "pppipe" and pp.r2 == 1
    assert fin.predicted_tokens_per_s >= pp.predicted_tokens_per_s
    work = findep.dep_workload(cfg, prof, tokens=kw["tokens"], seq_len=seq_len)
    coef = fin.coefficients
    for m_a, r1 in ((1, 1), (2, 4), (4, 2)):
        at = dict(m_a=m_a, r1=r1, r2=1)
        assert findep.predicted_seconds(coef, work, order="asas", **at) <= findep.predicted_seconds(
            coef, work, order="pppipe", **at)


def test_default_plan_is_the_executor_default():
    cfg, prof = _preset("deepseek-v2-lite"), load_profile("h100")
    kw = dict(devices=8, tokens=32 * 2048, seq_len=2048)
    default, best = findep.default_plan(cfg, prof, **kw), findep.solve_dep(cfg, prof, **kw)
    layout = Layout.parse("attn=dp,experts=dep").resolve(cfg.num_experts, 8)
    assert (default.attn_devices, default.expert_devices, default.r1, default.r2, default.order) == (
        layout.attn_devices, layout.expert_devices, layout.r1, layout.r2, layout.order)
    assert best.predicted_s <= default.predicted_s


def test_held_fixed_parameters_are_respected():
    cfg, prof = _preset("deepseek-v2-lite"), load_profile("h100")
    kw = dict(devices=8, tokens=32 * 2048, seq_len=2048)
    plan = findep.solve_dep(cfg, prof, attn_devices=6, r1=3, r2=5, order="aass", **kw)
    assert (plan.attn_devices, plan.expert_devices, plan.r1, plan.r2, plan.order) == (6, 2, 3, 5, "aass")
    assert "held fixed" in plan.searched
    assert {(a.attn_devices, a.order) for a in plan.alternatives} == set()  # nothing else was searched
    plan = findep.solve_dep(cfg, prof, expert_devices=4, **kw)
    assert (plan.attn_devices, plan.expert_devices) == (4, 4)
    plan = findep.solve_dep(cfg, prof, r1=2, **kw)
    assert plan.r1 == 2 and all(a.r1 == 2 for a in plan.alternatives)
    plan = findep.solve_dep(cfg, prof, order="pppipe", **kw)
    assert plan.order == "pppipe" and plan.r2 == 1
    free = findep.solve_dep(cfg, prof, **kw)  # holding the chosen split changes neither the fits nor the choice
    held = findep.solve_dep(cfg, prof, attn_devices=free.attn_devices, **kw)
    assert held.coefficients == free.coefficients and held.predicted_s == free.predicted_s


def test_memory_splits_the_workload_into_passes():
    """With little memory the fewest passes that fit, each covered by r1 micro-batches of m_a sequences."""
    cfg, prof = _preset("deepseek-v2-lite"), load_profile("h100")
    small = 40 * 2**30
    work = findep.dep_workload(cfg, prof, tokens=4096 * 4096, seq_len=4096, memory_bytes=small)
    plan = findep.solve_dep(cfg, prof, devices=8, tokens=4096 * 4096, seq_len=4096, memory_bytes=small)
    assert plan.passes > 1
    assert plan.m_a <= work.max_m_a(plan.r1)
    assert plan.passes * plan.r1 * plan.m_a * plan.attn_devices >= work.sequences


def test_pass_shapes_vectorised_equal_the_scalar_rule():
    rng = random.Random(3)
    for _ in range(300):
        work = _workload([True], sequences=rng.randint(1, 300), free=rng.choice([1e12, rng.uniform(1, 500)]),
                         resident=rng.uniform(0.5, 5), working=rng.uniform(0, 10))
        A = rng.randint(1, 8)
        r1s, passes, m_a = work.pass_shapes(A)
        scalar = []
        for r1 in range(1, work.max_r1(A) + 1):
            shape = work.pass_shape(A, r1)
            if shape is None:
                break
            scalar.append((r1, *shape))
        assert list(zip(r1s.tolist(), passes.tolist(), m_a.tolist(), strict=True)) == scalar


def test_bad_inputs_name_the_problem():
    cfg, prof = _preset("tiny-qwen3-moe"), load_profile("h100")  # 8 experts
    kw = dict(tokens=4096, seq_len=512)
    with pytest.raises(ValueError, match="devices=1"):
        findep.solve_dep(cfg, prof, devices=1, **kw)
    with pytest.raises(ValueError, match="E % B == 0"):
        findep.solve_dep(cfg, prof, devices=4, attn_devices=1, **kw)  # B = 3
    with pytest.raises(ValueError, match="tokens=100 is less than seq_len=512"):
        findep.solve_dep(cfg, prof, devices=4, tokens=100, seq_len=512)
    with pytest.raises(ValueError, match="order"):
        findep.solve_dep(cfg, prof, devices=4, order="abab", **kw)
    with pytest.raises(ValueError, match="r2"):
        findep.solve_dep(cfg, prof, devices=4, order="pppipe", r2=2, **kw)
    with pytest.raises(ValueError, match="attn_devices=3 \\+ expert_devices=3"):
        findep.solve_dep(cfg, prof, devices=4, attn_devices=3, expert_devices=3, **kw)
    with pytest.raises(ValueError, match="memory"):
        findep.solve_dep(_preset("deepseek-v2-lite"), prof, devices=8, memory_bytes=2**30, **kw)


# -- the simulator ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("order", findep.PLAN_ORDERS)
def test_simulation_events_respect_resources_and_dependencies(order):
    times = TaskTimes(attention=1.0, shared=0.7, experts=0.5, a2e=0.3, e2a=0.3, dense=1.5)
    r1, r2 = 3, 1 if order == "pppipe" else 2
    sim = simulate(times, layers=(False, True, True), r1=r1, r2=r2, order=order)
    by_label = {e.label: e for e in sim.events}
    for resource in RESOURCES:  # one task at a time, in dispatch order
        spans = [(e.start, e.end) for e in sim.events if e.resource == resource]
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(spans, spans[1:], strict=False))
    for t in (1, 2):
        for i in range(r1):
            attn = by_label[f"attn L{t} m{i}"]
            release = by_label[f"shared L{t} m{i}"].end if order == "pppipe" else attn.end
            for j in range(r2):
                a2e, ex, e2a = (by_label[f"{k} L{t} m{i} c{j}"] for k in ("a2e", "experts", "e2a"))
                assert a2e.start >= release and ex.start >= a2e.end and e2a.start >= ex.end
                if t == 2:
                    assert by_label[f"attn L2 m{i}"].start >= by_label[f"e2a L1 m{i} c{j}"].end
    ag = [e.label.split()[0] for e in sim.events if e.resource == "AG" and " L1 " in e.label]
    assert ag == (["attn"] * r1 + ["shared"] * r1 if order == "aass" else ["attn", "shared"] * r1)
    assert sim.makespan == max(e.end for e in sim.events)
    assert sim.busy("AG") == pytest.approx(r1 * (1.5 + 2 * 1.7))


def test_simulation_without_shared_experts_has_no_shared_tasks():
    times = TaskTimes(attention=1.0, shared=0.0, experts=0.5, a2e=0.3, e2a=0.3)
    sim = simulate(times, layers=(True,), r1=2, r2=2, order="asas")
    assert not [e for e in sim.events if e.label.startswith("shared")]
    with pytest.raises(ValueError, match="order"):
        simulate(times, layers=(True,), r1=2, r2=2, order="sasa")


def test_solver_wall_time_is_reported():
    cfg, prof = _preset("tiny-qwen3-moe"), load_profile("h100")
    start = time.perf_counter()
    plan = findep.solve_dep(cfg, prof, devices=4, tokens=8 * 256, seq_len=256)
    assert 0 < plan.solve_ms <= (time.perf_counter() - start) * 1e3


def test_the_default_takes_the_nearest_split_the_experts_divide_over(capsys):
    """Mixtral's 8 experts do not divide over 6 of 12 devices; the default (the executor's and the
    plan's baseline) takes 4 + 8, the nearest expert group they divide over (ties: the larger), says so, and the
    plan CLI prints the plan instead of exiting on it."""
    from launch.plan import main
    cfg, prof = _preset("mixtral-8x7b"), load_profile("h100")
    default = findep.default_plan(cfg, prof, devices=12, tokens=16384, seq_len=4096)
    assert (default.attn_devices, default.expert_devices) == (4, 8)
    assert "half and half (6 + 6) does not divide the 8 experts" in default.searched
    layout = Layout.parse("attn=dp,experts=dep").resolve(cfg.num_experts, 12)
    assert (layout.attn_devices, layout.expert_devices) == (4, 8)
    assert main(["dep", "--model", "mixtral-8x7b", "--profile", "h100", "--devices", "12", "--tokens", "16384"]) == 0
    out = capsys.readouterr().out
    assert "default: DEP schedule" in out and "the nearest split that does: 4 + 8" in out
    even = findep.default_plan(cfg, prof, devices=8, tokens=16384, seq_len=4096)  # 4 + 4: half and half divides
    assert (even.attn_devices, even.expert_devices) == (4, 4) and "half and half" not in even.searched
