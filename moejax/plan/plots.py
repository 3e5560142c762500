"""Plots of plans (matplotlib, the `plots` extra, imported only here and only when a plot is drawn): a Gantt chart
of the DEP pipeline from the simulator's events, and Θ against batch FLOPs. (The roofline lives beside the HRM in
moejax.plan.lightning.)"""
from __future__ import annotations

import os
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure  # optional: the plots extra (annotations only)


def _pyplot() -> ModuleType:  # matplotlib.pyplot
    try:
        import matplotlib  # optional: the plots extra
    except ImportError:
        raise RuntimeError("plots need matplotlib: pip install 'moejax[plots]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional: the plots extra
    return plt


def gantt(schedules: dict, path: str, title: str = "") -> str:
    """schedules: name (e.g. ASAS) -> (makespan, [(resource, label, start, end)]) from moejax.plan.dep_sim or a
    lightning probe (moejax.measure.lightning_probe); one panel per schedule, one row per resource. Writes a PNG;
    returns its path."""
    plt = _pyplot()
    fig, axes = plt.subplots(len(schedules), 1, figsize=(12, 2.2 * len(schedules)), squeeze=False)
    colors = {"attn": "tab:blue", "shared": "tab:cyan", "a2e": "tab:orange", "experts": "tab:green",
              "e2a": "tab:red", "combine": "tab:gray", "preattn": "tab:cyan", "postattn": "tab:green",
              "cpuattn": "tab:blue", "offloadqkv": "tab:orange", "loadh": "tab:red", "w_pintog": "tab:gray"}
    order = ["AG", "A2E", "EG", "E2A", "device", "host", "link h2d", "link d2h"]
    end_all = max(makespan for makespan, _ in schedules.values())
    for ax, (name, (makespan, events)) in zip(axes[:, 0], schedules.items(), strict=True):
        resources = sorted({e[0] for e in events}, key=lambda r: order.index(r) if r in order else 9)
        for resource, label, start, end in events:
            kind = label.split("(")[0].split()[0].lower()
            ax.barh(resources.index(resource), (end - start) * 1e3, left=start * 1e3, height=0.6,
                    color=colors.get(kind, "tab:purple"), edgecolor="black", linewidth=0.3)
        ax.set_yticks(range(len(resources)), resources)
        ax.set_xlim(0, end_all * 1e3 * 1.02)
        ax.set_title(f"{name}: {makespan * 1e3:.2f} ms", fontsize=9, loc="left")
        ax.invert_yaxis()
    axes[-1, 0].set_xlabel("ms")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return _save(fig, plt, path)


def theta_plot(curve: list[tuple[float, float, float]], theta_flops: float, path: str, title: str = "") -> str:
    """curve: (batch FLOPs, compute-only s, with-transfers s) per MoE layer; Θ marked. Writes a PNG."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    flops = [c[0] for c in curve]
    ax.loglog(flops, [c[1] * 1e3 for c in curve], label="compute only")
    ax.loglog(flops, [c[2] * 1e3 for c in curve], "--", label="with expert transfers (overlapped)")
    ax.axvline(theta_flops, color="black", linewidth=0.8)
    ax.text(theta_flops, ax.get_ylim()[0], " Θ", va="bottom")
    ax.set_xlabel("batch FLOPs (whole forward)")
    ax.set_ylabel("ms per MoE layer")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, plt, path)


def _save(fig: Figure, plt: ModuleType, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
