"""MoE-Lightning's performance model and policy search (Cao et al., ASPLOS '25, §4.2, App. B) as pure functions.

The roofs, turning points and operational intensities are in moejax.plan.hrm (Eqs. 4-11). Here, per layer, with
nb = N / μ micro-batches (one kernel each), average decode context c = s + n/2 and `dt` bytes per element:

Latency (Eqs. 12-14; CGOPipe overlaps the link, the CPU and the GPU, so a layer takes the slowest of the three):
    decode   T = max(comm_cpu->gpu, T_cpu, T_gpu)                                          (12)
             T_gpu = A_g T^g_attn + F_g T^g_ffn,  T_cpu = (1-A_g) T^c_attn + (1-F_g) T^c_ffn    (13)
             T^x_op = nb max(flops_op(μ) / p_x, bytes_op(μ) / b_x)                           (14)
             comm = [F_g (1-r_w) W_e + A_g (1-r_c) N c kv + (2 - A_g - F_g) N h1 dt] / b_cg
               (expert pages of the offloaded share; the KV that GPU attention swaps in; hidden states coming
               back from each CPU stage. QKV going to the CPU uses the other direction and is not modelled.)
    prefill  all on the GPU, KV written back to the CPU (§4 fn. 7), the artifact's terms:
             T = max([(1-r_w) W_e + dt N s h1] / b_cg, nb (T^g_attn(μ prompts of s) + T^g_ffn(μ s tokens)))
    throughput = N n / (l (T_prefill + (n-1) T_decode)): generated tokens over prefill + decode time, the paper's
    metric (L412). The artifact ranks by decode alone (N n / (l (n-1) T_decode)); `decode_tokens_per_s` is that.

Memory (the artifact's optimizer, fastmoe/backend/optimizer.py; tp = gpus, KV_all = kv (s+n) N l):
    GPU decode   G_d = W_o + r_w W_e l + 2 dt h1 N tp + (r_c + (1-r_c) A_g) KV_all
    GPU prefill  G_p = W_o + r_w W_e l + r_c kv s N + tp dt (2 h1 μ s + h1 N s) + 2 (1-r_c) kv s μ
    workspace    G_w = 2 (1-r_w) W_e + 1.2 dt (μ k h1 tp s + 3 μ k h2 s)   (paged-weight double buffer, fused MoE)
    GPU:  max(G_d, G_p) + G_w <= 0.86 m_g
    CPU:  (1-r_w) W_e l + (1-r_c) KV_all + tp dt h1 N s + 2 (1-r_w) W_e <= 0.8 m_c   (+ the pinned page buffer)
    With A_g = 1 the artifact keeps the whole cache in HBM during decode (r_c only moves the prefill peak and the
    host copy), so GPU attention frees GPU memory only by offloading weights: the trade-off behind Fig. 10. moejax's
    executor keeps the r_c share there and swaps the rest in a layer at a time (moejax.lightning.kv_swap): it
    needs no more than the model counts. With A_g = 0 the KV lives on the CPU: r_c = 0.

Where this differs from the artifact, and why:
- Decode attention is timed at the average context s + n/2 (throughput over the generation; the artifact uses
  s + n there and s + n/2 for the KV it moves); FLOPs follow moejax.costs (2(d_qk + d_v) a key, the artifact
  counts only QK^T); an FFN kernel of μ tokens reads the E(1 - (1-k/E)^μ) experts they touch, not all E.
- Sliding-window layers are timed and sized at the full context (the artifact's models have none).
- W_o counts every non-expert parameter (embeddings and head too, moejax keeps them on the device).
- F_g = 0 (the FFN on the CPU, where the experts live: r_w = 0) and A_g = 1 are in the search space, as in the
  paper's Table 1; the artifact's runtime optimizer fixes A_g = 0, F_g = 1.

Search. For each (A_g, F_g) and each (μ, N = nb μ) the ratios (r_w, r_c) solve an LP: minimise
T_prefill + (n-1) T_decode (a sum of maxima of functions linear in r_w, r_c) under the memory limits. It is solved
exactly: the minimum of a convex piecewise-linear function on a polygon lies at a vertex of the arrangement of the
constraint lines and the lines where two terms of a max are equal, so we evaluate every pairwise intersection of
those lines (at most 45; where a ratio is fixed, each line at that value) and keep the best feasible one (ties: the
most weights, then KV, left on the GPU; checked against scipy's HiGHS on random instances while writing it). μ and
nb run over a ladder (every integer to 16, then steps of 10%), refined to single integers around the best;
numpy-vectorised over the whole grid, well under a second.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import time

import numpy as np

from moejax.config import ModelConfig
from moejax.plan.hardware import Profile
from moejax.plan.hrm import Hardware, ModelShape, RooflineData, plot_roofline, roofline_data

__all__ = ["LightningPolicy", "LayerTimes", "search_policy", "policy_roofline", "plot_roofline", "roofline_data",
           "Hardware", "ModelShape", "RooflineData"]

GPU_USABLE = 0.86  # the artifact's share of GPU memory a policy may use (the rest: CUDA context, fragmentation)
CPU_USABLE = 0.8
WORKSPACE = 1.2  # the artifact's slack on the fused-MoE kernel's intermediate buffers
STEP = 1.1  # the coarse ladder's ratio


@dataclasses.dataclass(frozen=True)
class LayerTimes:
    """One layer's time on each resource (seconds) and the slowest, which the pipeline runs at (Eq. 12)."""
    comm_s: float  # CPU -> GPU link
    cpu_s: float
    gpu_s: float
    gpu_attn_s: float = 0.0
    gpu_ffn_s: float = 0.0
    cpu_attn_s: float = 0.0
    cpu_ffn_s: float = 0.0

    @property
    def total_s(self) -> float:
        return max(self.comm_s, self.cpu_s, self.gpu_s)

    @property
    def bound(self) -> str:
        return max((self.comm_s, "CPU->GPU link"), (self.cpu_s, "CPU"), (self.gpu_s, "GPU"))[1]


@dataclasses.dataclass(frozen=True)
class LightningPolicy:
    """A MoE-Lightning policy (N, μ, A_g, F_g, r_w, r_c) with the model's predictions behind it."""
    N: int
    mu: int
    A_g: int  # attention on the GPU (1) or the CPU (0)
    F_g: int  # MoE FFN on the GPU (1) or the CPU (0)
    r_w: float  # share of the routed experts kept on the GPU; 1 - r_w is paged in each layer
    r_c: float  # share of the KV cache kept on the GPU
    predicted_tokens_per_s: float  # generated tokens / (prefill + decode time)
    decode_tokens_per_s: float
    solve_ms: float
    prefill: LayerTimes
    decode: LayerTimes
    gpu_memory_bytes: float
    gpu_memory_limit: float
    cpu_memory_bytes: float
    cpu_memory_limit: float
    executable: bool
    note: str
    label: str = "best"
    model: str = ""
    hardware: str = ""
    gpus: int = 1
    prompt_len: int = 0
    gen_len: int = 0
    operating_points: tuple = ()  # (label, operational intensity, FLOP/s) for plot_roofline
    alternatives: tuple = ()  # runner-up LightningPolicy objects

    @property
    def bound(self) -> str:
        return self.decode.bound

    def describe(self) -> str:
        gib = 2**30
        lines = [
            f"MoE-Lightning policy for {self.model} on {self.hardware} (prompt {self.prompt_len}, gen {self.gen_len})",
            f"  N={self.N} mu={self.mu} ({self.N // self.mu} micro-batches)  A_g={self.A_g} F_g={self.F_g}  "
            f"r_w={self.r_w:.3f} r_c={self.r_c:.3f}",
            f"  predicted {self.predicted_tokens_per_s:.1f} tok/s (decode alone {self.decode_tokens_per_s:.1f}); "
            f"decode bound by the {self.bound}",
            f"  per layer, decode: link {self.decode.comm_s * 1e3:.1f} ms, CPU {self.decode.cpu_s * 1e3:.1f} ms, "
            f"GPU {self.decode.gpu_s * 1e3:.1f} ms; prefill: link {self.prefill.comm_s * 1e3:.1f} ms, "
            f"GPU {self.prefill.gpu_s * 1e3:.1f} ms",
            f"  memory: GPU {self.gpu_memory_bytes / gib:.2f} of {self.gpu_memory_limit / gib:.2f} GiB usable, "
            f"CPU {self.cpu_memory_bytes / gib:.1f} of {self.cpu_memory_limit / gib:.1f} GiB usable",
            f"  executable in moejax: {'yes' if self.executable else 'no'}: {self.note}",
            f"  solved in {self.solve_ms:.0f} ms"]
        for alt in self.alternatives:
            lines.append(f"  alternative, {alt.label}: N={alt.N} mu={alt.mu} A_g={alt.A_g} F_g={alt.F_g} "
                         f"r_w={alt.r_w:.3f} r_c={alt.r_c:.3f}: {alt.predicted_tokens_per_s:.1f} tok/s"
                         f" ({alt.bound}-bound)")
        return "\n".join(lines)

    def as_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in ("prefill", "decode", "alternatives", "operating_points")}
        for name in ("prefill", "decode"):
            t = getattr(self, name)
            out[name] = {**dataclasses.asdict(t), "total_s": t.total_s, "bound": t.bound}
        out["bound"] = self.bound
        out["operating_points"] = [{"label": a, "intensity": i, "flops_per_s": p}
                                   for a, i, p in self.operating_points]
        out["alternatives"] = [{k: v for k, v in a.as_dict().items() if k != "alternatives"}
                               for a in self.alternatives]
        return out


# -- the model, vectorised over a grid of (μ, N, A_g, F_g) --------------------------------------------------------

Grid = float | np.ndarray  # a scalar, or its values over the grid
Form = tuple[Grid, Grid, Grid]  # a linear form (c0, c_w, c_c) in (r_w, r_c)
Variant = tuple[str, int, int, tuple[int, int], int]  # (label, A_g, F_g, r_w range, lowest r_c): VARIANTS
Found = tuple[float, int, int, float, float]  # a variant's best grid point: (throughput, μ, nb, r_w, r_c)


def _terms(m: ModelShape, hw: Hardware, s: int, n: int, mu: Grid, N: Grid, A_g: Grid, F_g: Grid) -> dict:
    """Every time and memory term, as constants or as linear forms (c0, c_w, c_c) in (r_w, r_c)."""
    mu, N, A_g, F_g = (np.asarray(x, float) for x in (mu, N, A_g, F_g))
    nb, c, tp, dt, l = N / mu, s + n / 2, hw.tp, m.dt, m.l

    def op(flops, nbytes, p, b):  # Eq. 14 over nb micro-batches
        return nb * np.maximum(flops / p, nbytes / b)
    t = {"gpu_attn": op(m.attn_flops(mu, c), m.attn_bytes(mu, c), hw.p_g, hw.b_g),
         "cpu_attn": op(m.attn_flops(mu, c), m.attn_bytes(mu, c), hw.p_c, hw.b_c),
         "gpu_ffn": op(m.ffn_flops(mu), m.ffn_bytes(mu), hw.p_g, hw.b_g),
         "cpu_ffn": op(m.ffn_flops(mu), m.ffn_bytes(mu), hw.p_c, hw.b_c)}
    t["gpu"] = A_g * t["gpu_attn"] + F_g * t["gpu_ffn"]  # Eq. 13
    t["cpu"] = (1 - A_g) * t["cpu_attn"] + (1 - F_g) * t["cpu_ffn"]
    kv_moved = A_g * N * c * m.kv_token
    t["comm"] = ((F_g * m.W_e + kv_moved + (2 - A_g - F_g) * N * m.h1 * dt) / hw.b_cg, -F_g * m.W_e / hw.b_cg,
                 -kv_moved / hw.b_cg)
    # prefill: everything on the GPU, the offloaded experts paged in, the batch's hidden states brought over
    t["p_gpu_attn"] = op(m.prefill_attn_flops(mu, s), m.prefill_attn_bytes(mu, s), hw.p_g, hw.b_g)
    t["p_gpu_ffn"] = op(m.ffn_flops(mu * s), m.ffn_bytes(mu * s), hw.p_g, hw.b_g)
    t["p_gpu"] = t["p_gpu_attn"] + t["p_gpu_ffn"]
    t["p_comm"] = ((m.W_e + dt * N * s * m.h1) / hw.b_cg, -m.W_e / hw.b_cg + 0 * N, 0 * N)
    # memory (module docstring), as forms <= 0 after the caps are subtracted
    kv_all = m.kv_token * (s + n) * N * m.l
    resident_w = m.W_e * m.l - 2 * m.W_e  # r_w moves a layer share into HBM and out of the page buffer
    inter = WORKSPACE * dt * (mu * m.k * m.h1 * tp * s + 3 * mu * m.k * m.h2 * s)
    base = m.W_o + 2 * m.W_e + inter
    # the artifact's r_c + (1 - r_c) A_g: GPU attention holds the whole cache in HBM during decode (module docstring)
    t["gpu_d"] = (base + 2 * dt * m.h1 * N * tp + A_g * kv_all, resident_w + 0 * N, (1 - A_g) * kv_all)
    p_kv = m.kv_token * s
    t["gpu_p"] = (base + tp * dt * (2 * m.h1 * mu * s + m.h1 * N * s) + 2 * p_kv * mu, resident_w + 0 * N,
                  p_kv * N - 2 * p_kv * mu)
    t["cpu_m"] = (m.W_e * l + kv_all + tp * dt * m.h1 * N * s + 2 * m.W_e, -m.W_e * (l + 2) + 0 * N, -kv_all)
    return t


def _value(form, r_w, r_c):
    return form[0] + form[1] * r_w + form[2] * r_c


def _const(x):
    return (x, 0 * x, 0 * x)


def _varies(form: Form) -> bool:
    return bool(np.any(form[1]) or np.any(form[2]))


def _vertices(lines, rw_lo, rw_hi, rc_lo, rc_hi):
    """Candidate vertices: pairwise intersections of the lines a r_w + b r_c = c (rows 0, 1, 2 = -c, a, b), or,
    where a ratio is fixed, each line met at that value."""
    c, a, b = -lines[:, 0], lines[:, 1], lines[:, 2]
    if rw_lo == rw_hi and rc_lo == rc_hi:
        return np.full(a[:1].shape, float(rw_lo)), np.full(a[:1].shape, float(rc_lo)), np.ones(a[:1].shape, bool)
    if rc_lo == rc_hi or rw_lo == rw_hi:
        (fixed, coef, free), value = ((b, a, "w"), rc_lo) if rc_lo == rc_hi else ((a, b, "c"), rw_lo)
        ok = np.abs(coef) > 1e-12
        x = (c - fixed * value) / np.where(ok, coef, 1.0)
        y = np.full(x.shape, float(value))
        return (x, y, ok) if free == "w" else (y, x, ok)
    i, j = np.triu_indices(len(lines), 1)
    det = a[i] * b[j] - a[j] * b[i]
    ok = np.abs(det) > 1e-12
    det = np.where(ok, det, 1.0)
    return (c[i] * b[j] - c[j] * b[i]) / det, (a[i] * c[j] - a[j] * c[i]) / det, ok


def _solve_ratios(t: dict, n: int, caps: tuple[float, float], rw_lo: float, rw_hi: float, rc_lo: float,
                  rc_hi: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The exact LP over (r_w, r_c) at every grid point (module docstring). Returns r_w, r_c, the per-layer time
    T_prefill + (n-1) T_decode (inf where nothing fits)."""
    one = np.ones_like(t["gpu"])
    cons = [(-rw_hi * one, one, 0 * one), (rw_lo * one, -one, 0 * one),  # rw_lo <= r_w <= rw_hi
            (-rc_hi * one, 0 * one, one), (rc_lo * one, 0 * one, -one),
            (t["gpu_d"][0] - caps[0], t["gpu_d"][1], t["gpu_d"][2]),
            (t["gpu_p"][0] - caps[0], t["gpu_p"][1], t["gpu_p"][2]),
            (t["cpu_m"][0] - caps[1], t["cpu_m"][1], t["cpu_m"][2])]
    groups = [(n - 1, [t["comm"], _const(t["cpu"]), _const(t["gpu"])]), (1, [t["p_comm"], _const(t["p_gpu"])])]
    kinks = [tuple(a - b for a, b in zip(f, g, strict=True))
             for _, forms in groups for f, g in itertools.combinations(forms, 2)
             if _varies(f) or _varies(g)]  # two constants meet nowhere
    lines = np.array([[f[0] * one, f[1] * one, f[2] * one] for f in cons + kinks])  # [L, 3, G]
    lines /= np.maximum(np.abs(lines[:, 1:]).max(axis=1, keepdims=True), 1e-300)
    r_w, r_c, ok = _vertices(lines, rw_lo, rw_hi, rc_lo, rc_hi)  # [P, G] candidates
    for f in cons:
        scale = np.abs(f[0]) + np.abs(f[1]) + np.abs(f[2]) + 1e-300
        ok &= _value(f, r_w, r_c) <= 1e-9 * scale
    obj = sum(w * np.max([_value(f, r_w, r_c) for f in forms], axis=0) for w, forms in groups)
    obj = np.where(ok, obj, np.inf)
    best = obj.min(axis=0)
    near = ok & (obj <= best * (1 + 1e-9))  # ties: keep the most weights, then KV, on the GPU
    pick = np.argmax(np.where(near, r_w + 1e-6 * r_c, -np.inf), axis=0)
    cols = np.arange(obj.shape[1])
    return np.clip(r_w[pick, cols], 0, 1) + 0.0, np.clip(r_c[pick, cols], 0, 1) + 0.0, best  # + 0.0: no -0.0


# the searched variants: (label, A_g, F_g, r_w range, lowest r_c); the first four are the paper's space
VARIANTS = (("A_g=0, F_g=1", 0, 1, (0, 1), 0), ("A_g=1, F_g=1", 1, 1, (0, 1), 0),
            ("A_g=0, F_g=0", 0, 0, (0, 0), 0), ("A_g=1, F_g=0", 1, 0, (0, 0), 0),
            ("moejax streamed", 1, 1, (0, 0), 1), ("moejax resident", 1, 1, (1, 1), 1),
            ("r_w=0, CPU attention", 0, 1, (0, 0), 0), ("r_w=0, GPU attention", 1, 1, (0, 0), 0))


def _evaluate(m, hw, s, n, caps, variant, mus, nbs):
    _, A_g, F_g, (rw_lo, rw_hi), rc_lo = variant
    mus, nbs = np.asarray(mus, float), np.asarray(nbs, float)
    t = _terms(m, hw, s, n, mus, mus * nbs, A_g, F_g)
    with np.errstate(all="ignore"):  # far-off intersections of near-parallel lines overflow; they are infeasible
        r_w, r_c, per_layer = _solve_ratios(t, n, caps, rw_lo, rw_hi, rc_lo, A_g)
    return r_w, r_c, mus * nbs * n / (m.l * per_layer)


def _ladder(top: int) -> list[int]:
    """Every integer to 16, then steps of STEP, and `top`."""
    out, x = list(range(1, min(top, 16) + 1)), 16.0
    while x * STEP < top:
        x *= STEP
        out.append(int(round(x)))
    return sorted(set(out + [top]))


def _bounds(m: ModelShape, hw: Hardware, s: int, n: int, caps: tuple[float, float]) -> tuple[int, int]:
    """The largest μ (at N = μ) and N (at μ = 1) whose GPU memory fits with the least GPU-hungry ratios, and the
    CPU's own bound on N (the prompts' hidden states it holds)."""
    def fits(mu, N):
        t = _terms(m, hw, s, n, mu, N, 0, 1)
        return min(max(_value(t["gpu_d"], r, 0), _value(t["gpu_p"], r, 0)) for r in (0, 1)) <= caps[0]

    def largest(ok):
        if not ok(1):
            return 0
        hi = 1
        while ok(hi * 2) and hi < 2**24:
            hi *= 2
        lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if ok(mid) else (lo, mid)
        return lo
    cpu_N = int(caps[1] // max(hw.tp * m.dt * m.h1 * s, 1))
    return largest(lambda x: fits(x, x)), min(largest(lambda x: fits(1, x)), cpu_N)


def _around(x: int, ratio: float, top: int) -> list[int]:
    hi = max(1, min(top, int(math.ceil(x * ratio))))
    lo = max(1, min(hi, int(x / ratio)))
    return sorted(set(np.linspace(lo, hi, min(hi - lo + 1, 13)).round().astype(int).tolist()))


def _best(m, hw, s, n, caps, variant, mu_max, N_max):
    """(throughput, μ, nb, r_w, r_c) of the best grid point of a variant, refined to single integers; None if
    nothing fits."""
    pairs = [(mu, nb) for mu in _ladder(mu_max) for nb in _ladder(max(N_max // mu, 1))]
    ratio, best = STEP, None
    for _ in range(4):
        mus, nbs = np.array(pairs, float).T
        r_w, r_c, thr = _evaluate(m, hw, s, n, caps, variant, mus, nbs)
        k = int(np.argmax(thr))
        if np.isfinite(thr[k]) and thr[k] > 0 and (best is None or thr[k] > best[0]):
            best = (float(thr[k]), int(mus[k]), int(nbs[k]), float(r_w[k]), float(r_c[k]))
        if best is None or ratio < 1.0005:
            break
        mu0, nb0 = best[1], best[2]
        pairs = [(mu, nb) for mu in _around(mu0, ratio, mu_max) for nb in _around(nb0, ratio, max(N_max // mu, 1))]
        ratio = 1 + (ratio - 1) / 6
    return best


# -- the policy ---------------------------------------------------------------------------------------------------

def _note(A_g: int, F_g: int, r_w: float, r_c: float, N: int) -> tuple[bool, str]:
    swapped = A_g == 1 and r_c < 1 - 1e-6
    attention = (f"attention on the GPU over a KV cache {1 - r_c:.0%} on the host, swapped in per layer (FlexGen's "
                 "S4)" if swapped else "attention on the GPU" if A_g else "the KV cache on the host, attention there")
    if F_g == 0:
        return True, (f"placement 'lightning' with ffn_on='host' (the MoE FFN on the CPU over the experts in host "
                      f"memory, r_w = {r_w:.2f} of them resident on the GPU; {attention}) with batch {N}")
    if A_g == 0:
        return True, (f"placement 'lightning' (CGOPipe: {attention}, r_w = {r_w:.2f} of the experts resident, the "
                      f"rest paged) with batch {N}")
    if swapped:
        return True, (f"placement 'lightning' with attention_on='device' ({attention}; r_w = {r_w:.2f} of the "
                      f"experts resident, the rest paged) with batch {N}")
    if r_w > 1 - 1e-3:
        return True, f"placement 'resident' (every expert on the GPU) with batch {N}"
    if r_w < 1e-3:
        return True, f"placement 'streamed' with batch {N} (every layer's experts paged in, as r_w = 0 asks)"
    return True, (f"closest moejax placement: 'streamed' with batch {N}; it pages every layer's experts, so the "
                  f"static share r_w = {r_w:.2f} is streamed too (see the 'moejax streamed' alternative)")


def _policy(m: ModelShape, hw: Hardware, s: int, n: int, caps: tuple[float, float], variant: Variant, found: Found,
            solve_ms: float, cfg_name: str) -> LightningPolicy:
    label, A_g, F_g = variant[:3]
    _, mu, nb, r_w, r_c = found
    N = mu * nb
    t = _terms(m, hw, s, n, mu, N, A_g, F_g)
    f = {k: float(v) for k, v in t.items() if not isinstance(v, tuple)}
    dec = LayerTimes(float(_value(t["comm"], r_w, r_c)), f["cpu"], f["gpu"], A_g * f["gpu_attn"],
                     F_g * f["gpu_ffn"], (1 - A_g) * f["cpu_attn"], (1 - F_g) * f["cpu_ffn"])
    pre = LayerTimes(float(_value(t["p_comm"], r_w, r_c)), 0.0, f["p_gpu"], f["p_gpu_attn"], f["p_gpu_ffn"])
    gpu_mem = max(_value(t["gpu_d"], r_w, r_c), _value(t["gpu_p"], r_w, r_c))
    cpu_mem = float(_value(t["cpu_m"], r_w, r_c))
    executable, note = _note(A_g, F_g, r_w, r_c, N)
    return LightningPolicy(
        N=N, mu=mu, A_g=A_g, F_g=F_g, r_w=r_w, r_c=r_c,
        predicted_tokens_per_s=N * n / (m.l * (pre.total_s + (n - 1) * dec.total_s)),
        decode_tokens_per_s=N * n / (m.l * (n - 1) * dec.total_s), solve_ms=solve_ms, prefill=pre, decode=dec,
        gpu_memory_bytes=float(gpu_mem), gpu_memory_limit=GPU_USABLE * hw.m_g, cpu_memory_bytes=cpu_mem,
        cpu_memory_limit=CPU_USABLE * hw.m_c, executable=executable, note=note, label=label, model=cfg_name,
        hardware=hw.name, gpus=hw.tp, prompt_len=s, gen_len=n,
        operating_points=_operating_points(m, hw, s + n / 2, mu, N, A_g, F_g, r_w, dec))


def _operating_points(m: ModelShape, hw: Hardware, c: float, mu: int, N: int, A_g: int, F_g: int, r_w: float,
                      dec: LayerTimes) -> tuple:
    """Where the policy sits on the HRM plot: the FFN w.r.t. GPU memory (its kernel at μ) and w.r.t. CPU memory
    (the batch N over the paged experts, at the pipeline's rate), and decode attention where it runs."""
    pts = []
    if F_g:
        pts.append(("MoE FFN kernel (I^GPU at mu)", m.ffn_intensity_gpu(mu), m.ffn_flops(N) / dec.gpu_ffn_s))
        if r_w < 1:
            pts.append(("MoE FFN pipeline (I^CPU at N, r_w)", m.ffn_intensity_cpu(N, r_w),
                        m.ffn_flops(N) / dec.total_s))
    else:  # the same kernel reading its micro-batch's experts from DRAM
        pts.append(("MoE FFN on the CPU", m.ffn_intensity_gpu(mu), m.ffn_flops(N) / dec.cpu_ffn_s))
    where, secs = ("GPU", dec.gpu_attn_s) if A_g else ("CPU", dec.cpu_attn_s)
    pts.append((f"decode attention on the {where}", m.attn_intensity(c), m.attn_flops(N, c) / secs))
    return tuple((a, float(i), float(p)) for a, i, p in pts)


def search_policy(cfg: ModelConfig, profile: Profile, *, prompt_len: int, gen_len: int, gpus: int = 1,
                  name: str = "") -> LightningPolicy:
    """MoE-Lightning's policy search (§4.2): the (N, μ, A_g, F_g, r_w, r_c) with the highest predicted generation
    throughput for prompts of `prompt_len` (pad to the batch's longest, as MoE-Lightning (p) and the artifact do,
    for the memory to hold them) and `gen_len` new tokens on `gpus` of the profile's GPUs (tensor parallel).
    `alternatives` holds the best policy of each other variant (the other A_g / F_g, every expert paged, what
    moejax can run today). ValueError when not even μ = N = 1 fits."""
    start = time.perf_counter()
    if prompt_len < 1 or gen_len < 2:
        raise ValueError(f"search_policy: prompt_len >= 1 and gen_len >= 2 needed, got {prompt_len}, {gen_len}")
    if gpus < 1:
        raise ValueError(f"search_policy: gpus must be >= 1, got {gpus}")
    m = ModelShape.from_config(cfg, profile.dtype_bytes, name)
    hw = Hardware.from_profile(profile, gpus)
    if gpus > profile.gpus:  # a what-if (the paper's S6-S9 put 2-4 T4s in one machine): allowed, and said
        hw = dataclasses.replace(hw, name=f"{hw.name} (hypothetical: profile {profile.name} has {profile.gpus})")
    s, n = int(prompt_len), int(gen_len)
    caps = (GPU_USABLE * hw.m_g, CPU_USABLE * hw.m_c)
    mu_max, N_max = _bounds(m, hw, s, n, caps)
    found = {v: _best(m, hw, s, n, caps, v, mu_max, N_max) for v in VARIANTS} if mu_max and N_max else {}
    main = [v for v in VARIANTS[:4] if found.get(v)]
    if not main:
        raise ValueError(f"search_policy: {m.name} does not fit {hw.name}: the non-expert weights "
                         f"({m.W_o / 2**30:.1f} GiB) with a single token exceed {caps[0] / 2**30:.1f} GiB of GPU "
                         f"memory, or the experts exceed {caps[1] / 2**30:.1f} GiB of host memory")
    top = max(main, key=lambda v: found[v][0])
    solve_ms = (time.perf_counter() - start) * 1e3
    build = lambda v: _policy(m, hw, s, n, caps, v, found[v], solve_ms, m.name)  # noqa: E731
    best = build(top)
    listed: dict[tuple, LightningPolicy] = {}
    for p in [best] + [build(v) for v in VARIANTS if v is not top and found.get(v)]:
        key = (p.N, p.mu, p.A_g, p.F_g, round(p.r_w, 3), round(p.r_c, 3))
        if key in listed:  # the same policy as an earlier variant's: one entry, both labels, the narrower's numbers
            listed[key] = dataclasses.replace(p, label=f"{listed[key].label}; {p.label}")
        else:
            listed[key] = p
    first, *others = listed.values()
    return dataclasses.replace(best, label=first.label, alternatives=tuple(others))


def predict_policy(cfg: ModelConfig, profile: Profile, *, N: int, mu: int, A_g: int, F_g: int, r_w: float,
                   r_c: float, prompt_len: int, gen_len: int, gpus: int = 1, label: str = "given") -> LightningPolicy:
    """The performance model's predictions for a policy chosen elsewhere (the options), without searching."""
    if min(N, mu, prompt_len) < 1 or gen_len < 2:
        raise ValueError(f"predict_policy: N, mu, prompt_len >= 1 and gen_len >= 2 needed, got {N}, {mu}, "
                         f"{prompt_len}, {gen_len}")
    m = ModelShape.from_config(cfg, profile.dtype_bytes, "")
    hw = Hardware.from_profile(profile, gpus)
    caps = (GPU_USABLE * hw.m_g, CPU_USABLE * hw.m_c)
    found = (0.0, mu, N / mu, r_w, r_c)  # nb need not be whole here
    policy = _policy(m, hw, prompt_len, gen_len, caps, (label, A_g, F_g, (0, 1), 0), found, 0.0,  # type: ignore[arg-type]
                     m.name)
    return dataclasses.replace(policy, N=N)


def policy_roofline(cfg: ModelConfig, profile: Profile, policy: LightningPolicy) -> RooflineData:
    """The HRM numbers behind a policy's plot (its μ, N, r_w and average decode context)."""
    m = ModelShape.from_config(cfg, profile.dtype_bytes, policy.model)
    return roofline_data(m, Hardware.from_profile(profile, policy.gpus), mu=policy.mu, N=policy.N, r_w=policy.r_w,
                         context=policy.prompt_len + policy.gen_len / 2)
