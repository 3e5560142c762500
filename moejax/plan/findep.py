"""FinDEP (Pan et al., "Efficient MoE Inference with Fine-Grained Scheduling of Disaggregated Expert Parallelism"):
choose DEP's attention/expert group sizes (A, B), micro-batches r1, token chunks r2 and the order (ASAS or AASS)
for a fixed prefill workload, as pure functions of a ModelConfig and a hardware Profile (docs/design.md).
PPPipe (MegaScale-Infer's ping-pong pipeline) is the same model with r2 = 1 and the shared expert run as part of
attention before the sends (`pppipe_plan`).

Symbols as in the paper: A = ag attention devices, B = eg expert devices, S = seq_len, E experts, k = top-k,
m_a = sequences per micro-batch per attention device, m_e = rows per expert per chunk, T = MoE layers.

1. Time models (Eq. 1-4; in moejax.plan.findep_costs, as are 2.'s fits), each on one device of its group, on the
   profile's roofline (`Processor.op_time`):
   t_a(m_a) attention (projections + router + causal attention pairs, costs.py's conventions, GQA or MLA),
   t_s(m_a) shared expert (gate, up, down as moejax runs it: one MLP of the summed width, + Qwen2's gate),
   t_e(m_e) the E/B routed experts of one expert device (moejax's two grouped GEMMs over the m_e E rows it runs:
   every (token, choice) row of the chunk, the others' at weight 0, static shapes; under the executor's default
   A2E route, regroup, also the all-to-alls inside the expert group), t_a2e(m_e) = t_e2a(m_e) the transfer of the
   hidden states an expert device receives (regroup: its 1/B of the chunk's tokens, once each; straight: the whole
   chunk; Eq. 4 counts m_e E M / B, each token k times) over `profile.link_between(A + B)`, on its busiest port
   (findep_costs' docstring has the routes).
   A profile measured with `launch.profile --dep` replaces 1.-2. for the splits it measured (findep_costs 3.).
   Dense layers: t_d(m_a), attention + dense MLP, attention-group time.
2. α-β coefficients (Eq. 7-11), fitted by least squares on sampled sizes (`fit_coefficients`): t_gm per task on
   the summed GEMMs of that task (x = m k n, the paper's unit), t_attn (y = pairs x heads x (d_qk + d_v)), the
   routed experts fitted directly on the grouped GEMMs (so the paper's missing factor 3 in α_e, β_e cannot
   arise) and t_c per (A, B). Eq. 10-11 then give t_a = α_a + β_a m_a etc. (`DepCoefficients`).
3. The objective: the time of the decoder layers over all passes (`predicted_seconds`). Per run of T consecutive MoE
   layers, with X = t_a + t_s, Y = max(t_e, t_a2e), F = max(X, r2 Y) and G = t_a + t_a2e + t_e + t_e2a + (r2-1) Y
   (Eq. 12, the round trip of one micro-batch):
     ASAS:   D* = (T-1) max(G, r1 F) + max(r1 X, G + (r1-1) F)      (the summary's corrected Eq. 13; the printed
             Eq. 13 counts the r2 tail twice and misses the AG's last shared segments: up to 82% off on random
             durations)
     AASS:   F_a = max(t_a, r2 Y), P1 = max(G, r1 F), P = max(P1, (G + (r1-1) F_a + t_a + r1 t_s) / 2),
             tail = max(r1 X, G + (r1-1) F_a); D = tail + (T-1) P for odd T, tail + P1 + (T-2) P for even T.
             (Not in the paper. The deferred shared segments make a two-layer cycle: the last micro-batch's
             return gates its next attention, after which the AG still owes every shared segment.)
     PPPipe: ASAS's D* with t_a <- t_a + t_s, t_s <- 0, r2 = 1.
   These equal the discrete-event simulation of Eq. 5's rules under each dispatch order (`moejax.plan.dep_sim`)
   to rounding, for any durations (tests/plan/test_plan_findep.py). Dense layers add r1 t_d each (exact for leading
   dense layers, as DeepSeek's; a dense layer between MoE runs is counted as a drain and a restart, an
   over-estimate: up to 22-47% on random durations; no preset has one). Embedding and lm_head are not modelled.
   Padding counts as work, as the executor runs it: each pass's rows are padded to A r1 m_a, each micro-batch's
   A m_a S tokens are cut into r2 chunks padded to a multiple of lcm(A, B) rows (m_e is the largest padded chunk's
   rows x k / E, every chunk timed as that one). Throughput = real tokens / predicted time.
4. The search (`search_split`, Algorithm 1 for a fixed workload): per (A, B) the (m_a, r1) Pareto scan, then r2
   by a 1-D convex search in 1/r2 (Thm 4) on the padding-free objective, widened over integers until that lower
   bound cannot beat the padded optimum (so the answer is exact, not near-optimal), for both orders.
   `exhaustive_split` is the brute force over the same space, for checks and `--exhaustive`.

Memory (getMaxR1's model; `dep_workload`): an attention device holds the replicated non-expert weights (everything
but the routed experts, as profile.dtype_bytes) and keeps per sequence of the pass its KV cache for every layer
(MLA: latent + rope key) and two hidden states (the residual stream and the routed output awaiting the combine);
the micro-batch being computed also needs a working set per sequence (the attention projections' outputs and the
MLP's gate and up activations). With free = memory x (1 - RESERVE_FRACTION) - weights, a pass of r1 micro-batches
of m_a sequences fits when m_a (r1 resident + working) <= free. An expert device must hold its E/B experts per MoE
layer. The workload is tokens // seq_len sequences: one pass if it fits, else the fewest passes that fit, their
sequences spread evenly (each pass planned as the largest)."""
from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterable, Sequence

import numpy as np

from moejax.config import ModelConfig
from moejax.costs import param_count
from moejax.layout import dep_default_split
from moejax.plan.dep_sim import TaskTimes
from moejax.plan.findep_costs import R2_MAX, DepCoefficients, _fit_attention_group, attention_gemms, fit_coefficients
from moejax.plan.hardware import GiB, Profile

ORDERS = ("asas", "aass")  # FinDEP's two dispatch orders (§4.1)
PLAN_ORDERS = ORDERS + ("pppipe",)
RESERVE_FRACTION = 0.1  # of device memory, for XLA workspace and fragmentation (as moejax.offload.memory_budget)


# -- memory and the workload ---------------------------------------------------------------------------------------

def _routed_params(cfg: ModelConfig) -> int:
    D, I = cfg.hidden_size, cfg.moe_intermediate_size
    return sum(cfg.moe_layers) * cfg.num_experts * (3 * D * I + (2 * I + D) * cfg.expert_bias)


def _kv_elements_per_token(cfg: ModelConfig) -> int:
    """Per token, all layers: GQA keys and values; MLA the latent and the rope key (moejax's caches)."""
    if cfg.attention == "mla":
        per_layer = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    else:
        per_layer = 2 * cfg.num_kv_heads * cfg.head_dim
    return per_layer * cfg.num_layers


def _working_elements_per_token(cfg: ModelConfig) -> int:
    """The widest layer's transient activations per token: attention projections' outputs + the MLP's gate and up
    + the hidden state."""
    width = sum(n for _, n in attention_gemms(cfg))
    mlp = max(cfg.shared_expert_size, 0 if all(cfg.moe_layers) else cfg.intermediate_size)
    return width + 2 * mlp + cfg.hidden_size


@dataclasses.dataclass(frozen=True)
class DepWorkload:
    """What the search needs besides the coefficients: the workload, the layer structure and the attention
    devices' memory (bytes; module docstring)."""
    sequences: int
    seq_len: int
    top_k: int
    experts: int
    moe_segments: tuple[int, ...]  # lengths of the runs of consecutive MoE layers
    dense_layers: int
    free_bytes: float  # attention device memory left for activations and caches
    resident_bytes_per_sequence: float  # KV cache + two hidden states, for every sequence of a pass
    working_bytes_per_sequence: float  # the micro-batch being computed

    @property
    def tokens(self) -> int:
        return self.sequences * self.seq_len

    @property
    def moe_layers(self) -> int:
        return sum(self.moe_segments)

    def max_m_a(self, r1: int) -> int:
        """The largest micro-batch (sequences per attention device) that fits with r1 of them in the pass."""
        return int(self.free_bytes // (r1 * self.resident_bytes_per_sequence + self.working_bytes_per_sequence))

    def pass_shape(self, attn_devices: int, r1: int) -> tuple[int, int] | None:
        """(passes, m_a) for r1 micro-batches: one pass if it fits, else the fewest that do, spread evenly; None
        if not even one sequence per micro-batch fits."""
        cap = self.max_m_a(r1)
        if cap < 1:
            return None
        per_device = _ceil_div(self.sequences, attn_devices)
        passes = _ceil_div(per_device, r1 * cap)
        return passes, _ceil_div(_ceil_div(per_device, passes), r1)

    def pass_shapes(self, attn_devices: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """pass_shape for r1 = 1, 2, ... up to max_r1, while one sequence per micro-batch fits (max_m_a falls
        with r1): arrays (r1, passes, m_a)."""
        r1 = np.arange(1, self.max_r1(attn_devices) + 1, dtype=np.int64)
        cap = np.floor_divide(self.free_bytes, r1 * self.resident_bytes_per_sequence +
                              self.working_bytes_per_sequence).astype(np.int64)
        fits = int(np.argmin(cap >= 1)) if (cap < 1).any() else len(r1)
        r1, cap = r1[:fits], cap[:fits]
        per_device = _ceil_div(self.sequences, attn_devices)
        passes = -(-per_device // (r1 * cap))  # ceil divisions, elementwise
        per_pass = -(-per_device // passes)
        return r1, passes, -(-per_pass // r1)

    def max_r1(self, attn_devices: int) -> int:
        """More micro-batches than sequences per attention device would only add padding."""
        return _ceil_div(self.sequences, attn_devices)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def dep_workload(cfg: ModelConfig, profile: Profile, *, tokens: int, seq_len: int,
                 memory_bytes: float | None = None) -> DepWorkload:
    """tokens // seq_len sequences of seq_len tokens of `cfg` on `profile`'s devices (memory_bytes: per device,
    default the profile's)."""
    _check_workload(cfg, tokens, seq_len)
    b = profile.dtype_bytes
    usable = (memory_bytes if memory_bytes is not None else profile.device.memory_bytes) * (1 - RESERVE_FRACTION)
    weights = (param_count(cfg) - _routed_params(cfg)) * b
    resident = seq_len * b * (_kv_elements_per_token(cfg) + 2 * cfg.hidden_size)
    working = seq_len * b * _working_elements_per_token(cfg)
    free = usable - weights
    if free < resident + working:
        raise ValueError(f"memory: an attention device holds the non-expert weights ({weights / GiB:.2f} GiB) and "
                         f"needs {(resident + working) / GiB:.3f} GiB for one sequence of {seq_len} tokens, more "
                         f"than its {usable / GiB:.2f} GiB usable ({1 - RESERVE_FRACTION:.0%} of "
                         f"{usable / (1 - RESERVE_FRACTION) / GiB:.2f} GiB)")
    segments, run = [], 0
    for moe in cfg.moe_layers:
        if moe:
            run += 1
        elif run:
            segments.append(run)
            run = 0
    segments += [run] if run else []
    return DepWorkload(sequences=tokens // seq_len, seq_len=seq_len, top_k=cfg.num_experts_per_tok,
                       experts=cfg.num_experts, moe_segments=tuple(segments),
                       dense_layers=cfg.num_layers - sum(cfg.moe_layers), free_bytes=free,
                       resident_bytes_per_sequence=resident, working_bytes_per_sequence=working)


def _check_workload(cfg: ModelConfig, tokens: int, seq_len: int) -> None:
    if not cfg.num_experts or not any(cfg.moe_layers):
        raise ValueError(f"DEP schedule: model {cfg.model_type} has no MoE layers; DEP splits routed experts")
    if seq_len < 1:
        raise ValueError(f"DEP schedule: seq_len must be >= 1, got {seq_len}")
    if tokens < seq_len:
        raise ValueError(f"DEP schedule: tokens={tokens} is less than seq_len={seq_len}: not one whole sequence")


def expert_bytes_per_device(cfg: ModelConfig, profile: Profile, expert_devices: int) -> float:
    return _routed_params(cfg) * profile.dtype_bytes / expert_devices


# -- 3. the objective (Eq. 12-13, corrected; module docstring) ---------------------------------------------------

def segment_seconds(ta: float, ts: float, te: float, tc: float, T: int, r1: int, r2: int, order: str) -> float:
    """T consecutive MoE layers of r1 micro-batches with r2 chunks each, from all inputs ready to the last output
    back (closed forms in the module docstring; t_e2a = t_a2e = tc)."""
    if order == "pppipe":
        ta, ts = ta + ts, 0.0
    X, Y = ta + ts, max(te, tc)
    F = max(X, r2 * Y)
    G = ta + 2 * tc + te + (r2 - 1) * Y
    if order != "aass":
        return (T - 1) * max(G, r1 * F) + max(r1 * X, G + (r1 - 1) * F)
    F_a = max(ta, r2 * Y)
    tail = max(r1 * X, G + (r1 - 1) * F_a)
    P1 = max(G, r1 * F)
    P = max(P1, (G + (r1 - 1) * F_a + ta + r1 * ts) / 2)
    if T == 1:
        return tail
    return tail + (T - 1) * P if T % 2 else tail + P1 + (T - 2) * P


class _Pair:
    """One (m_a, r1) of a split: the objective as a function of r2 and the order, padded (as executed) or not
    (the continuous relaxation m_e = k'/r2 of Thm 4, a lower bound)."""

    def __init__(self, coef: DepCoefficients, work: DepWorkload, m_a: int, r1: int, passes: int):
        A, B = coef.attn_devices, coef.expert_devices
        self.coef, self.work, self.m_a, self.r1, self.passes = coef, work, m_a, r1, passes
        self.ta = coef.alpha_a + coef.beta_a * m_a
        self.ts = coef.alpha_s + coef.beta_s * m_a
        self.td = coef.alpha_d + coef.beta_d * m_a
        self.tokens = A * m_a * work.seq_len  # of one micro-batch
        self.multiple = math.lcm(A, B)
        self.blocks = _ceil_div(self.tokens, self.multiple)  # of lcm(A, B) rows
        self.rows_to_m_e = work.top_k / work.experts  # m_e = rows x k / E (balanced routing)
        self.r2_max = min(R2_MAX, self.blocks)

    def m_e(self, r2: int, padded: bool = True) -> float:
        rows = self.multiple * _ceil_div(self.blocks, r2) if padded else self.tokens / r2
        return rows * self.rows_to_m_e

    def seconds(self, r2: int, order: str, padded: bool = True) -> float:
        """All passes."""
        c, m_e = self.coef, self.m_e(r2, padded)
        te, tc = c.alpha_e + c.beta_e * m_e, c.alpha_c + c.beta_c * m_e
        moe = sum(segment_seconds(self.ta, self.ts, te, tc, T, self.r1, r2, order) for T in self.work.moe_segments)
        return self.passes * (moe + self.work.dense_layers * self.r1 * self.td)

    def lower_bound(self) -> float:
        """No order or r2 beats the busiest resource's work: the AG's attention, shared and dense segments, the
        EG's experts and the links' transfers (r2 t(m_e) >= t(k') for affine t with α >= 0)."""
        c, T, r1 = self.coef, self.work.moe_layers, self.r1
        k = self.m_e(1, padded=False)
        ag = T * r1 * (self.ta + self.ts) + self.work.dense_layers * r1 * self.td
        eg = T * r1 * max(c.alpha_e + c.beta_e * k, c.alpha_c + c.beta_c * k)
        return self.passes * max(ag, eg)

    def best_r2(self, order: str, r2: int | None = None) -> tuple[int, float]:
        """r2 minimising the padded objective: Thm 4's convex search on the relaxation, then outwards while the
        relaxation (a lower bound) could still win."""
        if order == "pppipe":
            r2 = 1
        if r2 is not None:
            return r2, self.seconds(r2, order)
        relaxed = lambda r: self.seconds(r, order, padded=False)  # noqa: E731
        lo, hi = 1, self.r2_max
        while lo < hi:  # convex in 1/r2 => unimodal in r2: the first r where it stops falling
            mid = (lo + hi) // 2
            if relaxed(mid + 1) >= relaxed(mid):
                hi = mid
            else:
                lo = mid + 1
        best_r2, best = lo, self.seconds(lo, order)
        for step in (-1, 1):
            r = lo + step
            while 1 <= r <= self.r2_max and relaxed(r) < best:
                s = self.seconds(r, order)
                if s < best:
                    best_r2, best = r, s
                r += step
        return best_r2, best


def predicted_seconds(coef: DepCoefficients, work: DepWorkload, *, m_a: int, r1: int, r2: int, order: str,
                      passes: int = 1) -> float:
    """The objective: `passes` passes of r1 micro-batches of m_a sequences per attention device, r2 chunks each."""
    return _Pair(coef, work, m_a, r1, passes).seconds(r2, order)


def rows_per_expert(coef: DepCoefficients, work: DepWorkload, *, m_a: int, r2: int) -> float:
    """m_e: rows per expert in the largest padded chunk (balanced routing)."""
    return _Pair(coef, work, m_a, 1, 1).m_e(r2)


def task_times(coef: DepCoefficients, work: DepWorkload, *, m_a: int, r2: int) -> TaskTimes:
    """Per-task durations at (m_a, r2), what dep_sim.simulate takes."""
    return coef.task_times(m_a, rows_per_expert(coef, work, m_a=m_a, r2=r2))


# -- 4. the search -------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class DepChoice:
    """One configuration and its predicted time (all passes)."""
    attn_devices: int
    expert_devices: int
    r1: int
    r2: int
    order: str
    m_a: int
    m_e: float
    passes: int
    predicted_s: float
    tokens: int  # real tokens of the workload

    @property
    def predicted_tokens_per_s(self) -> float:
        return self.tokens / self.predicted_s

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "predicted_tokens_per_s": self.predicted_tokens_per_s}

    def layout_spec(self) -> str:
        return layout_spec(self)


def layout_spec(c: DepChoice | DepSchedule) -> str:
    """The moejax layout string (moejax.layout) of a DepChoice or DepSchedule."""
    return (f"attn=dp,experts=dep,attn_devices={c.attn_devices},expert_devices={c.expert_devices},r1={c.r1},"
            f"r2={c.r2},order={c.order}")


def _choice(pair: _Pair, r2: int, order: str, seconds: float) -> DepChoice:
    c = pair.coef
    return DepChoice(c.attn_devices, c.expert_devices, pair.r1, r2, order, pair.m_a, pair.m_e(r2), pair.passes,
                     seconds, pair.work.tokens)


def _r1_values(coef: DepCoefficients, work: DepWorkload, r1: int | None) -> list[tuple[int, int, int]]:
    """(r1, passes, m_a) of the space: every r1 up to the sequences per attention device (or the caller's)."""
    if r1 is None:
        return list(zip(*(a.tolist() for a in work.pass_shapes(coef.attn_devices)), strict=True))
    shape = work.pass_shape(coef.attn_devices, r1)
    if shape is None:
        raise ValueError(f"DEP schedule: r1={r1} micro-batches of one sequence each do not fit an attention device's "
                         f"memory ({work.free_bytes / GiB:.2f} GiB free after the weights)")
    return [(r1, *shape)]


def pareto_pairs(coef: DepCoefficients, work: DepWorkload, r1: int | None = None) -> list[tuple[int, int, int]]:
    """Algorithm 1's (m_a, r1) Pareto scan for a fixed workload, as (r1, passes, m_a): a pass of R sequences per
    attention device is covered by r1 micro-batches of m_a = ceil(R / r1) (memory bounds r1 m_a, getMaxR1's role,
    and more passes are taken only when one does not fit). Among r1 giving the same (passes, m_a), only the
    smallest is kept: the others run the same micro-batches plus padding ones, and the objective never falls with
    r1 at fixed m_a (it rises by Thm 3's B r1 term)."""
    if r1 is not None:
        return _r1_values(coef, work, r1)
    r1s, passes, m_a = work.pass_shapes(coef.attn_devices)
    _, first = np.unique(passes * (int(m_a.max(initial=0)) + 1) + m_a, return_index=True)
    first.sort()
    return list(zip(r1s[first].tolist(), passes[first].tolist(), m_a[first].tolist(), strict=True))


def search_split(coef: DepCoefficients, work: DepWorkload, *, r1: int | None = None, r2: int | None = None,
                 orders: Sequence[str] = ORDERS) -> dict[str, DepChoice]:
    """The best configuration of each order for one (A, B): Alg. 1 on the given coefficients."""
    best: dict[str, DepChoice] = {}
    for r, passes, m_a in pareto_pairs(coef, work, r1):
        pair = _Pair(coef, work, m_a, r, passes)
        bound = pair.lower_bound()
        for order in orders:
            if order in best and bound >= best[order].predicted_s:
                continue
            r2_, seconds = pair.best_r2(order, r2)
            if order not in best or seconds < best[order].predicted_s:
                best[order] = _choice(pair, r2_, order, seconds)
    return best


def evaluate(coef: DepCoefficients, work: DepWorkload, *, m_a: int, r1: int, r2: int | None = None,
             orders: Sequence[str] = ORDERS) -> DepChoice:
    """One pass of exactly A r1 m_a sequences (no row padding, memory not checked), r2 and the order searched
    unless given: the throughput the paper's Tables 3-4 tabulate for an (m_a, r1)."""
    pair = _Pair(coef, work, m_a, r1, 1)
    best = min((pair.best_r2(o, r2) + (o,) for o in orders), key=lambda t: t[1])
    choice = _choice(pair, best[0], best[2], best[1])
    return dataclasses.replace(choice, tokens=coef.attn_devices * r1 * m_a * work.seq_len)


def exhaustive_split(coef: DepCoefficients, work: DepWorkload, *, r1: int | None = None, r2: int | None = None,
                     orders: Sequence[str] = ORDERS) -> dict[str, DepChoice]:
    """Brute force over the same space: every r1 up to the sequences per attention device (while one sequence per
    micro-batch fits), every r2 in [1, R2_MAX] (at most one chunk per block of lcm(A, B) rows), every order."""
    best: dict[str, DepChoice] = {}
    for r, passes, m_a in _r1_values(coef, work, r1):
        pair = _Pair(coef, work, m_a, r, passes)
        for order in orders:
            r2s = [1] if order == "pppipe" else [r2] if r2 is not None else range(1, pair.r2_max + 1)
            for r2_ in r2s:
                seconds = pair.seconds(r2_, order)
                if order not in best or seconds < best[order].predicted_s:
                    best[order] = _choice(pair, r2_, order, seconds)
    return best


# -- the planner ---------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class DepSchedule:
    """A chosen DEP configuration with its prediction, the runner-ups and the inputs that decided it."""
    attn_devices: int
    expert_devices: int
    r1: int
    r2: int
    order: str
    m_a: int  # sequences per micro-batch per attention device
    m_e: float  # rows per expert per chunk (padded chunk, balanced routing)
    passes: int
    predicted_tokens_per_s: float
    predicted_s: float
    solve_ms: float
    tokens: int  # real tokens (sequences x seq_len)
    seq_len: int
    model: str
    profile: str
    coefficients: DepCoefficients
    task_times: TaskTimes  # per task at (m_a, m_e): what dep_sim.simulate takes
    alternatives: tuple[DepChoice, ...] = ()  # the best of each other (A, B) and order, fastest first
    exhaustive: DepChoice | None = None
    exhaustive_ms: float | None = None
    searched: str = ""  # what was searched, what was held fixed

    def layout_spec(self) -> str:
        return layout_spec(self)

    def as_dict(self) -> dict:
        keys = ("attn_devices", "expert_devices", "r1", "r2", "order", "m_a", "m_e", "passes",
                "predicted_tokens_per_s", "predicted_s", "solve_ms", "tokens", "seq_len", "model", "profile",
                "searched")
        out = {k: getattr(self, k) for k in keys}
        out["layout"] = self.layout_spec()
        out["task_times"] = dataclasses.asdict(self.task_times)
        out["coefficients"] = self.coefficients.as_dict()
        out["alternatives"] = [a.as_dict() for a in self.alternatives]
        if self.exhaustive is not None:
            ex = self.exhaustive.as_dict()
            out["exhaustive"] = {**{k: ex[k] for k in ("attn_devices", "expert_devices", "r1", "r2", "order", "m_a",
                                                       "m_e", "passes", "predicted_tokens_per_s", "predicted_s")},
                                 "solve_ms": self.exhaustive_ms}
        return out

    def describe(self) -> str:
        t = self.task_times
        lines = [
            f"DEP schedule for {self.model} on {self.profile}: {self.tokens} tokens as {self.tokens // self.seq_len} "
            f"sequences of {self.seq_len}",
            f"  layout {self.layout_spec()}",
            f"  m_a={self.m_a} sequences per micro-batch per attention device, m_e={self.m_e:.1f} rows per expert "
            f"per chunk, {self.passes} pass{'es' if self.passes > 1 else ''}",
            f"  predicted {self.predicted_s * 1e3:.2f} ms, {self.predicted_tokens_per_s:,.0f} tokens/s "
            f"(solved in {self.solve_ms:.1f} ms; {self.searched})",
            f"  per task: attention {t.attention * 1e3:.3f} ms, shared {t.shared * 1e3:.3f} ms, experts "
            f"{t.experts * 1e3:.3f} ms, a2e = e2a {t.a2e * 1e3:.3f} ms; {self._bottleneck()}"]
        if self.alternatives:
            lines.append("  runner-ups (best of each other split and order):")
            for a in self.alternatives[:8]:
                lines.append(f"    {a.layout_spec()} m_a={a.m_a}: {a.predicted_s * 1e3:.2f} ms "
                             f"(+{(a.predicted_s / self.predicted_s - 1) * 100:.1f}%)")
        if self.exhaustive is not None:
            same = abs(self.exhaustive.predicted_s - self.predicted_s) <= 1e-9 * self.predicted_s
            lines.append(f"  exhaustive search ({self.exhaustive_ms:.0f} ms): {self.exhaustive.layout_spec()} "
                         f"{self.exhaustive.predicted_s * 1e3:.2f} ms ({'same optimum' if same else 'DIFFERS'})")
        return "\n".join(lines)

    def _bottleneck(self) -> str:
        t, r1, r2 = self.task_times, self.r1, self.r2
        per_layer = {"the attention group": r1 * (t.attention + t.shared), "the expert group": r1 * r2 * t.experts,
                     "the transfers": r1 * r2 * t.a2e}
        name = max(per_layer, key=per_layer.__getitem__)
        return f"busiest per MoE layer: {name} ({per_layer[name] * 1e3:.3f} ms)"


def _splits(cfg: ModelConfig, profile: Profile, devices: int, attn_devices: int | None, expert_devices: int | None,
            memory_bytes: float | None) -> list[tuple[int, int]]:
    """(A, B) with A + B = devices, E % B == 0 and the E/B experts per MoE layer fitting an expert device."""
    E = cfg.num_experts
    if attn_devices is not None and expert_devices is not None and attn_devices + expert_devices != devices:
        raise ValueError(f"DEP schedule: attn_devices={attn_devices} + expert_devices={expert_devices} != "
                         f"devices={devices}")
    for name, v in (("attn_devices", attn_devices), ("expert_devices", expert_devices)):
        if v is not None and not 1 <= v < devices:
            raise ValueError(f"DEP schedule: {name}={v} must leave at least one of the {devices} devices to the other "
                             "group")
    usable = (memory_bytes if memory_bytes is not None else profile.device.memory_bytes) * (1 - RESERVE_FRACTION)
    out, divisible = [], []
    for A in range(1, devices):
        B = devices - A
        if (attn_devices is not None and A != attn_devices) or (expert_devices is not None and B != expert_devices):
            continue
        if E % B:
            continue
        divisible.append(B)
        if expert_bytes_per_device(cfg, profile, B) <= usable:
            out.append((A, B))
    if not divisible:
        held = "".join(f" with {k}={v}" for k, v in (("attn_devices", attn_devices),
                                                      ("expert_devices", expert_devices)) if v is not None)
        raise ValueError(f"DEP schedule: no split of {devices} devices into A + B{held} has the {E} experts divide "
                         "evenly over the B expert devices (E % B == 0)")
    if not out:
        raise ValueError(f"DEP schedule: the routed experts do not fit the expert group: with B = {max(divisible)} "
                         f"devices each holds {expert_bytes_per_device(cfg, profile, max(divisible)) / GiB:.1f} GiB "
                         f"> {usable / GiB:.1f} GiB usable")
    return out


def _check_inputs(devices: int, r1: int | None, r2: int | None, order: str | None) -> tuple[str, ...]:
    """-> the orders to search."""
    if devices < 2:
        raise ValueError(f"DEP schedule: devices={devices}: DEP needs 2 or more devices (an attention group and an "
                         "expert group)")
    if r1 is not None and r1 < 1:
        raise ValueError(f"DEP schedule: r1 must be >= 1, got {r1}")
    if r2 is not None and r2 < 1:
        raise ValueError(f"DEP schedule: r2 must be >= 1, got {r2}")
    if order is not None and order not in PLAN_ORDERS:
        raise ValueError(f"DEP schedule: order must be one of {', '.join(PLAN_ORDERS)}, got {order!r}")
    if order == "pppipe" and r2 not in (None, 1):
        raise ValueError(f"DEP schedule: order=pppipe sends each micro-batch whole (r2 = 1), got r2={r2}")
    return ORDERS if order is None else (order,)


def solve_dep(cfg: ModelConfig, profile: Profile, *, devices: int, tokens: int, seq_len: int,
              attn_devices: int | None = None, expert_devices: int | None = None, r1: int | None = None,
              r2: int | None = None, order: str | None = None, exhaustive: bool = False,
              memory_bytes: float | None = None) -> DepSchedule:
    """FinDEP's Algorithm 1 for `tokens // seq_len` sequences of `seq_len` tokens on `devices` devices: the best
    (A, B, r1, r2, order) under the objective of the module docstring. Any of attn_devices, expert_devices, r1,
    r2, order given is held fixed (order may be "pppipe"). exhaustive=True also runs the brute force over the same
    space (DepSchedule.exhaustive). memory_bytes: per device, default the profile's. ValueError naming the problem
    when nothing can run."""
    start = time.perf_counter()
    orders = _check_inputs(devices, r1, r2, order)
    work = dep_workload(cfg, profile, tokens=tokens, seq_len=seq_len, memory_bytes=memory_bytes)
    splits = _splits(cfg, profile, devices, attn_devices, expert_devices, memory_bytes)
    coefs = _fit_splits(cfg, profile, work, splits)
    best = {(A, B, o): c for (A, B), coef in coefs.items()
            for o, c in search_split(coef, work, r1=r1, r2=r2, orders=orders).items()}
    solve_ms = (time.perf_counter() - start) * 1e3
    chosen = fastest(best.values())
    ex, ex_ms = None, None
    if exhaustive:
        t0 = time.perf_counter()
        ex = fastest(c for coef in coefs.values()
                      for c in exhaustive_split(coef, work, r1=r1, r2=r2, orders=orders).values())
        ex_ms = (time.perf_counter() - t0) * 1e3
    fixed = [f"{k}={v}" for k, v in (("attn_devices", attn_devices), ("expert_devices", expert_devices), ("r1", r1),
                                      ("r2", r2), ("order", order)) if v is not None]
    searched = (f"{len(splits)} split{'s' if len(splits) > 1 else ''} x orders {'/'.join(orders)}"
                + (f"; held fixed: {', '.join(fixed)}" if fixed else ""))
    return _plan(cfg, profile, chosen, coefs, best, solve_ms, ex, ex_ms, searched)


def _fit_splits(cfg: ModelConfig, profile: Profile, work: DepWorkload, splits: list[tuple[int, int]]
                ) -> dict[tuple[int, int], DepCoefficients]:
    """Each split's fits over the m_a its space can reach, whatever else is searched (so that plans with and
    without held parameters share coefficients)."""
    def reach(A: int) -> int:
        return max(1, min(work.max_r1(A), work.max_m_a(1)))
    ag = _fit_attention_group(cfg, profile, work.seq_len, reach(1))
    return {(A, B): fit_coefficients(cfg, profile, attn_devices=A, expert_devices=B, seq_len=work.seq_len,
                                     max_m_a=reach(A), _ag=ag) for A, B in splits}


def fastest(choices: Iterable[DepChoice]) -> DepChoice:
    """Fastest; ties to fewer micro-batches and chunks (less to dispatch), then ASAS."""
    return min(choices, key=lambda c: (c.predicted_s, c.r1 * c.r2, PLAN_ORDERS.index(c.order), c.attn_devices))


def _plan(cfg: ModelConfig, profile: Profile, chosen: DepChoice, coefs: dict[tuple[int, int], DepCoefficients],
          best: dict[tuple[int, int, str], DepChoice], solve_ms: float, ex: DepChoice | None, ex_ms: float | None,
          searched: str) -> DepSchedule:
    coef = coefs[(chosen.attn_devices, chosen.expert_devices)]
    others = sorted((c for c in best.values() if c is not chosen), key=lambda c: c.predicted_s)
    return DepSchedule(attn_devices=chosen.attn_devices, expert_devices=chosen.expert_devices, r1=chosen.r1,
                   r2=chosen.r2, order=chosen.order, m_a=chosen.m_a, m_e=chosen.m_e, passes=chosen.passes,
                   predicted_tokens_per_s=chosen.predicted_tokens_per_s, predicted_s=chosen.predicted_s,
                   solve_ms=solve_ms, tokens=chosen.tokens, seq_len=coef.seq_len, model=cfg.model_type,
                   profile=profile.name, coefficients=coef, task_times=coef.task_times(chosen.m_a, chosen.m_e),
                   alternatives=tuple(others), exhaustive=ex, exhaustive_ms=ex_ms, searched=searched)


def pppipe_plan(cfg: ModelConfig, profile: Profile, *, devices: int, tokens: int, seq_len: int,
                attn_devices: int | None = None, expert_devices: int | None = None, r1: int | None = None,
                exhaustive: bool = False, memory_bytes: float | None = None) -> DepSchedule:
    """The baseline: the best PPPipe configuration (r2 = 1, the shared expert part of attention, A2E after it)
    under the same model, splits and memory."""
    return solve_dep(cfg, profile, devices=devices, tokens=tokens, seq_len=seq_len, attn_devices=attn_devices,
                     expert_devices=expert_devices, r1=r1, r2=1, order="pppipe", exhaustive=exhaustive,
                     memory_bytes=memory_bytes)


def default_plan(cfg: ModelConfig, profile: Profile, *, devices: int, tokens: int, seq_len: int,
                 memory_bytes: float | None = None) -> DepSchedule:
    """What `layout=attn=dp,experts=dep` runs without a plan (moejax.layout.dep_default_split): half the
    devices each (the expert group the larger half), or the nearest split whose expert group the experts divide
    over (its `searched` says so), r1 = r2 = 1, ASAS; predicted under the same model."""
    try:
        A, B, moved = dep_default_split(cfg.num_experts, devices)
    except ValueError as e:
        raise ValueError(f"DEP schedule: {e}") from None
    plan = solve_dep(cfg, profile, devices=devices, tokens=tokens, seq_len=seq_len, attn_devices=A,
                     expert_devices=B, r1=1, r2=1, order="asas", memory_bytes=memory_bytes)
    return dataclasses.replace(plan, searched=f"{plan.searched}; {moved}") if moved else plan


def solve_step(cfg: ModelConfig, profile: Profile, *, attn_devices: int, expert_devices: int, rows: int,
               tokens_per_row: int, r1_choices: Sequence[int] | None = None, r2: int | None = None,
               order: str | None = None, memory_bytes: float | None = None) -> DepChoice:
    """FinDEP's online phase (§4) for one step shape: the best (r1, r2, order) for `rows` sequences of
    `tokens_per_row` tokens on a fixed split (A, B), Algorithm 1 on that split only. r1_choices: the micro-batch
    counts the executor can run for this shape (None: any up to the rows per attention device); r2 or order given:
    held fixed. ValueError naming the problem when nothing can run."""
    orders = _check_inputs(attn_devices + expert_devices, None, r2, order)
    work = dep_workload(cfg, profile, tokens=rows * tokens_per_row, seq_len=tokens_per_row,
                        memory_bytes=memory_bytes)
    coef = _fit_splits(cfg, profile, work, [(attn_devices, expert_devices)])[(attn_devices, expert_devices)]
    if r1_choices is None:
        return fastest(search_split(coef, work, r2=r2, orders=orders).values())
    if not r1_choices or min(r1_choices) < 1:
        raise ValueError(f"DEP step schedule: r1_choices must be a non-empty list of ints >= 1, got {r1_choices}")
    return fastest(c for r in r1_choices for c in search_split(coef, work, r1=r, r2=r2, orders=orders).values())
