"""Analytic FLOPs and parameter counts of a ModelConfig: pure functions, no JAX devices needed.

Conventions (shared by cost models, planners and benchmarks):
- A matmul [m, k] x [k, n] costs 2*m*n*k FLOPs. Elementwise work (norms, rope, softmax, activations,
  the routing weights' combine) is not counted, nor are biases.
- Prefill = one forward over B sequences of T tokens each, starting from an empty cache.
- Attention scores + values: each visible (query, key) pair of each head costs 2*d_qk + 2*d_v.
  Causal: a sequence of T tokens has T*(T+1)/2 pairs; a sliding window w (a key at distance
  < w is visible, as in moejax) caps each query at min(t, w) keys.
- GQA projections: q (D -> H*hd), k and v (D -> Hkv*hd), o (H*hd -> D). MLA as moejax prefills it
  (expanded form): q (D -> H*(nope+rope)) or q_a (D -> r_q) + q_b (r_q -> H*(nope+rope)),
  kv_a (D -> r_kv + rope), kv_b (r_kv -> H*(nope+v)), o (H*v -> D); scores use d_qk = nope+rope.
- MoE layer: router 2*D*E per token; routed experts 6*D*I per token per active expert (k of E:
  gate, up, down); shared expert 6*D*S (+ 2*D for its gate). Dense-MLP layers 6*D*F per token.
- lm_head: 2*D*V per token at every position (`Engine.logits` scores every position) unless
  `all_logits=False` (one position per sequence).
- Parameter counts include biases, norms, embeddings and the lm_head; "active" counts the k routed
  experts a token uses instead of all E.
- Communication (`layout_comm`): bytes SENT per device per layer of one forward step, ring-style, for a group
  of P devices: all-gather of a result of R bytes (P-1)/P*R; reduce-scatter of an operand of O bytes
  (P-1)/P*O; all-reduce of S bytes 2(P-1)/P*S; all-to-all of an operand of O bytes (P-1)/P*O (the block for
  itself stays); collective-permute its operand. "As implemented" counts what moves, padding included
  (moejax.sharding.hlo_comm reads the same from compiled HLO); "ideal" is MoE-Prefill Table 1's figure
  (uniform routing, model dtype, no routing metadata). Expert ids (int32), routing weights, row flags and
  partial sums (float32) count 4 bytes whatever the model dtype. XLA:CPU widens 16-bit collectives to float32.
  DEP's transfers between its groups are `device_put`s between meshes (kind "device_put"), per sending device.
- Pipeline (attn=pp,experts=pp, moejax.sharding.pipeline_steps): its sends happen at stage boundaries, not in every
  layer; `attention` holds them as a mean per layer (the step's collective-permutes / the layers), `experts` is
  empty. Table 1's PP+PP row ("2 Send/Recv", its formula missing from the paper's text) is reconstructed as the
  useful traffic: each of the P-1 boundaries carries the N tokens' hidden states once (a send and a receive),
  per device and layer (P-1)/P * N*D*b / L.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from moejax.config import ModelConfig
from moejax.layout import Layout


@dataclasses.dataclass(frozen=True)
class PrefillFlops:
    attn_proj: int
    attn_scores: int
    router: int
    experts: int
    shared_experts: int
    dense_mlp: int
    lm_head: int

    @property
    def total(self) -> int:
        return sum(dataclasses.astuple(self))

    def as_dict(self) -> dict[str, int]:
        return {**dataclasses.asdict(self), "total": self.total}


def causal_pairs(T: int, window: int | None = None) -> int:
    """Visible (query, key) pairs in one causal sequence of T tokens: sum over t=1..T of min(t, w)."""
    w = T if window is None else min(window, T)
    return w * (w + 1) // 2 + (T - w) * w


def _attn_proj_params(cfg: ModelConfig) -> int:
    D, H = cfg.hidden_size, cfg.num_heads
    if cfg.attention == "mla":
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        q = D * cfg.q_lora_rank + cfg.q_lora_rank * H * qk if cfg.q_lora_rank else D * H * qk
        kv = (D * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
              + cfg.kv_lora_rank * H * (cfg.qk_nope_head_dim + cfg.v_head_dim))
        return q + kv + H * cfg.v_head_dim * D
    hd = cfg.head_dim
    return D * (H + 2 * cfg.num_kv_heads) * hd + H * hd * D


def _window(cfg: ModelConfig, layer: int) -> int | None:
    types = cfg.layer_types
    return cfg.sliding_window if types and types[layer] == "sliding" else None


def prefill_flops(cfg: ModelConfig, batch: int, seq: int, *, all_logits: bool = True) -> PrefillFlops:
    """FLOPs of one prefill forward of `batch` sequences of `seq` tokens (see module docstring)."""
    B, T, D = batch, seq, cfg.hidden_size
    N = B * T
    d_qk, d_v = (cfg.q_head_dim, cfg.v_head_dim) if cfg.attention == "mla" else (cfg.head_dim, cfg.head_dim)
    parts = {f.name: 0 for f in dataclasses.fields(PrefillFlops)}
    for layer in range(cfg.num_layers):
        parts["attn_proj"] += 2 * N * _attn_proj_params(cfg)
        parts["attn_scores"] += B * cfg.num_heads * causal_pairs(T, _window(cfg, layer)) * 2 * (d_qk + d_v)
        if cfg.is_moe(layer):
            parts["router"] += 2 * N * D * cfg.num_experts
            parts["experts"] += 6 * N * cfg.num_experts_per_tok * D * cfg.moe_intermediate_size
            if cfg.shared_expert_size:
                parts["shared_experts"] += 6 * N * D * cfg.shared_expert_size + 2 * N * D * cfg.shared_expert_gate
        else:
            parts["dense_mlp"] += 6 * N * D * cfg.intermediate_size
    parts["lm_head"] = 2 * (N if all_logits else B) * D * cfg.vocab_size
    return PrefillFlops(**parts)


def true_prefill_flops(cfg: ModelConfig, new_tokens: int, context: int = 0) -> float:
    """MoE-Prefill Eq. 2: the FLOPs of computing `new_tokens` of one sequence after `context` tokens whose KV is
    already there (a cached prefix): the decoder layers' matmuls for the new tokens only, and attention of the new
    tokens to the context and to each other (causal, windows as the layers have them). Embedding and head excluded.

    This is THE batch FLOPs of MoE-Prefill's Θ (Eq. 1, 3) and of its admission (§7.4): Θ (moejax.plan.theta,
    moejax.offload.saturation) and the FLOPs a scheduled batch holds (moejax.sched.batch_schedule.tree_flops) are
    both counted here. Attention is in: a layer's whole compute, attention and experts, runs while the next layer's
    experts are copied, and it grows with the context, so a long-context batch hides a copy with fewer tokens."""
    d_qk, d_v = (cfg.q_head_dim, cfg.v_head_dim) if cfg.attention == "mla" else (cfg.head_dim, cfg.head_dim)
    total = context + new_tokens
    pairs = sum(causal_pairs(total, _window(cfg, layer)) - causal_pairs(context, _window(cfg, layer))
                for layer in range(cfg.num_layers))
    return new_tokens * layer_flops_per_token(cfg) + cfg.num_heads * pairs * 2 * (d_qk + d_v)


def _layer_params(cfg: ModelConfig, layer: int, active: bool) -> int:
    D, H = cfg.hidden_size, cfg.num_heads
    n = 2 * D + _attn_proj_params(cfg)  # two norms + projections
    if cfg.attention == "mla":
        n += cfg.kv_lora_rank + (cfg.q_lora_rank or 0)  # latent norms
        if cfg.mla_bias:
            n += (cfg.q_lora_rank or 0) + cfg.kv_lora_rank + cfg.qk_rope_head_dim + D
    else:
        hd, K = cfg.head_dim, cfg.num_kv_heads
        n += (H + 2 * K) * hd * cfg.qkv_bias + D * cfg.o_bias + 2 * hd * cfg.qk_norm + H * cfg.sinks
    if not cfg.is_moe(layer):
        return n + 3 * D * cfg.intermediate_size + (2 * cfg.intermediate_size + D) * cfg.mlp_bias
    E, I, S = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_size
    n += D * E + E * (cfg.router_bias + cfg.score_correction_bias)
    experts = cfg.num_experts_per_tok if active else E
    n += experts * (3 * D * I + (2 * I + D) * cfg.expert_bias)
    if S:
        n += 3 * D * S + (2 * S + D) * cfg.mlp_bias + D * cfg.shared_expert_gate
    return n


def param_count(cfg: ModelConfig, *, active: bool = False) -> int:
    """Parameters of the model (`active=True`: those one token uses, k of the E routed experts)."""
    D = cfg.hidden_size
    head = 0 if cfg.tie_word_embeddings else D * cfg.vocab_size
    return cfg.vocab_size * D + head + D + sum(_layer_params(cfg, i, active) for i in range(cfg.num_layers))


def active_param_count(cfg: ModelConfig) -> int:
    return param_count(cfg, active=True)


def layer_flops_per_token(cfg: ModelConfig) -> float:
    """Matmul FLOPs per token through the decoder layers (embedding and head excluded; attention scores too): the
    FLOPs of a token with no context to attend to. Not Θ's unit (that is `true_prefill_flops`); Θ / this is the most
    tokens a batch needs to reach Θ (rows with context need fewer)."""
    return 2.0 * (active_param_count(cfg) - 2 * cfg.vocab_size * cfg.hidden_size)


# -- communication of a parallel layout (moejax.sharding) -------------------------------------------------------

_F32 = _I32 = 4  # routing weights, row flags and partial sums are float32, expert ids int32, whatever the dtype


@dataclasses.dataclass(frozen=True)
class Transfer:
    kind: str  # the HLO collective: all-gather, reduce-scatter, all-reduce, all-to-all
    what: str
    bytes_sent: float  # per device, ring convention (module docstring)


@dataclasses.dataclass(frozen=True)
class LayoutComm:
    """Per-device forward communication of one layout at one shape: what the implementation moves (`attention`
    in every layer, `experts` in every MoE layer's expert program, `first_experts` in the first one's) next to
    MoE-Prefill Table 1's figure for the same attention / expert strategies (`ideal_*`: useful traffic only, no
    padding, routing metadata or float32 partial sums)."""
    layout: str
    devices: int
    layers: int
    moe_layers: int
    attention: tuple[Transfer, ...]
    experts: tuple[Transfer, ...]
    first_experts: tuple[Transfer, ...]  # async_ep: the first MoE layer's experts are whole, nothing to gather
    ideal_attention: float
    ideal_experts: float

    @property
    def attention_bytes(self) -> float:
        return sum(t.bytes_sent for t in self.attention)

    @property
    def experts_bytes(self) -> float:
        return sum(t.bytes_sent for t in self.experts)

    def layer_by_kind(self, part: str) -> dict[str, float]:
        """Bytes per collective kind in one layer: part "attention" or "experts" (a MoE layer's program, past the
        first)."""
        return by_kind(self.attention if part == "attention" else self.experts)

    def step_by_kind(self, part: str) -> dict[str, float]:
        """Bytes per collective kind over the whole forward step: part "attention" (x layers) or "experts" (the
        first MoE layer's, then x the other MoE layers)."""
        if part == "attention":
            return by_kind(self.attention, self.layers)
        out = by_kind(self.experts, self.moe_layers - 1) if self.moe_layers else {}
        for kind, v in by_kind(self.first_experts if self.moe_layers else ()).items():
            out[kind] = out.get(kind, 0.0) + v
        return out

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def by_kind(transfers: Iterable[Transfer], times: int = 1) -> dict[str, float]:
    """Transfers -> bytes per collective kind (x times)."""
    out: dict[str, float] = {}
    for t in transfers:
        out[t.kind] = out.get(t.kind, 0.0) + t.bytes_sent * times
    return out


def layout_comm(cfg: ModelConfig, layout: Layout, batch: int, seq: int, dtype_bytes: int) -> LayoutComm:
    """Per-device, per-layer forward communication of `layout` (resolved: devices set) for one step over
    `batch` x `seq` tokens with activations and weights of `dtype_bytes` (see the module docstring)."""
    P = layout.devices
    if not P:
        raise ValueError(f"layout_comm: layout {layout} has no device count; resolve it first")
    if layout.experts == "dep":
        return _dep_comm(cfg, layout, batch, seq, dtype_bytes)
    if layout.attn == "pp":
        return _pipeline_comm(cfg, layout, batch, seq, dtype_bytes)
    if layout.attn == "dp" and batch % P:
        # the hidden states are split by batch rows: with uneven rows the partitioner reshards around every norm
        raise ValueError(f"layout_comm: attn=dp needs the batch ({batch}) to be a multiple of the {P} devices")
    D, b = cfg.hidden_size, dtype_bytes
    N = batch * seq
    n = -(-N // P)  # rows per device in the expert program (padded to a multiple of P)
    ring = (P - 1) / P
    attention: tuple[Transfer, ...]
    if layout.attn == "dp":
        attention, ideal_attention = (), 0.0
    else:  # heads split, every device holds every token: the output projection's partial sums are added
        attention = (Transfer("all-reduce", "attention output, float32 partial sums", 2 * ring * N * D * _F32),)
        ideal_attention = 2 * ring * N * D * b  # Table 1: one all-reduce of the attention output
    experts, ideal_experts = _expert_transfers(cfg, layout, N, n, b)
    outputs: tuple[Transfer, ...] = ()
    if layout.attn == "tp" and layout.experts != "tp":  # the program splits the tokens: outputs back to all
        outputs = (Transfer("all-gather", "expert outputs to every device", ring * n * P * D * b),)
    # async_ep keeps the first MoE layer's experts whole on every device (MoE-Prefill §6.2: nothing to gather
    # before the first layer; moejax.sharding.setup)
    first = outputs if layout.experts == "async_ep" else experts + outputs
    experts += outputs
    return LayoutComm(str(layout), P, cfg.num_layers, sum(cfg.moe_layers), attention, experts, first,
                      ideal_attention, ideal_experts)


def _dep_comm(cfg: ModelConfig, layout: Layout, batch: int, seq: int, b: int) -> LayoutComm:
    """DEP: per attention device, A->E its share of each padded token chunk (hidden state, expert ids, weights);
    per expert device, E->A its share of the outputs, plus EP inside the expert group on each chunk. Table 1
    has no DEP row: `ideal_*` is the useful A->E + E->A traffic (hidden states there and back, no padding)."""
    A, B, D, k = layout.attn_devices, layout.expert_devices, cfg.hidden_size, cfg.num_experts_per_tok
    assert A is not None and B is not None  # resolved: layout_comm checked
    padded_rows = -(-batch // layout.row_multiple) * layout.row_multiple  # the executor pads to a multiple of A·r1
    chunks = [c for rows in layout.micro_batches(padded_rows) for c in layout.token_chunks(rows * seq)]
    padded = sum(p for _, p in chunks)
    inner = Layout(attn="dp", experts="ep", devices=B, exchange=layout.exchange)
    inside: dict[tuple, float] = {}
    for _, p in chunks:
        for t in _expert_transfers(cfg, inner, p, p // B, b)[0]:
            inside[(t.kind, t.what)] = inside.get((t.kind, t.what), 0.0) + t.bytes_sent
    experts: tuple[Transfer, ...] = (
        Transfer("device_put", "A->E hidden states and routing (padded chunks), per attention device",
                 padded * (D * b + k * (_I32 + _F32)) / A),
        Transfer("device_put", "E->A routed outputs (padded chunks), per expert device", padded * D * b / B))
    experts += tuple(Transfer(kind, f"{what}, inside the expert group", v) for (kind, what), v in inside.items())
    return LayoutComm(str(layout), A + B, cfg.num_layers, sum(cfg.moe_layers), (), experts, experts, 0.0,
                      batch * seq * D * b * (1 / A + 1 / B))


def _pipeline_comm(cfg: ModelConfig, layout: Layout, batch: int, seq: int, b: int) -> LayoutComm:
    """Pipeline: one collective-permute of a micro-batch's hidden states after each of the M+P-1 ticks but the last
    (moejax.sharding.pipeline_steps's schedule; every device's operand counts, the last stage's too, as the HLO has
    it)."""
    S, M, D, L = layout.devices, layout.microbatches, cfg.hidden_size, cfg.num_layers
    assert S is not None and M is not None  # resolved: layout_comm checked
    if batch % M:
        raise ValueError(f"layout_comm: attn=pp needs the batch ({batch}) to be a multiple of its {M} micro-batches")
    sends = M + S - 2 if S > 1 else 0
    per_layer = sends * (batch // M) * seq * D * b / L
    attention = (Transfer("collective-permute", f"stage boundaries: {sends} sends of a micro-batch's hidden states, "
                          "mean per layer", per_layer),) if sends else ()
    return LayoutComm(str(layout), S, L, sum(cfg.moe_layers), attention, (), (),
                      (S - 1) / S * batch * seq * D * b / L, 0.0)


# MoE-Prefill Table 1's rows: (attention, experts) strategies
TABLE_1 = (("dp", "replicated"), ("dp", "tp"), ("dp", "ep"), ("tp", "tp"), ("tp", "ep"), ("pp", "pp"), ("sp", "tp"),
           ("sp", "ep"), ("dp", "async_ep"))


def table_1(cfg: ModelConfig, attn: str, experts: str, devices: int, batch: int, seq: int, dtype_bytes: int
            ) -> tuple[float, float]:
    """MoE-Prefill Table 1's per-device, per-layer forward bytes (attention, experts) for one of its rows (TABLE_1,
    "dp", "replicated" for its DP+DP), P = `devices`. The implemented rows are layout_comm's `ideal_*`. SP, which
    no layout implements (so nothing is checked against HLO), splits each sequence's tokens over the devices:
    attention all-gathers the other devices' keys and values ((P-1)/P of N tokens' k and v: GQA 2*Hkv*hd per
    token, MLA its latent and rope key), then the experts move tokens as under DP (SP+TP: an all-gather of the
    tokens and a reduce-scatter of the outputs, Table 1's "2 All-Gather + 1 Reduce-Scatter" with the attention's;
    SP+EP: the two all-to-alls, "1 All-Gather + 2 All-to-All")."""
    if (attn, experts) not in TABLE_1:
        raise ValueError(f"table_1: attn={attn},experts={experts} is not one of Table 1's rows "
                         f"({', '.join(f'{a}+{e}' for a, e in TABLE_1)})")
    if attn != "sp":
        comm = layout_comm(cfg, Layout(attn=attn, experts=experts, devices=devices,
                                       microbatches=devices if attn == "pp" else None), batch, seq, dtype_bytes)
        return comm.ideal_attention, comm.ideal_experts
    P, N, b, D = devices, batch * seq, dtype_bytes, cfg.hidden_size
    ring = (P - 1) / P
    if cfg.attention == "mla":
        kv = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    else:
        kv = 2 * cfg.num_kv_heads * cfg.head_dim
    experts_bytes = 2 * ring * N * D * b if experts == "tp" else _ideal_ep(ring, N, P, cfg.num_experts_per_tok, D, b)
    return ring * N * kv * b, experts_bytes


def _expert_transfers(cfg: ModelConfig, layout: Layout, N: int, n: int, b: int
                      ) -> tuple[tuple[Transfer, ...], float]:
    """(what moejax.sharding.experts moves per MoE layer, Table 1's figure)."""
    P, D, k, E, I = layout.devices, cfg.hidden_size, cfg.num_experts_per_tok, cfg.num_experts, cfg.moe_intermediate_size
    assert P is not None  # resolved: layout_comm checked
    ring, rows = (P - 1) / P, n * P
    bias = cfg.expert_bias
    if layout.experts == "replicated":
        return (), 0.0
    if layout.experts == "async_ep":  # each layer's full expert set gathered (off the critical path: async)
        arrays = {"we_gate_up": E * D * 2 * I, "we_down": E * I * D, "be_gate_up": E * 2 * I * bias,
                  "be_down": E * D * bias}
        gathers = tuple(Transfer("all-gather", f"{name} of {E} experts", ring * size * b)
                        for name, size in arrays.items() if size)
        return gathers, sum(t.bytes_sent for t in gathers)
    if layout.experts == "tp" and layout.attn == "tp":  # every device holds every token: sum the width slices
        return (Transfer("all-reduce", "expert outputs, float32 partial sums", 2 * ring * rows * D * _F32),), \
            2 * ring * N * D * b
    if layout.experts == "tp" or layout.exchange == "gather":  # tokens to every device, partial outputs back
        moved = (Transfer("all-gather", "tokens", ring * rows * D * b),
                 Transfer("all-gather", "expert ids", ring * rows * k * _I32),
                 Transfer("all-gather", "routing weights", ring * rows * k * _F32),
                 Transfer("reduce-scatter", "expert outputs, float32 partial sums", ring * rows * D * _F32))
        ideal = 2 * ring * N * D * b if layout.experts == "tp" else _ideal_ep(ring, N, P, k, D, b)
        return moved, ideal
    # ep, all_to_all: dropless buffers of P x n*k rows, of which a device sends the P-1 not its own
    buffer = P * n * k
    return (Transfer("all-to-all", "token rows (padded)", ring * buffer * D * b),
            Transfer("all-to-all", "expert ids (padded)", ring * buffer * _I32),
            Transfer("all-to-all", "row flags (padded)", ring * buffer * _F32),
            Transfer("all-to-all", "outputs back (padded)", ring * buffer * D * b)), \
        _ideal_ep(ring, N, P, k, D, b)


def _ideal_ep(ring: float, N: int, P: int, k: int, D: int, b: int) -> float:
    """Table 1's DP/EP (and TP/EP) pair of all-to-alls under uniform routing: each device's N/P tokens x k
    choices, (P-1)/P of them to other devices, there and back."""
    return 2 * ring * N / P * k * D * b
