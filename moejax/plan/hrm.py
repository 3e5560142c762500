"""MoE-Lightning's Hierarchical Roofline Model (HRM; Cao et al., ASPLOS '25, §3) as pure functions.

Two levels, as in the paper's case study: i = GPU (HBM), j = CPU (DRAM), joined by the CPU->GPU link.
- Eq. 4, compute roof at level i: P^i_x <= P^i_peak
- Eq. 5, memory roof at level i: P^i_x <= B^i_peak * I^i_x
- Eq. 6, memory roof from level j to i: P^i_x <= B^{j,i}_peak * I^j_x
- Eq. 7, x on i fetching from j: min of the three; Eq. 8, x on i with its data there: min of (4), (5)
- Eq. 9, turning point P1: I^j = min(P^j_peak, B^j_peak I^j) / B^{j,i}_peak, below which moving the data to the
  GPU is no better than computing where it lives (Eq. 9 has I^j on both sides: we solve the fixed point)
- Eq. 10, turning point P2: I^j = min(P^i_peak, B^i_peak I^i) / B^{j,i}_peak, below which x on the GPU is bound
  by the link
- Eq. 11, balance point: B^i_peak I^i = B^{j,i}_peak I^j, where the GPU is memory-bound (B^i I^i < P^i)

`I^i_x` is FLOPs of x per byte it reads from level i (Definition 3.1). For the MoE FFN, I^i rises with the
micro-batch μ (every micro-batch re-reads the experts from HBM) and I^j with the batch N (the CPU-resident
experts cross the link once per N tokens); decode attention's I is independent of the batch (§3.3).

`ModelShape` is Table 1's M (from a ModelConfig through moejax.costs' conventions) and `Hardware` its H (from a
Profile); lightning.py builds the latency model and the policy search on both."""
from __future__ import annotations

import dataclasses

import numpy as np
from numpy.typing import ArrayLike

from moejax.config import ModelConfig
from moejax.costs import causal_pairs, param_count, prefill_flops
from moejax.plan.hardware import Profile

Num = float | np.ndarray  # a count or size, or an array of them (elementwise)


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Table 1's H for `tp` GPUs used together (tensor parallel, §4.3): GPU memory, bandwidth and FLOP/s are
    multiplied by tp; the host's memory, bandwidth and FLOP/s and the CPU->GPU link are not (as the artifact's
    optimizer does). SI units: bytes, bytes/s, FLOP/s."""
    name: str
    m_g: float
    m_c: float
    b_g: float
    b_c: float
    b_cg: float
    p_g: float
    p_c: float
    tp: int = 1

    @classmethod
    def from_profile(cls, profile: Profile, gpus: int = 1) -> Hardware:
        d, h = profile.device, profile.host
        return cls(f"{gpus} x {d.name} + {h.name}", d.memory_bytes * gpus, h.memory_bytes, d.bandwidth * gpus,
                   h.bandwidth, profile.h2d.bandwidth, d.flops * gpus, h.flops, gpus)

    @property
    def hrm(self) -> HRM:
        return HRM(self.p_g, self.b_g, self.p_c, self.b_c, self.b_cg)


@dataclasses.dataclass(frozen=True)
class HRM:
    """The roofs of two levels: P_i, B_i (GPU), P_j, B_j (CPU) and B_ji (CPU -> GPU)."""
    P_i: float
    B_i: float
    P_j: float
    B_j: float
    B_ji: float

    def roof_i(self, I_i: ArrayLike) -> np.ndarray:
        """Eq. 8 on the GPU: min(Eq. 4, Eq. 5)."""
        return np.minimum(self.P_i, self.B_i * np.asarray(I_i, float))

    def roof_j(self, I_j: ArrayLike) -> np.ndarray:
        """Eq. 8 on the CPU."""
        return np.minimum(self.P_j, self.B_j * np.asarray(I_j, float))

    def attainable_i(self, I_i: ArrayLike, I_j: ArrayLike) -> np.ndarray:
        """Eq. 7: x on the GPU with its data fetched from the CPU."""
        return np.minimum(self.roof_i(I_i), self.B_ji * np.asarray(I_j, float))

    def p1(self) -> float:
        """Eq. 9: the I^j solving I = min(P_j, B_j I) / B_ji. When the CPU's own memory is faster than the link,
        that is P_j / B_ji (the CPU is compute-bound there); otherwise moving the data always pays: 0."""
        return self.P_j / self.B_ji if self.B_j > self.B_ji else 0.0

    def p2(self, I_i: float) -> float:
        """Eq. 10: the I^j below which x on the GPU (at GPU intensity I_i) is bound by the link."""
        return float(self.roof_i(I_i)) / self.B_ji

    def balance_point(self, I_i: float) -> float | None:
        """Eq. 11: the I^j where the link roof meets the GPU memory roof, B_i I_i / B_ji; None where the GPU is
        compute-bound at I_i (there P2 is reached at the compute roof instead)."""
        return self.B_i * I_i / self.B_ji if self.B_i * I_i < self.P_i else None


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """Table 1's M for one average decoder layer, in bytes of `dt` per element. Routed experts are `W_e` per
    layer (their total over the model / l; they are what gets offloaded); everything else (`W_o`: attention,
    norms, router, shared experts, dense MLPs, embeddings, head) stays on the GPU."""
    name: str
    l: int
    h1: int
    h2: int
    n_q: int
    d_qk: int
    d_v: int
    n_e: int
    k: int
    dt: int
    W_e: float  # routed expert bytes per layer
    W_o: float  # non-expert bytes, whole model
    W_ffn: float  # non-routed FFN bytes per layer (shared experts, dense MLPs): read from HBM per micro-batch
    ffn_flops_token: float  # FFN FLOPs per token per layer (routed k of E, shared, dense)
    kv_token: float  # KV cache bytes per token per layer

    @classmethod
    def from_config(cls, cfg: ModelConfig, dt: int = 2, name: str = "") -> ModelShape:
        l, D, I, E = cfg.num_layers, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
        routed = sum(cfg.moe_layers) * E * (3 * D * I + (2 * I + D) * cfg.expert_bias)
        f = prefill_flops(cfg, 1, 1, all_logits=False)  # one token: FLOPs per token by part (moejax.costs)
        dense_ffn = sum(cfg.moe_layers) * 3 * D * cfg.shared_expert_size + \
            (l - sum(cfg.moe_layers)) * 3 * D * cfg.intermediate_size
        if cfg.attention == "mla":
            d_qk, d_v, kv = cfg.q_head_dim, cfg.v_head_dim, cfg.kv_lora_rank + cfg.qk_rope_head_dim
        else:
            d_qk = d_v = cfg.head_dim
            kv = 2 * cfg.num_kv_heads * cfg.head_dim
        return cls(name or cfg.model_type, l, D, I or cfg.intermediate_size, cfg.num_heads, d_qk, d_v, E,
                   cfg.num_experts_per_tok, dt, routed * dt / l, (param_count(cfg) - routed) * dt,
                   dense_ffn * dt / l, (f.experts + f.shared_experts + f.dense_mlp) / l, kv * dt)

    # -- FLOPs and bytes of the two ops the paper models, per layer (moejax.costs' conventions) --

    def attn_flops(self, seqs: Num, context: Num) -> Num:
        """Decode attention of `seqs` sequences, one query each, over `context` keys: 2(d_qk + d_v) a pair."""
        return seqs * context * self.n_q * 2 * (self.d_qk + self.d_v)

    def attn_bytes(self, seqs: Num, context: Num) -> Num:
        """Decode attention reads q and the KV cache and writes its output."""
        return seqs * (self.dt * self.n_q * (self.d_qk + self.d_v) + context * self.kv_token)

    def prefill_attn_flops(self, seqs: Num, prompt: float) -> Num:
        return seqs * causal_pairs(int(prompt)) * self.n_q * 2 * (self.d_qk + self.d_v)

    def prefill_attn_bytes(self, seqs: Num, prompt: Num) -> Num:
        return seqs * prompt * (self.dt * self.n_q * (self.d_qk + self.d_v) + self.kv_token)

    def ffn_flops(self, tokens: Num) -> Num:
        return tokens * self.ffn_flops_token

    def ffn_bytes(self, tokens: Num) -> Num:
        """HBM bytes of one FFN kernel over `tokens` rows: the experts they touch (E(1 - (1 - k/E)^tokens) under
        uniform routing; the artifact counts all E), the non-routed FFN weights, activations in and out."""
        touched = 1.0 - (1.0 - self.k / self.n_e) ** np.asarray(tokens, float) if self.n_e else 0.0
        return self.W_e * touched + self.W_ffn + self.dt * tokens * (self.h1 + self.h2)

    # -- operational intensities (Definition 3.1) --

    def attn_intensity(self, context: Num) -> float:
        """Decode attention's FLOPs per byte of the memory holding the KV cache (any batch: §3.3)."""
        return float(self.attn_flops(1, context) / self.attn_bytes(1, context))

    def ffn_intensity_gpu(self, mu: Num) -> float:
        """I^i of the MoE FFN: FLOPs per HBM byte of one micro-batch of μ tokens."""
        return float(self.ffn_flops(mu) / self.ffn_bytes(mu))

    def ffn_intensity_cpu(self, N: Num, r_w: float = 0.0) -> float:
        """I^j of the MoE FFN: FLOPs of the batch N per byte of experts fetched from the CPU ((1 - r_w) W_e)."""
        moved = (1.0 - r_w) * self.W_e
        return float(self.ffn_flops(N) / moved) if moved > 0 else float("inf")

    def batch_for_cpu_intensity(self, I_j: float, r_w: float = 0.0) -> float:
        """The batch N at which the FFN's I^j reaches I_j (where P1, P2 sit on the batch axis, Fig. 5)."""
        return I_j * (1.0 - r_w) * self.W_e / self.ffn_flops_token


@dataclasses.dataclass(frozen=True)
class RooflineData:
    """What a roofline plot of the MoE FFN and decode attention needs (Figs. 4-5), for one μ and N."""
    hrm: HRM
    hardware: str
    model: str
    mu: int
    N: int
    r_w: float
    context: float
    I_attn: float  # decode attention, FLOPs per byte of KV (CPU or GPU memory alike)
    I_ffn_gpu: float  # I^i at μ
    I_ffn_cpu: float  # I^j at N, r_w
    P1: float  # Eq. 9, an I^j
    P2: float  # Eq. 10 at I_ffn_gpu, an I^j
    balance: float | None  # Eq. 11 at I_ffn_gpu, an I^j
    N_at_P1: float  # the batch sizes where the FFN's I^j reaches P1 and P2 (with r_w)
    N_at_P2: float

    def roofs(self, intensities: ArrayLike) -> dict[str, np.ndarray]:
        """Each roof's FLOP/s over an array of operational intensities (Eqs. 4-6)."""
        I = np.asarray(intensities, float)
        h = self.hrm
        return {"GPU compute": np.full_like(I, h.P_i), "CPU compute": np.full_like(I, h.P_j),
                "GPU memory": h.B_i * I, "CPU memory": h.B_j * I, "CPU->GPU": h.B_ji * I}

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def roofline_data(shape: ModelShape, hw: Hardware, *, mu: int, N: int, r_w: float = 0.0,
                  context: float = 512) -> RooflineData:
    """HRM numbers for the MoE FFN at micro-batch μ and batch N (weights share r_w on the GPU) and for decode
    attention at `context`: roofs, intensities, P1, P2, the balance point and the batches where P1, P2 sit."""
    h = hw.hrm
    I_i = shape.ffn_intensity_gpu(mu)
    p1, p2 = h.p1(), h.p2(I_i)
    return RooflineData(h, hw.name, shape.name, mu, N, r_w, context, shape.attn_intensity(context), I_i,
                        shape.ffn_intensity_cpu(N, r_w), p1, p2, h.balance_point(I_i),
                        shape.batch_for_cpu_intensity(p1, r_w), shape.batch_for_cpu_intensity(p2, r_w))


def plot_roofline(hrm_data: RooflineData, policy: object, path: str) -> str:
    """Write a PNG: the five roofs (log-log), P1 and P2, and `policy.operating_points` ((label, I, FLOP/s)
    triples; a LightningPolicy has them). matplotlib is an optional extra (`pip install moejax[plots]`)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # optional: the plots extra
        from matplotlib.figure import Figure  # optional: the plots extra
    except ImportError:
        raise ImportError("plot_roofline needs matplotlib: pip install 'moejax[plots]'") from None
    points = [p for p in getattr(policy, "operating_points", ()) if np.isfinite(p[1]) and p[1] > 0]
    lo = min([0.1] + [p[1] / 3 for p in points])
    hi = max([1e5, 3 * hrm_data.P2] + [p[1] * 3 for p in points])
    I = np.geomspace(lo, hi, 200)
    fig = Figure(figsize=(8, 5.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    styles = {"GPU compute": "C0-", "CPU compute": "C1-", "GPU memory": "C0--", "CPU memory": "C1--",
              "CPU->GPU": "C2-."}
    for name, y in hrm_data.roofs(I).items():
        ax.loglog(I, y, styles[name], label=name)
    for x, name in ((hrm_data.P1, "P1"), (hrm_data.P2, "P2")):
        if x > 0:
            ax.axvline(x, color="grey", lw=0.8, ls=":")
            ax.annotate(name, (x, hrm_data.hrm.P_j / 10), rotation=90, fontsize=8)
    for i, (label, x, y) in enumerate(points):
        ax.loglog([x], [y], "o", color=f"C{3 + i}", label=label)
    ax.set_xlabel("operational intensity (FLOP/byte of the level the data comes from)")
    ax.set_ylabel("FLOP/s")
    ax.set_title(f"HRM: {hrm_data.model} on {hrm_data.hardware}\n(mu = {hrm_data.mu}, N = {hrm_data.N}, "
                 f"r_w = {hrm_data.r_w:.2f})", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(True, which="major", lw=0.3)
    fig.subplots_adjust(left=0.1, right=0.97, bottom=0.1, top=0.93)  # not bbox "tight": that draws twice
    fig.savefig(path, dpi=110)
    return path
