"""The figure of `launch.bench predictors --plot`: recall per target layer (distance 1), then Speculating Experts'
Fig. 3 (cosine drift against layer distance) and Fig. 5 (hit rate by the true expert's rank, per distance) beside
it. matplotlib is the optional `plots` extra, imported only here."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # matplotlib is imported where it draws: the optional plots extra
    from matplotlib.axes import Axes  # optional: the plots extra


def plot(recall: list[dict], analyses: dict | None, path: str) -> None:
    try:
        import matplotlib  # optional: the plots extra
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install -e '.[plots]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional: the plots extra
    panels = 1 if analyses is None else 3
    fig, axes = plt.subplots(1, panels, figsize=(7 * panels, 4), squeeze=False)
    _recall(axes[0][0], recall)
    if analyses is not None:
        _drift(axes[0][1], analyses["cosine_drift"])
        _alignment(axes[0][2], analyses["rank_alignment"])
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _recall(ax: Axes, recall: list[dict]) -> None:
    rows = [r for r in recall if r["distance"] == 1]
    for r in rows:
        layers = [int(t) for t in r["per_layer"]]
        ax.plot(layers, list(r["per_layer"].values()), marker="o", label=f"{r['predictor']} ({r['overall']:.2f})")
    ax.set_xticks(sorted({int(t) for r in rows for t in r["per_layer"]}))
    ax.set_xlabel("target MoE layer")
    ax.set_ylabel("recall of the true top-k (distance 1)")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()


def _drift(ax: Axes, drift: list[dict]) -> None:
    """Mean cosine to the true router input against distance, one line per representation (d = 0: 1)."""
    start = next((r["mean"] for r in drift if r["distance"] == 0), None)
    for rep in ("previous_hidden", "quasi_hidden"):
        rows = sorted((r for r in drift if r["representation"] == rep), key=lambda r: r["distance"])
        xs, ys = [r["distance"] for r in rows], [r["mean"] for r in rows]
        if start is not None:
            xs, ys = [0] + xs, [start] + ys
        ax.plot(xs, ys, marker="o", label=rep)
    ax.set_xlabel("layer distance d (MoE layers)")
    ax.set_ylabel("mean cosine to layer l+d's router input")
    ax.set_xticks(sorted({r["distance"] for r in drift}))
    ax.grid(alpha=0.3)
    ax.legend()


def _alignment(ax: Axes, alignment: list[dict]) -> None:
    """Hit rate of the true rank-r expert in the quasi-hidden prediction, one line per distance."""
    for r in sorted((r for r in alignment if r["representation"] == "quasi_hidden"), key=lambda r: r["distance"]):
        ranks = list(range(1, len(r["hit_rate_by_rank"]) + 1))
        ax.plot(ranks, r["hit_rate_by_rank"], marker="o",
                label=f"d={r['distance']} (Spearman {r['spearman']:.2f})")
    ax.set_xticks(range(1, 1 + max((len(r["hit_rate_by_rank"]) for r in alignment), default=1)))
    ax.set_xlabel("rank of the true expert (by routing weight)")
    ax.set_ylabel("hit rate in the predicted top-k (quasi_hidden)")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
