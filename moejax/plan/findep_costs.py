"""FinDEP's time models and their α-β coefficients (sections 1 and 2 of moejax.plan.findep's docstring): each DEP
task's seconds on a profile's roofline (Eq. 1-4), and straight lines fitted to them by least squares on sampled
sizes (Eq. 7-11); or, where the profile holds them (`launch.profile --dep`), α-β fitted to micro-benchmarks of the
tasks themselves on the devices (`fit_dep_tasks`, `measured_coefficients`). Pure functions of a ModelConfig and a
Profile.

The models follow the executor's A2E route (moejax.sharding.dep.Disaggregated.a2e; A2E_DEFAULT unless told):
- regroup (the default, measured faster on 8 simulated CPU devices: bench/results/dep-a2e-cpu.json): a chunk lands
  on the expert group split by rows (each token once), an all-to-all inside the group routes every (token, choice)
  row to its expert's device in dropless buffers, a second one brings the outputs back, and the outputs return
  split by rows. The two all-to-alls run inside the expert group's program: they are part of t_e.
- straight (FinDEP's A2E): each attention device sends its rows, with their routing, to every expert device (a
  static dropless buffer for one owner must hold all of a sender's rows: every expert device receives the whole
  chunk) and each expert device sends back its weighted partial outputs of the whole chunk.
Under both an expert device runs every (token, choice) row of the chunk through its grouped GEMMs, the rows of
other devices' experts (or the buffers' padding) at weight 0: static shapes, where the paper's m_e E / B rows would
need ragged buffers."""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import numpy as np

from moejax.config import ModelConfig
from moejax.costs import causal_pairs
from moejax.plan.dep_sim import TaskTimes
from moejax.plan.hardware import DepTaskFits, Profile

A2E_ROUTES = ("regroup", "straight")
A2E_DEFAULT = "regroup"  # measured: `python -m launch.bench dep-a2e` (bench/results/dep-a2e-cpu.json)
ROUTING_BYTES = 8  # per row and choice: an int32 expert id and a float32 weight (or row flag)
R2_MAX = 64  # token chunks per micro-batch searched (each re-reads the local experts' weights and pays the latencies)
_FIT_POINTS = 12


# -- 1. time models on the roofline (Eq. 1-4) ------------------------------------------------------------------

def attention_gemms(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(k, n) of each attention projection GEMM, as costs.py counts them (their k n sum to _attn_proj_params)."""
    D, H = cfg.hidden_size, cfg.num_heads
    if cfg.attention == "mla":
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        q = [(D, cfg.q_lora_rank), (cfg.q_lora_rank, H * qk)] if cfg.q_lora_rank else [(D, H * qk)]
        return q + [(D, cfg.kv_lora_rank + cfg.qk_rope_head_dim),
                    (cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim)), (H * cfg.v_head_dim, D)]
    hd, K = cfg.head_dim, cfg.num_kv_heads
    return [(D, H * hd), (D, K * hd), (D, K * hd), (H * hd, D)]


def _moe_gemms(cfg: ModelConfig) -> list[tuple[int, int]]:
    """Attention projections + the router: the attention segment of a MoE layer."""
    return attention_gemms(cfg) + [(cfg.hidden_size, cfg.num_experts)]


def _shared_gemms(cfg: ModelConfig) -> list[tuple[int, int]]:
    D, S = cfg.hidden_size, cfg.shared_expert_size
    if not S:
        return []
    return [(D, S), (D, S), (S, D)] + ([(D, 1)] if cfg.shared_expert_gate else [])


def _dense_gemms(cfg: ModelConfig) -> list[tuple[int, int]]:
    D, F = cfg.hidden_size, cfg.intermediate_size
    return attention_gemms(cfg) + [(D, F), (D, F), (F, D)]


def _gemms_seconds(profile: Profile, gemms: Iterable[tuple[int, int]], rows: float) -> float:
    b, dev = profile.dtype_bytes, profile.device
    return sum(dev.op_time(2 * rows * k * n, (rows * k + k * n + rows * n) * b, "matmul", rows) for k, n in gemms)


def _head_dims(cfg: ModelConfig) -> tuple[int, int]:
    return (cfg.q_head_dim, cfg.v_head_dim) if cfg.attention == "mla" else (cfg.head_dim, cfg.head_dim)


def _mean_pairs(cfg: ModelConfig, seq_len: int, moe: bool) -> float:
    """Causal (query, key) pairs of one sequence, averaged over the MoE (or dense) layers (sliding windows)."""
    layers = [i for i in range(cfg.num_layers) if cfg.is_moe(i) == moe]
    if not layers:
        return 0.0
    windows = [cfg.sliding_window if cfg.layer_types and cfg.layer_types[i] == "sliding" else None for i in layers]
    return sum(causal_pairs(seq_len, w) for w in windows) / len(windows)


def _attention_work(cfg: ModelConfig, seq_len: int, moe: bool) -> float:
    """y of Eq. 1 per sequence, with causal pairs instead of S^2: pairs x heads x (d_qk + d_v)."""
    d_qk, d_v = _head_dims(cfg)
    return _mean_pairs(cfg, seq_len, moe) * cfg.num_heads * (d_qk + d_v)


def _attention_core_seconds(cfg: ModelConfig, profile: Profile, m_a: float, seq_len: int, moe: bool = True) -> float:
    """Scores and values of m_a sequences (t_attn): 2 y FLOPs; q, k, v and the output read or written once."""
    d_qk, d_v = _head_dims(cfg)
    kv_heads = cfg.num_heads if cfg.attention == "mla" else cfg.num_kv_heads  # moejax prefills MLA expanded
    nbytes = m_a * seq_len * (cfg.num_heads * (d_qk + d_v) + kv_heads * (d_qk + d_v)) * profile.dtype_bytes
    return profile.device.op_time(2 * m_a * _attention_work(cfg, seq_len, moe), nbytes, "attention",
                                  m_a * seq_len * seq_len)


def attention_seconds(cfg: ModelConfig, profile: Profile, m_a: float, seq_len: int) -> float:
    """t_a (Eq. 1): a MoE layer's attention segment (projections, router, attention) for m_a sequences."""
    return _gemms_seconds(profile, _moe_gemms(cfg), m_a * seq_len) + _attention_core_seconds(cfg, profile, m_a,
                                                                                              seq_len)


def shared_seconds(cfg: ModelConfig, profile: Profile, m_a: float, seq_len: int) -> float:
    """t_s (Eq. 2): the shared expert for m_a sequences (0 without one)."""
    return _gemms_seconds(profile, _shared_gemms(cfg), m_a * seq_len)


def dense_seconds(cfg: ModelConfig, profile: Profile, m_a: float, seq_len: int) -> float:
    """t_d: a dense layer (attention + MLP) for m_a sequences, on the attention group."""
    return _gemms_seconds(profile, _dense_gemms(cfg), m_a * seq_len) + _attention_core_seconds(
        cfg, profile, m_a, seq_len, moe=False)


def experts_seconds(cfg: ModelConfig, profile: Profile, m_e: float, expert_devices: int,
                    route: str = A2E_DEFAULT) -> float:
    """t_e (Eq. 3): one expert device's E/B experts over the rows it runs, m_e E (every (token, choice) row of the
    chunk; module docstring), through the fused gate-up and the down grouped GEMMs, reading every local expert's
    weights once per chunk; under regroup also the expert group's two all-to-alls (`regroup_all_to_all_seconds`)."""
    D, I, b = cfg.hidden_size, cfg.moe_intermediate_size, profile.dtype_bytes
    local = cfg.num_experts / expert_devices
    rows = m_e * cfg.num_experts
    out = 0.0
    for k, n in ((D, 2 * I), (I, D)):
        out += profile.device.op_time(2 * rows * k * n, (local * k * n + rows * (k + n)) * b, "grouped", rows / local)
    return out + (regroup_all_to_all_seconds(cfg, profile, m_e, expert_devices) if route == "regroup" else 0.0)


def regroup_all_to_all_seconds(cfg: ModelConfig, profile: Profile, m_e: float, expert_devices: int) -> float:
    """The regroup route's exchange inside the expert group (moejax.sharding.experts, exchange=all_to_all): each
    device's n = rows / B tokens as dropless buffers of B x n k rows, (B-1)/B of them sent there (hidden state, local
    expert id, row flag) and back (outputs)."""
    B = expert_devices
    if B < 2:
        return 0.0
    sent_rows = (B - 1) / B * B * chunk_rows(cfg, m_e) / B * cfg.num_experts_per_tok
    there = sent_rows * (cfg.hidden_size * profile.dtype_bytes + ROUTING_BYTES)
    return profile.all_to_all.time(there) + profile.all_to_all.time(sent_rows * cfg.hidden_size * profile.dtype_bytes)


def chunk_rows(cfg: ModelConfig, m_e: float) -> float:
    """Rows (tokens) of a chunk with m_e rows per expert: m_e E / k."""
    return m_e * cfg.num_experts / cfg.num_experts_per_tok


def transfer_bytes_per_device(cfg: ModelConfig, profile: Profile, m_e: float, expert_devices: int,
                              route: str = A2E_DEFAULT) -> float:
    """z of Eq. 4 in bytes, the hidden states one expert device receives for a chunk (Eq. 4's m_e E M / B elements
    counts each token k times): regroup its 1/B of the chunk's rows, once each; straight the whole chunk (module
    docstring). As many go back. The routing (k ids and weights per row) is left out, as in Eq. 4."""
    rows = chunk_rows(cfg, m_e)
    return rows * cfg.hidden_size * profile.dtype_bytes / (expert_devices if route == "regroup" else 1)


def transfer_seconds(cfg: ModelConfig, profile: Profile, m_e: float, attn_devices: int, expert_devices: int,
                     route: str = A2E_DEFAULT) -> float:
    """t_a2e = t_e2a (Eq. 4): one chunk between the groups over its busiest port (`_transfer_seconds_of_bytes`)."""
    z = transfer_bytes_per_device(cfg, profile, m_e, expert_devices, route)
    return _transfer_seconds_of_bytes(profile, z, attn_devices, expert_devices, route)


def _transfer_seconds_of_bytes(profile: Profile, z: float, attn_devices: int, expert_devices: int,
                               route: str = A2E_DEFAULT) -> float:
    """z bytes per expert device. regroup: A senders and B receivers share the chunk's z B bytes, so the busiest port
    moves z B / min(A, B); straight: each attention device sends its 1/A of the chunk to all B, z B / A, each
    expert device receives z: the busiest moves z max(1, B / A)."""
    link = profile.link_between(attn_devices + expert_devices)
    A, B = attn_devices, expert_devices
    return link.time(z * (B / min(A, B) if route == "regroup" else max(1.0, B / A)))


# -- 2. α-β fits (Eq. 7-11) ----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class LineFit:
    """t(x) = alpha + beta x, fitted on sampled sizes; r_squared of the fit on those samples."""
    name: str
    unit: str
    alpha: float
    beta: float
    r_squared: float

    def __call__(self, x: float) -> float:
        return self.alpha + self.beta * x


def fit_line(name: str, unit: str, xs: Iterable[float], ys: Iterable[float]) -> LineFit:
    """Least squares in relative error (the sizes span orders of magnitude, and the small ones, where α dominates,
    decide r2), with α, β >= 0 (a negative launch cost would let the solver split without end)."""
    pts = [(float(x), float(y)) for x, y in zip(xs, ys, strict=True) if y > 0]
    if not pts:
        return LineFit(name, unit, 0.0, 0.0, 1.0)
    w = [1.0 / (y * y) for _, y in pts]
    sw = sum(w)
    sx = sum(wi * x for wi, (x, _) in zip(w, pts, strict=True))
    sy = sum(wi * y for wi, (_, y) in zip(w, pts, strict=True))
    sxx = sum(wi * x * x for wi, (x, _) in zip(w, pts, strict=True))
    sxy = sum(wi * x * y for wi, (x, y) in zip(w, pts, strict=True))
    det = sw * sxx - sx * sx
    beta = (sw * sxy - sx * sy) / det if det > 1e-12 * sw * sxx else 0.0
    alpha = (sy - beta * sx) / sw
    if alpha < 0:  # through the origin
        alpha, beta = 0.0, sxy / sxx
    if beta < 0:
        alpha, beta = sy / sw, 0.0
    mean = sum(y for _, y in pts) / len(pts)
    total = sum((y - mean) ** 2 for _, y in pts)
    resid = sum((y - alpha - beta * x) ** 2 for x, y in pts)
    return LineFit(name, unit, alpha, beta, 1.0 - resid / total if total > 0 else 1.0)


@dataclasses.dataclass(frozen=True)
class DepCoefficients:
    """The affine task times of one (A, B, S), seconds: t_a = alpha_a + beta_a m_a, t_s, t_d likewise in m_a;
    t_e = alpha_e + beta_e m_e; t_a2e = t_e2a = alpha_c + beta_c m_e (the paper's α_a2e, β_a2e). `fits`: the
    primitive least-squares lines they were derived from (empty when the coefficients were given, as in tests)."""
    attn_devices: int
    expert_devices: int
    seq_len: int
    alpha_a: float
    beta_a: float
    alpha_s: float
    beta_s: float
    alpha_e: float
    beta_e: float
    alpha_c: float
    beta_c: float
    alpha_d: float = 0.0
    beta_d: float = 0.0
    fits: tuple[LineFit, ...] = ()
    source: str = "roofline"  # or "measured": from the profile's DEP task fits of this split

    def task_times(self, m_a: float, m_e: float) -> TaskTimes:
        c = self.alpha_c + self.beta_c * m_e
        return TaskTimes(attention=self.alpha_a + self.beta_a * m_a,
                         shared=self.alpha_s + self.beta_s * m_a,
                         experts=self.alpha_e + self.beta_e * m_e, a2e=c, e2a=c,
                         dense=self.alpha_d + self.beta_d * m_a)

    def as_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "fits"}
        out["fits"] = [dataclasses.asdict(f) for f in self.fits]
        return out


def _geometric(lo: float, hi: float, n: int = _FIT_POINTS, integer: bool = False) -> list[float]:
    lo, hi = max(lo, 1e-9), max(hi, lo)
    pts = [lo * (hi / lo) ** (i / (n - 1)) for i in range(n)]
    return sorted({max(1, round(p)) for p in pts}) if integer else pts


@dataclasses.dataclass(frozen=True)
class _AttentionFits:
    """The attention group's fits, the same for every split (they depend on S and the m_a range only)."""
    gemm_a: LineFit
    gemm_s: LineFit
    gemm_d: LineFit
    attn: LineFit
    attn_d: LineFit
    x_a: float  # GEMM work (m k n) per sequence of each task
    x_s: float
    x_d: float
    y: float  # attention work per sequence (MoE layers, dense layers)
    y_d: float


def _fit_attention_group(cfg: ModelConfig, profile: Profile, seq_len: int, max_m_a: int) -> _AttentionFits:
    S = seq_len
    grid = _geometric(1, max(max_m_a, 2), integer=True)

    def gemm_fit(name: str, gemms: list[tuple[int, int]]) -> tuple[int, LineFit]:
        x1 = sum(S * k * n for k, n in gemms)
        return x1, fit_line(name, "m k n", [m * x1 for m in grid],
                            [_gemms_seconds(profile, gemms, m * S) if gemms else 0.0 for m in grid])

    x_a, gemm_a = gemm_fit("t_gm (attention projections + router)", _moe_gemms(cfg))
    x_s, gemm_s = gemm_fit("t_gm (shared expert)", _shared_gemms(cfg))
    has_dense = not all(cfg.moe_layers)
    x_d, gemm_d = gemm_fit("t_gm (dense layer)", _dense_gemms(cfg) if has_dense else [])
    y, y_d = _attention_work(cfg, S, True), _attention_work(cfg, S, False)
    attn = fit_line("t_attn (MoE layers)", "pairs x heads x (d_qk + d_v)", [m * y for m in grid],
                    [_attention_core_seconds(cfg, profile, m, S) for m in grid])
    attn_d = fit_line("t_attn (dense layers)", "pairs x heads x (d_qk + d_v)", [m * y_d for m in grid],
                      [_attention_core_seconds(cfg, profile, m, S, moe=False) if has_dense else 0.0 for m in grid])
    return _AttentionFits(gemm_a, gemm_s, gemm_d, attn, attn_d, x_a, x_s, x_d, y, y_d)


def fit_coefficients(cfg: ModelConfig, profile: Profile, *, attn_devices: int, expert_devices: int, seq_len: int,
                     max_m_a: int = 64, _ag: _AttentionFits | None = None) -> DepCoefficients:
    """α-β of every task for (A, B, S): the profile's measured DEP task fits of the split where it has them
    (measured_coefficients), else fitted on the roofline at sampled sizes: m_a in [1, max_m_a], m_e over the
    range the planner meets (one sequence per attention device cut into R2_MAX chunks, up to a whole micro-batch
    of max_m_a). `_ag`: the attention group's fits, when already made (they do not depend on A or B)."""
    A, B, E, k = attn_devices, expert_devices, cfg.num_experts, cfg.num_experts_per_tok
    measured = profile.dep_fits(A, B)
    if measured is not None:
        return measured_coefficients(cfg, profile, measured, seq_len)
    ag = _ag or _fit_attention_group(cfg, profile, seq_len, max_m_a)
    m_e_hi = A * max_m_a * seq_len * k / E
    m_e_grid = _geometric(min(1.0, m_e_hi), m_e_hi)
    m_e_grid = sorted(set(m_e_grid) | set(_geometric(A * seq_len * k / E / R2_MAX, m_e_hi)))
    experts = fit_line("t_e (grouped expert GEMMs, one expert device)", "rows per expert", m_e_grid,
                       [experts_seconds(cfg, profile, m, B) for m in m_e_grid])
    zs = [transfer_bytes_per_device(cfg, profile, m, B) for m in m_e_grid]
    comm = fit_line(f"t_c (A2E/E2A, A={A}, B={B})", "bytes per expert device (z)", zs,
                    [_transfer_seconds_of_bytes(profile, z, A, B) for z in zs])
    z_per_row = transfer_bytes_per_device(cfg, profile, 1.0, B)
    return DepCoefficients(
        attn_devices=A, expert_devices=B, seq_len=seq_len,
        alpha_a=ag.gemm_a.alpha + ag.attn.alpha, beta_a=ag.gemm_a.beta * ag.x_a + ag.attn.beta * ag.y,  # Eq. 10-11
        alpha_s=ag.gemm_s.alpha, beta_s=ag.gemm_s.beta * ag.x_s,
        alpha_e=experts.alpha, beta_e=experts.beta,
        alpha_c=comm.alpha, beta_c=comm.beta * z_per_row,
        alpha_d=ag.gemm_d.alpha + ag.attn_d.alpha, beta_d=ag.gemm_d.beta * ag.x_d + ag.attn_d.beta * ag.y_d,
        fits=(ag.gemm_a, ag.attn, ag.gemm_s, ag.gemm_d, ag.attn_d, experts, comm))


# -- 3. α-β of the tasks measured on the devices (`launch.profile --dep`, moejax.measure.dep) ----------------------

def attention_work(cfg: ModelConfig, tokens: float, sequences: float, seq_len: int) -> tuple[float, float]:
    """(x, y) of Eq. 10-11 for one attention device's MoE-layer attention segment: the projections' and router's
    m k n over `tokens`, and the causal attention work of `sequences` sequences of seq_len."""
    return tokens * sum(k * n for k, n in _moe_gemms(cfg)), sequences * _attention_work(cfg, seq_len, True)


def shared_work(cfg: ModelConfig, tokens: float) -> float:
    return tokens * sum(k * n for k, n in _shared_gemms(cfg))


def expert_row_work(cfg: ModelConfig) -> float:
    """m k n of one row through one expert (the fused gate-up and the down GEMM)."""
    D, I = cfg.hidden_size, cfg.moe_intermediate_size
    return D * 2 * I + I * D


def expert_device_rows(cfg: ModelConfig, chunk_rows_: float) -> float:
    """Rows one expert device runs for a chunk: every row's k choices (module docstring)."""
    return chunk_rows_ * cfg.num_experts_per_tok


def a2e_bytes(cfg: ModelConfig, chunk_rows_: float, dtype_bytes: int, expert_devices: int,
              route: str = A2E_DEFAULT) -> float:
    """Bytes one expert device receives for a chunk: hidden states and routing of its 1/B of the rows (regroup) or
    of every row (straight)."""
    share = 1 / expert_devices if route == "regroup" else 1.0
    return share * chunk_rows_ * (cfg.hidden_size * dtype_bytes + cfg.num_experts_per_tok * ROUTING_BYTES)


def e2a_bytes(cfg: ModelConfig, chunk_rows_: float, dtype_bytes: int, expert_devices: int,
              route: str = A2E_DEFAULT) -> float:
    """Bytes one expert device sends back for a chunk: the outputs of its 1/B of the rows (regroup) or its partial
    output of every row (straight)."""
    share = 1 / expert_devices if route == "regroup" else 1.0
    return share * chunk_rows_ * cfg.hidden_size * dtype_bytes


def fit_affine(xs: Sequence[Sequence[float]], ys: Sequence[float]) -> tuple[float, ...]:
    """Least squares of y = c0 + c1 x1 + c2 x2 + ... in relative error (as fit_line), every coefficient >= 0: a
    term whose coefficient comes out negative is dropped and the others refitted. ValueError on no points."""
    X = np.array([[1.0, *map(float, x)] for x in xs])
    y = np.array([float(v) for v in ys])
    if not len(y):
        raise ValueError("fit_affine: no measured points")
    w = 1.0 / np.maximum(y, 1e-30)
    active = list(range(X.shape[1]))
    coef = np.zeros(X.shape[1])
    while active:
        sol = np.linalg.lstsq(X[:, active] * w[:, None], y * w, rcond=None)[0]
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return tuple(float(c) for c in coef)


Point = tuple  # (task, work units..., seconds), DepTaskFits.points


def fit_dep_tasks(points: Sequence[Point], *, attn_devices: int, expert_devices: int, model: str = "",
                  a2e: str = A2E_DEFAULT) -> DepTaskFits:
    """DepTaskFits of one split from measured points: ("attention", x, y, s), ("shared", x_s, s), ("experts", w, s),
    ("a2e", z, s), ("e2a", z, s) (units in DepTaskFits). A2E and E2A share one line (Eq. 9: reverse processes of
    one structure). A task without points (no shared expert) gets 0, 0."""
    def of(*tasks: str) -> tuple[list, list]:
        rows = [p for p in points if p[0] in tasks]
        return [p[1:-1] for p in rows], [p[-1] for p in rows]

    def fit(*tasks: str, terms: int) -> tuple[float, ...]:
        xs, ys = of(*tasks)
        return fit_affine(xs, ys) if ys else (0.0,) * (terms + 1)
    alpha_a, beta_gm, beta_attn = fit("attention", terms=2)
    alpha_s, beta_s = fit("shared", terms=1)
    alpha_e, beta_e = fit("experts", terms=1)
    alpha_c, beta_c = fit("a2e", "e2a", terms=1)
    return DepTaskFits(attn_devices, expert_devices, alpha_a, beta_gm, beta_attn, alpha_s, beta_s, alpha_e, beta_e,
                       alpha_c, beta_c, model=model, a2e=a2e, points=tuple(tuple(p) for p in points))


def predict_point(fits: DepTaskFits, point: Point) -> float:
    """The fitted seconds at a measured point's work units."""
    task, *units, _ = point
    if task == "attention":
        return fits.alpha_a + fits.beta_gm * units[0] + fits.beta_attn * units[1]
    alpha, beta = {"shared": (fits.alpha_s, fits.beta_s), "experts": (fits.alpha_e, fits.beta_e),
                   "a2e": (fits.alpha_c, fits.beta_c), "e2a": (fits.alpha_c, fits.beta_c)}[task]
    return alpha + beta * units[0]


def measured_coefficients(cfg: ModelConfig, profile: Profile, fits: DepTaskFits, seq_len: int) -> DepCoefficients:
    """DepCoefficients of the split from its measured fits at sequence length S (Eq. 10-11 with the measured
    β_gm, β_attn): t_a per sequence per attention device, t_e and t_c per m_e (a chunk of m_e E / k rows)."""
    S, b = seq_len, profile.dtype_bytes
    x1, y1 = attention_work(cfg, S, 1, S)
    has_dense = not all(cfg.moe_layers)
    rows = chunk_rows(cfg, 1.0)  # per unit of m_e
    B, route = fits.expert_devices, fits.a2e or A2E_DEFAULT
    z = (a2e_bytes(cfg, rows, b, B, route) + e2a_bytes(cfg, rows, b, B, route)) / 2  # one t_c both ways: the mean
    return DepCoefficients(
        attn_devices=fits.attn_devices, expert_devices=fits.expert_devices, seq_len=S,
        alpha_a=fits.alpha_a, beta_a=fits.beta_gm * x1 + fits.beta_attn * y1,
        alpha_s=fits.alpha_s if cfg.shared_expert_size else 0.0, beta_s=fits.beta_s * shared_work(cfg, S),
        alpha_e=fits.alpha_e, beta_e=fits.beta_e * expert_device_rows(cfg, rows) * expert_row_work(cfg),
        alpha_c=fits.alpha_c, beta_c=fits.beta_c * z,
        alpha_d=fits.alpha_a if has_dense else 0.0,
        beta_d=(fits.beta_gm * S * sum(k * n for k, n in _dense_gemms(cfg)) + fits.beta_attn *
                _attention_work(cfg, S, False)) if has_dense else 0.0,
        source="measured")
