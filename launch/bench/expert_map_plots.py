"""fMoE's figures from the benchmark records (matplotlib, the optional `plots` extra, imported only here):

- decode(record, path): `launch.bench offload --plot`: TTFT, TPOT (slope and decode-loop wall time per step) and
  the decode loop's expert hit rate of each cached mode, the resident model's times as a line;
- ablation(record, path): `launch.bench predictors --maps-plot`: cache hit rate of Map (T) / (T+S) / (T+S+δ)
  prefetching at each slot count (fMoE Fig. 12a), and the store capacity against the similarity scores found and
  the hit rate (Fig. 14a)."""
from __future__ import annotations

from types import ModuleType


def _pyplot() -> ModuleType:  # matplotlib.pyplot
    try:
        import matplotlib  # optional: the plots extra
    except ImportError:
        raise SystemExit("plots need matplotlib: pip install -e '.[plots]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional: the plots extra
    return plt


def decode(record: dict, path: str) -> None:
    plt = _pyplot()
    rows = [r for r in record["rows"] if r["mode"] != "resident"]
    resident = next(r for r in record["rows"] if r["mode"] == "resident")
    names = [r["mode"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(18, 4))
    panels = [("TTFT (ms)", [r["ttft_s"] * 1e3 for r in rows], resident["ttft_s"] * 1e3),
              ("time per output token (ms)", None, resident["tpot_s"] * 1e3),
              ("decode-loop expert hit rate", [r["stats"]["hit_rate"] for r in rows], None)]
    for ax, (label, values, line) in zip(axes, panels, strict=True):
        if values is None:  # TPOT: the slope and the loop's own wall time per step side by side
            xs = range(len(rows))
            ax.bar([x - 0.2 for x in xs], [r["tpot_s"] * 1e3 for r in rows], 0.4, label="slope of two lengths")
            ax.bar([x + 0.2 for x in xs], [r["decode_loop_s_per_token"] * 1e3 for r in rows], 0.4,
                   label="decode loop s / step")
            ax.legend()
        else:
            ax.bar(range(len(rows)), values)
        if line is not None:
            ax.axhline(line, color="black", linestyle="--", linewidth=1, label="resident")
        ax.set_xticks(range(len(rows)), names, rotation=20)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def ablation(record: dict, path: str) -> None:
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4))
    variants = record["variants"]
    lru = [[c for c in v["cache"] if c["policy"] == "lru"] for v in variants]
    slots = [c["slots"] for c in lru[0]]
    width = 0.8 / len(variants)
    for i, (v, cache) in enumerate(zip(variants, lru, strict=True)):
        left.bar([x + i * width for x in range(len(slots))], [c["hit_rate"] for c in cache], width,
                 label=f"Map ({v['variant']}), recall {v['recall']:.2f}")
    left.set_xticks([x + width * (len(variants) - 1) / 2 for x in range(len(slots))], [f"{s} slots" for s in slots])
    left.set_ylabel("LRU cache hit rate, maps prefetching")
    left.set_ylim(0, 1)
    left.grid(alpha=0.3, axis="y")
    left.legend()
    sizes = record["store_sizes"]
    caps = [s["capacity"] for s in sizes]
    right.plot(caps, [s["semantic_score"] for s in sizes], marker="o", label="semantic score")
    right.plot(caps, [s["trajectory_score"] for s in sizes], marker="o", label="trajectory score")
    right.plot(caps, [s["lru_hit_rate"] for s in sizes], marker="s",
               label=f"hit rate (T+S+δ, LRU {sizes[0]['lru_slots']} slots)")
    right.set_xscale("log", base=2)
    right.set_xlabel("expert-map store capacity (maps)")
    right.set_ylim(0, 1)
    right.grid(alpha=0.3)
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
