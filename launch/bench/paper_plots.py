"""One plot per paper figure, drawn from the benchmark's record by the figure's own `series`: lines where x is a
number, grouped bars where x is a name. matplotlib is the plots extra's; without it the figure's JSON is written
and the plot's entry says why there is none."""
from __future__ import annotations

from launch.bench.paper_figures import Figure


def draw(fig: Figure, record: dict, path: str) -> str:
    """Writes the PNG at `path`; returns the path, or why there is no plot."""
    try:
        import matplotlib  # optional: the plots extra

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # optional: the plots extra
    except ImportError:
        return "no plot: matplotlib is not installed (pip install '.[plots]')"
    series = fig.series(record)
    if not series:
        return "no plot: the record has none of the figure's values"
    figure, ax = plt.subplots(figsize=(6.4, 4.0))
    names = [x for xs, _ in series.values() for x in xs if isinstance(x, str)]
    if names:  # grouped bars: one group per name, one bar per series
        groups = list(dict.fromkeys(names))
        width = 0.8 / len(series)
        for i, (label, (xs, ys)) in enumerate(series.items()):
            at = [groups.index(x) + i * width for x in xs]
            ax.bar(at, ys, width, label=label)
        ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))], groups, rotation=20, ha="right")
    else:
        for label, (xs, ys) in series.items():
            ax.plot(xs, ys, marker="o", label=label)
        if fig.log_x:
            ax.set_xscale("log", base=2)
    ax.set_xlabel(fig.x_label)
    ax.set_ylabel(fig.y_label)
    ax.set_title(fig.corresponds, fontsize=8, wrap=True)
    if len(series) > 1:
        ax.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
