"""DEP's two A2E routes (moejax.sharding.dep: regroup, the default, and straight to the experts' owners) and FinDEP's
α-β fitted to micro-benchmarks of the DEP tasks (moejax.measure.dep, moejax.plan.findep_costs): both routes give the
one-device float32 logits and move what the time model says; the fits reproduce the points they were fitted to; the
solver plans with them."""
import dataclasses
import os

import pytest
from workers import run_workers

from moejax.config import ModelConfig
from moejax.models.checkpoint import read_config
from moejax.plan.datasheets import load_profile
from moejax.plan.findep import solve_dep
from moejax.plan.findep_costs import (
    A2E_DEFAULT,
    a2e_bytes,
    attention_work,
    e2a_bytes,
    experts_seconds,
    fit_affine,
    fit_dep_tasks,
    predict_point,
    transfer_bytes_per_device,
    transfer_seconds,
)
from moejax.plan.hardware import DepTaskFits, Profile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = ModelConfig.from_hf(read_config(os.path.join(HERE, "fixtures", "deepseek_v2_lite")))


@pytest.fixture(scope="module")
def worker():
    return run_workers("dep_measure_worker.py", [[]], devices=8, timeout=900)[0]


@pytest.mark.slow
def test_both_routes_equal_one_device_and_move_what_the_model_says(worker):
    """attn_devices=3, expert_devices=4, r1=2, r2=2 on deepseek_v2_lite (D=32, k=2; 4 rows of 16 tokens padded to 6
    rows: 4 chunks of 24 rows per MoE layer, 2 MoE layers). Regroup is the default; both routes give the one-device
    logits; straight sends every chunk to each of the 4 expert devices and gets 4 partial outputs back, regroup
    sends each row once. The counters hold every device's bytes: 4 x the model's per expert device."""
    routes = worker["routes"]
    assert routes["default"] == A2E_DEFAULT == "regroup"
    chunks, rows = 8, 24
    for route in ("straight", "regroup"):
        assert routes[route]["rel"] <= 1e-5, route
        assert routes[route]["stats"]["a2e_bytes"] == 4 * chunks * a2e_bytes(CFG, rows, 4, 4, route), route
        assert routes[route]["stats"]["e2a_bytes"] == 4 * chunks * e2a_bytes(CFG, rows, 4, 4, route), route


@pytest.mark.slow
def test_fits_of_measured_tasks_reproduce_the_points(worker):
    fit = DepTaskFits.from_dict(worker["fit"])
    assert (fit.attn_devices, fit.expert_devices, fit.a2e) == (4, 4, "regroup")
    tasks = [p[0] for p in fit.points]
    assert tasks.count("attention") == tasks.count("experts") == tasks.count("shared") == 4  # 2 x 2 token counts
    assert tasks.count("a2e") == tasks.count("e2a") == 4
    refit = fit_dep_tasks(fit.points, attn_devices=4, expert_devices=4)
    assert refit.alpha_a == pytest.approx(fit.alpha_a) and refit.beta_e == pytest.approx(fit.beta_e)
    # Timings of a millisecond or so on simulated devices that share 2 cores with other processes carry noise of
    # tens of percent (the fit's arithmetic is checked exactly on known lines below): half the points or more
    # within 50% of their lines.
    errors = sorted(abs(predict_point(fit, p) / p[-1] - 1) for p in fit.points)
    assert errors[len(errors) // 2 - 1] <= 0.5, errors
    assert fit.alpha_a + fit.beta_gm + fit.beta_attn > 0 and fit.alpha_e + fit.beta_e > 0


def test_fit_affine_recovers_a_known_plane_and_stays_non_negative():
    xs = [(x, y) for x in (1.0, 10.0, 100.0) for y in (2.0, 50.0)]
    assert fit_affine(xs, [3e-6 + 2e-9 * x + 5e-8 * y for x, y in xs]) == pytest.approx((3e-6, 2e-9, 5e-8))
    alpha, beta = fit_affine([(1.0,), (2.0,), (3.0,)], [3.0, 2.0, 1.0])  # falling: no negative slope
    assert beta == 0 and alpha > 0


def _measured_fits(attn_devices: int, expert_devices: int) -> DepTaskFits:
    """Fits of synthetic points on known lines (seconds), as the profile would hold them."""
    points = []
    for m_a, seq in ((1, 16), (2, 16), (1, 64), (4, 64)):
        x, y = attention_work(CFG, m_a * seq, m_a, seq)
        points.append(("attention", x, y, 2e-4 + 1e-12 * x + 3e-11 * y))
    for rows in (16, 64, 256):
        points += [("experts", rows * 1e4, 5e-4 + 2e-12 * rows * 1e4), ("a2e", rows * 200.0, 1e-4 + 1e-9 * rows * 200),
                   ("e2a", rows * 100.0, 1e-4 + 1e-9 * rows * 100), ("shared", rows * 1e3, 3e-5 + 1e-11 * rows * 1e3)]
    return fit_dep_tasks(points, attn_devices=attn_devices, expert_devices=expert_devices, model="deepseek_v2_lite")


def test_solver_reads_the_profiles_measured_fits_and_falls_back_without_them():
    base = load_profile("h100")
    fits = _measured_fits(4, 4)
    for p in fits.points:
        assert predict_point(fits, p) == pytest.approx(p[-1], rel=1e-6)
    measured = dataclasses.replace(base, dep=(fits,))
    again = Profile.from_dict(measured.as_dict())  # the profile JSON keeps them
    assert again.dep_fits(4, 4) == fits and again.dep_fits(2, 6) is None
    kw = dict(devices=8, tokens=1024, seq_len=64, attn_devices=4, expert_devices=4)
    plan = solve_dep(CFG, again, **kw)
    coef = plan.coefficients
    assert coef.source == "measured"
    assert (coef.alpha_a, coef.alpha_e, coef.alpha_c, coef.alpha_s) == pytest.approx((2e-4, 5e-4, 1e-4, 3e-5))
    x1, y1 = attention_work(CFG, 64, 1, 64)
    assert coef.beta_a == pytest.approx(1e-12 * x1 + 3e-11 * y1, rel=1e-6)
    roofline = solve_dep(CFG, base, **kw).coefficients
    assert roofline.source == "roofline" and roofline.alpha_e != coef.alpha_e


def test_time_model_follows_the_route():
    """Straight: every expert device receives the whole chunk, whatever B; regroup: its 1/B, once per token, and
    the all-to-alls inside the expert group count in t_e (none with one expert device)."""
    h100 = load_profile("h100")
    m_e = 10.0
    rows = m_e * CFG.num_experts / CFG.num_experts_per_tok
    for b in (1, 2, 4):
        assert transfer_bytes_per_device(CFG, h100, m_e, b, "straight") == rows * CFG.hidden_size * h100.dtype_bytes
        assert transfer_bytes_per_device(CFG, h100, m_e, b, "regroup") == rows * CFG.hidden_size * 2 / b
    assert experts_seconds(CFG, h100, m_e, 1, "regroup") == experts_seconds(CFG, h100, m_e, 1, "straight")
    assert experts_seconds(CFG, h100, m_e, 4, "regroup") > experts_seconds(CFG, h100, m_e, 4, "straight")
    assert transfer_seconds(CFG, h100, m_e, 4, 4) == transfer_seconds(CFG, h100, m_e, 4, 4, "regroup")
