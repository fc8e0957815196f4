"""Stacked bars of per-GPU memory by component, with the budget as a line (suggest/estimate --plot).

matplotlib is an optional dependency (pip install memkit[plot]); it is imported only here, only
when a plot is asked for, with the non-interactive Agg backend so it works on headless servers.
"""
from __future__ import annotations

import textwrap

from memkit.errors import MemkitError
from memkit.units import GIB

OTHER = "other"
MAX_COMPONENTS = 8
"""Components beyond the largest eight (over all bars) are summed into 'other' to keep it legible."""


def stack_components(items) -> tuple[list[str], list[list[float]]]:
    """(component names, GiB per bar per component) with the same order in every bar; the
    allocator's slack (reserved minus what is live) and the CUDA context are their own slices, so
    each bar reaches the nvidia-smi peak, the figure the budget line is compared with."""
    totals: dict[str, int] = {}
    for _, est in items:
        for name, value in est.components.items():
            totals[name] = totals.get(name, 0) + value
    names = [n for n, _ in sorted(totals.items(), key=lambda kv: -kv[1])]
    keep = names[:MAX_COMPONENTS]
    rest = names[MAX_COMPONENTS:]
    columns = keep + ([OTHER] if rest else []) + ["allocator slack", "CUDA context"]
    rows = []
    for _, est in items:
        row = [est.components.get(n, 0) / GIB for n in keep]
        if rest:
            row.append(sum(est.components.get(n, 0) for n in rest) / GIB)
        live = sum(est.components.values())
        row.append(max(0, est.reserved_peak_bytes - live) / GIB)
        row.append(max(0, est.nvidia_smi_peak_bytes - max(est.reserved_peak_bytes, live)) / GIB)
        rows.append(row)
    return columns, rows


def plot_estimates(items, *, path: str, budget_bytes: int | None = None, title: str | None = None) -> str:
    """Write a PNG (or any format matplotlib infers from `path`); items = [(label, MemoryEstimate)]."""
    if not items:
        raise MemkitError("nothing to plot")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MemkitError("--plot needs matplotlib; pip install 'memkit[plot]' or matplotlib") from None
    columns, rows = stack_components(items)
    labels = ["\n".join(textwrap.wrap(label, 22)) for label, _ in items]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.9 * len(items) + 2.5), 5.5))
    bottoms = [0.0] * len(items)
    cmap = plt.get_cmap("tab10")
    for j, name in enumerate(columns):
        heights = [row[j] for row in rows]
        color = {"allocator slack": "#cccccc", "CUDA context": "#888888"}.get(name, cmap(j % 10))
        ax.bar(range(len(items)), heights, bottom=bottoms, label=name, color=color, width=0.6)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    device = items[0][1].device_total_bytes / GIB
    ax.axhline(device, color="black", linewidth=1.2, label=f"device {device:.1f} GiB")
    if budget_bytes:
        ax.axhline(budget_bytes / GIB, color="red", linestyle="--", linewidth=1.2,
                   label=f"budget {budget_bytes / GIB:.1f} GiB")
    for i, (_, est) in enumerate(items):
        ax.text(i, bottoms[i], f"{est.nvidia_smi_peak_bytes / GIB:.1f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(items)))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("per-GPU memory at the peak (GiB)")
    ax.set_title(title or "memkit: per-GPU memory by component", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except (OSError, ValueError) as exc:
        raise MemkitError(f"--plot {path}: cannot write it ({exc}); use a writable .png path") from None
    finally:
        plt.close(fig)
    return path
