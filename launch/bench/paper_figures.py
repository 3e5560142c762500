"""The figures `python -m launch.bench paper NAME` runs: for each paper, the benchmarks that stand in for its tables
and figures, the command line at 2-core CPU sizes (and at GPU sizes where one exists), which of the paper's numbers
each corresponds to and what differs, and how to read the plotted values out of the benchmark's record."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

Series = dict[str, tuple[list, list]]  # label -> (x values, y values); x names draw bars, x numbers draw lines

CPU = "CPU (2 cores), not a GPU: the mechanism and its ratios at small sizes"
PYCODE = ("pycode-moe (the embedded 15M-parameter model trained on Python code), not the paper's models; traces of "
          "held-out Python standard library code, not the paper's datasets")
PREDICTORS = ("predictors", "--stdlib", "held_out", "--train-stdlib", "train", "--tokens", "1024", "--train-tokens",
              "8192", "--distill-steps", "300", "--cache-tokens", "256", "--speculative-windows", "1",
              "--capacities", "1,16,256")
GPU_MODEL = ("--model", "qwen3-30b-a3b", "--num-layers", "4", "--dtype", "bfloat16")  # as launch.gpu_check's
LIGHTNING_ROWS = "lightning,lightning-host-ffn,lightning-swapped-kv,streamed,cached"
DECODE_MODES = ("offload", "--sections", "decode", "--quick", "--new-tokens", "32", "--repeats", "3", "--modes",
                "on-demand,prefetch,estimator,expert_map,expert_map-T+S,expert_map-T,moe_infinity")
DECODE_CPU = (CPU + "; tiny-qwen3-moe, batch 1, maps and estimator calibrated on 2 random prompts. On a CPU a copy is "
              "a memcpy of little cost, so TPOT and TTFT differ within noise; the hit rate is the comparable number")


@dataclasses.dataclass(frozen=True)
class Figure:
    name: str
    corresponds: str  # the paper's table or figure and the number it reports
    differs: str  # model, device, scale against the paper's setting
    argv: tuple[str, ...]  # `python -m launch.bench ...` at 2-core CPU sizes
    series: Callable[[dict], Series]
    x_label: str
    y_label: str
    gpu_argv: tuple[str, ...] | None = None  # at GPU sizes (--gpu); None: the CPU command
    cpu_devices: int = 1  # simulated CPU devices the benchmark needs
    log_x: bool = False


def _by(rows: Sequence[dict], label: str, x: str, y: Callable[[dict], float | None]) -> Series:
    """rows grouped by `label`, each group's (x, y) in row order; rows whose y is None left out."""
    out: Series = {}
    for row in rows:
        value = y(row)
        if value is not None:
            xs, ys = out.setdefault(str(row[label]), ([], []))
            xs.append(row[x])
            ys.append(value)
    return out


def _frontend(record: dict) -> Series:
    rows = [dict(r, routing=f"{w['workload']['name']} {r['routing']}") for w in record["workloads"]
            for r in w["rows"]]
    return _by(rows, "routing", "replicas", lambda r: r["tokens_per_s"])


def _orders(record: dict) -> Series:
    rows = record["results"]
    orders = [r["order"] for r in rows]
    return {"seconds, all requests": (orders, [r["seconds_median"] for r in rows]),
            "mean wait, longest tenth (s)": (orders, [r["wait"]["longest"]["mean_s"] for r in rows]),
            "mean wait, all (s)": (orders, [r["wait"]["all"]["mean_s"] for r in rows])}


def _workloads(record: dict) -> Series:
    rows = [dict(r, kv=f"prefix cache {r['kv_cache']}") for r in record["results"]]
    return _by(rows, "kv", "workload", lambda r: r["tokens_per_s"])


def _tier2(record: dict) -> Series:
    names = ["scoring", "generation", "agreement", "chance"]
    return {"share of questions": (names, [record["scoring_accuracy"], record["generation_accuracy"],
                                          record["agreement"], record["chance"]])}


def _layout_bytes(record: dict) -> Series:
    rows = [r for r in record["rows"] if r.get("analytic", {}).get("modelled")]

    def total(part: dict) -> float:
        return float(sum(v for v in part.values() if isinstance(v, (int, float))))
    labels = [r["label"] for r in rows]
    return {"analytic bytes / device / layer": (labels, [total(r["analytic"]["attention"]) +
                                                        total(r["analytic"]["experts"]) for r in rows]),
            "measured (compiled HLO)": (labels, [total(r["measured"]["attention"]) + total(r["measured"]["experts"])
                                                 for r in rows])}


def _router_free(record: dict) -> Series:
    rows = record["rows"]
    return {k: ([f"batch {r['batch']}" for r in rows], [r["tpot_s"][k] * 1e3 for r in rows])
            for k in ("router_skipped", "router_counted")}


def _dep(record: dict) -> Series:
    rows = record["dep"]["results"] if record.get("dep") else []
    names = [r["name"] for r in rows]
    return {"measured tokens/s": (names, [r["tokens_per_s"] for r in rows]),
            "predicted tokens/s / 10": (names, [r["predicted_tokens_per_s"] / 10 for r in rows])}


def _dep_online(record: dict) -> Series:
    return {f"{s['model']} ({s['devices']} devices)":
            ([f"{x['rows']}x{x['tokens_per_row']}" for x in s["shapes"]],
             [x["predicted_speedup_vs_load_schedule"] for x in s["shapes"]]) for s in record["solver"]}


def _a2e(record: dict) -> Series:
    rows = record["results"]
    return {route: ([r["layout"].split("experts=dep,")[-1][:24] for r in rows],
                    [r["routes"][route]["seconds_median"] * 1e3 for r in rows]) for route in ("straight", "regroup")}


def _ablation(record: dict) -> Series:
    runs = record["runs"]
    return {"output tokens/s": ([r["schedule"] for r in runs], [r["tokens_per_s"] for r in runs])}


def _host_attention(record: dict) -> Series:
    rows = record["rows"]
    contexts = [r["context"] for r in rows]
    return {name: (contexts, [r[key] * 1e3 for r in rows]) for name, key in (
        ("attention on the host", "host_s"), ("KV copied to the device + attention there", "move_s"),
        ("the copy alone", "copy_s"))}


def _lightning(record: dict) -> Series:
    runs = [r for r in record["runs"] if "tokens_per_s" in r]  # (a policy the budget cannot hold is refused)
    rows = [r.get("mode", r["placement"]) for r in runs]
    return {"output tokens/s": (rows, [r["tokens_per_s"] for r in runs]),
            "largest decode batch x 10": (rows, [r["peak_rows"] * 10 for r in runs])}


def _recall(record: dict) -> Series:
    return _by([r for r in record["recall"] if r["predictor"] != "oracle"], "predictor", "distance",
               lambda r: r["overall"])


def _analysis(kind: str, value: str) -> Callable[[dict], Series]:
    return lambda record: _by(record["analyses"][kind], "representation", "distance", lambda r: r[value])


def _tpot_sweep(record: dict) -> Series:
    points = record["points"]
    contexts = [p["context"] for p in points]
    out: Series = {}
    for name in points[0]["placements"]:
        out[f"{name} measured"] = (contexts, [p["placements"][name]["tpot_s"] * 1e3 for p in points])
        out[f"{name} Eq. 1 bound"] = (contexts, [p["placements"][name]["bound"]["overlapped_s"] * 1e3
                                                 for p in points])
    return out


def _decode_modes(record: dict) -> Series:
    rows = record["decode"]["rows"]
    modes = [r["mode"] for r in rows]
    return {"TPOT (ms)": (modes, [r["tpot_s"] * 1e3 for r in rows]),
            "TTFT (ms)": (modes, [r["ttft_s"] * 1e3 for r in rows]),
            "expert-cache hit rate x 100": ([r["mode"] for r in rows if "stats" in r],
                                            [r["stats"]["hit_rate"] * 100 for r in rows if "stats" in r])}


def _map_variants(record: dict) -> Series:
    variants = record["expert_map_ablation"]["variants"]
    names = [v["variant"] for v in variants]
    best = [max(c["hit_rate"] for c in v["cache"] if c["policy"] == "lru") for v in variants]
    return {"recall of the next layer's experts": (names, [v["recall"] for v in variants]),
            "lru cache hit rate, most slots": (names, best)}


def _store_size(record: dict) -> Series:
    sizes = record["expert_map_ablation"]["store_sizes"]
    capacities = [s["capacity"] for s in sizes]
    return {name: (capacities, [s[key] for s in sizes]) for name, key in (
        ("semantic similarity", "semantic_score"), ("trajectory similarity", "trajectory_score"),
        ("recall", "recall"))}


def _eviction(record: dict) -> Series:
    return _by([r for r in record["cache"] if r["prefetch"] == "expert_map"], "policy", "slots",
               lambda r: r["hit_rate"])


def _estimator_layers(record: dict) -> Series:
    rows = [r for r in record["recall"] if r["distance"] == 1 and r["predictor"] in ("router", "estimator", "hybrid")]
    return {r["predictor"]: ([int(k) for k in r["per_layer"]], list(r["per_layer"].values())) for r in rows}


PAPERS: dict[str, list[Figure]] = {
    "moe-prefill": [
        Figure("fig10-frontend-routing",
               "MoE-Prefill Fig. 10, the frontend's share of the gain: prefix-aware routing against round robin, "
               "random and least requests in flight (vLLM's router) over 2-16 replicas",
               "simulated from a hardware profile (h100 datasheet, Qwen3-30B-A3B FLOPs), not measured replicas; "
               "fewer replicas and requests than the paper",
               ("frontend", "--workloads", "short", "--replicas", "2,4,8,16", "--requests", "3000"),
               _frontend, "replicas", "predicted prompt tokens/s", log_x=True),
        Figure("s8-1-prefillonly-order",
               "MoE-Prefill §8.1 group ii: PrefillOnly's shortest-prefill-first against Θ-batching (batches "
               "filled to Θ, longest first) under --placement streamed: throughput and the wait of the longest "
               "requests",
               CPU + "; tiny-qwen3-moe, 32 scoring requests of 16-256 tokens; Θ by Eq. 1 on the T4 datasheet "
               "profile (a CPU has none): the batch a T4 needs to hide the copies, far larger than this CPU needs",
               ("serve", "--workloads", "mixed", "--kv-modes", "off", "--orders", "longest,spf", "--requests", "32",
                "--prefix", "128", "--suffix", "16", "--max-batch-tokens", "512", "--no-resident", "--repeats", "2",
                "--placement", "streamed", "--profile", "t4"),
               _orders, "order", "seconds",
               gpu_argv=("serve", "--workloads", "mixed", "--kv-modes", "off", "--orders", "longest,spf",
                         "--no-resident", "--placement", "streamed", *GPU_MODEL)),
        Figure("s8-workloads",
               "MoE-Prefill §8 workloads: scoring throughput under its context regimes (short prompts over shared "
               "prefixes, long contexts, multi-selection, a mix) with the prefix cache on and off, and the device "
               "memory each run holds (in the record: XLA's peak where the backend reports it, the budget's estimate)",
               CPU + " (no peak memory: the CPU backend reports none); tiny-qwen3-moe, 24 requests per regime",
               ("serve", "--workloads", "shared-prefix,long-context,multi-select,mix", "--requests", "24", "--prefix",
                "128", "--suffix", "16", "--prefixes", "4", "--long-requests", "2", "--kv-modes", "on,off",
                "--max-batch-tokens", "2048", "--repeats", "1", "--no-resident"),
               _workloads, "workload", "prompt tokens/s",
               gpu_argv=("serve", "--workloads", "shared-prefix,long-context,multi-select,mix", "--kv-modes",
                         "on,off", *GPU_MODEL)),
        Figure("tables3-4-tier2-accuracy",
               "MoE-Prefill §8.6, Tables 3-4: multiple-choice accuracy by prefill-only scoring of the candidates "
               "against greedy generation mapped to the candidate it begins with, and how often they agree",
               PYCODE + "; 40 next-line questions (4 choices) from held-out standard library code, not the "
               "paper's benchmarks; a 15M model rarely generates the exact line, so generation scores low",
               ("quality", "--tier2", "--stdlib", "held_out", "--questions", "40"), _tier2, "mode",
               "share of questions"),
        Figure("table1-comm-bytes",
               "MoE-Prefill Table 1: bytes each device sends per layer under each parallel layout, the analytic "
               "model beside the compiled program's collectives",
               "8 simulated CPU devices, tiny-qwen3-moe; bytes are exact, times are not a GPU's",
               ("layouts", "--repeats", "3", "--layouts", "attn=dp,experts=tp;attn=dp,experts=ep;"
                "attn=dp,experts=async_ep;attn=tp,experts=tp,devices=4;attn=tp,experts=ep,devices=4"),
               _layout_bytes, "layout", "bytes per device per layer", cpu_devices=8),
    ],
    "speculating-experts": [
        Figure("router-free-tpot",
               "Speculating Experts §4, speculative execution: time per output token with the true router "
               "skipped, against the same engine computing it",
               CPU + "; tiny model, batch 1 and 4, 16 new tokens",
               ("router-free", "--repeats", "3", "--new-tokens", "16", "--batch", "4"),
               _router_free, "batch", "ms per output token"),
        Figure("fig8-tpot-sweep",
               "Speculating Experts Fig. 8 and Eq. 1: batch-1 TPOT over context lengths for the resident, cached "
               "(experts copied on demand) and streamed placements, each beside Eq. 1's bound (max of the compute "
               "and the copy time per token)",
               CPU + "; tiny-wide-experts (2 layers, 12 MiB experts so that copies count), contexts 64 and 512, "
               "timed in this process's CPU seconds (a shared machine stretches wall time unevenly)",
               ("tpot-sweep", "--clock", "cpu", "--repeats", "2"), _tpot_sweep, "context length (tokens)",
               "ms per output token", gpu_argv=("tpot-sweep",), log_x=True),
        Figure("fig3-cosine-drift",
               "Speculating Experts Fig. 3: cosine similarity of the quasi-hidden state (and default-vector "
               "variants) to the true hidden state by layer distance", PYCODE, PREDICTORS,
               _analysis("cosine_drift", "mean"), "layers ahead", "mean cosine similarity"),
        Figure("fig5-rank-alignment",
               "Speculating Experts Fig. 5: rank alignment (Spearman) of the predicted expert scores with the "
               "true router's by layer distance", PYCODE, PREDICTORS,
               _analysis("rank_alignment", "spearman"), "layers ahead", "Spearman correlation"),
        Figure("fig4-predictor-recall",
               "Speculating Experts Fig. 4: recall@k of the true top-k experts by each predictor (router "
               "on the quasi-hidden state, distilled estimator, hybrid) by distance",
               PYCODE + "; the estimator distilled for 300 steps on 8K tokens (the paper: millions)", PREDICTORS,
               _recall, "layers ahead", "recall of the true top-k"),
        Figure("fig10-hit-rate-per-layer",
               "Speculating Experts Fig. 10: per-layer hit rate of the trained estimator (and the router on the "
               "quasi-hidden state, and the hybrid) one layer ahead", PYCODE + "; the estimator distilled for 300 "
               "steps on 8K tokens (the paper: millions)", PREDICTORS, _estimator_layers, "MoE layer",
               "recall of the true top-k"),
        Figure("decode-tpot-by-predictor",
               "Speculating Experts Fig. 8 at one prompt length: decode time per output token with cached "
               "experts, loaded on demand against prefetched by the router and the estimator (and fMoE's maps)",
               DECODE_CPU, DECODE_MODES, _decode_modes, "mode", "value"),
    ],
    "findep": [
        Figure("solver-and-dep",
               "FinDEP Tables 5-6: DEP as the solver configures it against the default split and PPPipe, "
               "measured, beside the solver's prediction and its run time",
               "8 simulated CPU devices (no GPU interconnect): the predicted column is an H100 profile's, the "
               "measured one is CPU time", ("plans", "--quick", "--repeats", "3"), _dep, "schedule", "tokens/s",
               cpu_devices=8),
        Figure("online-resolve",
               "FinDEP §5 online phase: the schedule re-solved per step shape, predicted speed-up over the "
               "schedule solved at load", "presets priced on datasheet profiles (no devices); CPU time for the "
               "solves", ("dep-online", "--repeats", "2", "--requests", "16"), _dep_online, "step shape",
               "predicted speed-up over the load-time schedule", cpu_devices=8),
        Figure("a2e-route",
               "FinDEP's A2E: activations straight to the experts' owners against regrouped by an all-to-all "
               "inside the expert group", "8 simulated CPU devices, tiny model",
               ("dep-a2e", "--repeats", "3"), _a2e, "layout", "ms per forward", cpu_devices=8),
    ],
    "moe-lightning": [
        Figure("throughput-vs-offload",
               "MoE-Lightning Fig. 7: generation throughput of CGOPipe against FlexGen-style layer streaming "
               "(streamed) and an expert cache at one device memory budget, with the other policies its search "
               "considers: the FFN on the host (F_g = 0) and attention on the device over KV swapped in from the "
               "host (A_g = 1, r_c < 1, FlexGen's S4)",
               CPU + "; the accelerator and the host are the same cores, so only overhead and overlap show; 16 "
               "requests of 32 + 16 tokens at the benchmark's default budget",
               ("lightning", "--requests", "16", "--prompt-len", "32", "--new-tokens", "16", "--device-rows", "4",
                "--placements", LIGHTNING_ROWS), _lightning,
               "placement", "value", gpu_argv=("lightning", "--placements", LIGHTNING_ROWS, *GPU_MODEL)),
        Figure("table5-flexgen-schedule",
               "MoE-Lightning §6.1, Table 5: FlexGen's schedule run with MoE-Lightning's policy against CGOPipe "
               "with the same policy (one engine, the same compiled programs, rounds alternating the order)",
               CPU + " (the host's tasks on a second CPU device); pycode-moe, 16 requests of 32 + 16 tokens",
               ("lightning-ablation",), _ablation, "schedule", "output tokens/s"),
        Figure("fig9-host-attention",
               "MoE-Lightning Fig. 9: one layer's decode attention on the host against copying its KV cache to "
               "the device and attending there, by context length",
               CPU + " (the device is a second CPU device: the copy is a memcpy, not PCIe); Mixtral 8x7B's "
               "attention shapes, batch 4", ("host-attention", "--repeats", "3"), _host_attention,
               "context length (tokens)", "ms per decode step", log_x=True),
    ],
    "fmoe": [
        Figure("fig9-latency-by-prefetcher",
               "fMoE Fig. 9: TTFT, TPOT and expert hit rate with expert maps prefetching against MoE-Infinity's "
               "activation matrices, the router, the estimator and no prefetch (LRU only)",
               DECODE_CPU, DECODE_MODES, _decode_modes,
               "mode", "value"),
        Figure("fig12a-map-ablation",
               "fMoE §6.5, Fig. 12a: Map (T) against T+S and T+S+δ, and the coarse request-level hit counts: "
               "recall and expert-cache hit rate", PYCODE, PREDICTORS, _map_variants, "variant", "share"),
        Figure("fig12b-eviction",
               "fMoE §6.5, Fig. 12b: expert-cache hit rate of LRU and LFU eviction against fMoE's priority "
               "eviction, each with the expert maps prefetching, by cache size", PYCODE, PREDICTORS, _eviction,
               "cache slots", "hit rate"),
        Figure("fig14a-store-capacity",
               "fMoE §6.6, Fig. 14a: the expert-map store's capacity against the mean semantic and trajectory "
               "similarity of the matched maps, with their recall", PYCODE, PREDICTORS, _store_size,
               "maps in the store", "score / share", log_x=True),
    ],
}
