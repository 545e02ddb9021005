"""Timeline PNGs: cells x time, coloured by role, for one run or several side by side."""
from __future__ import annotations

import collections
from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from gyre_jax.scheduler.simulator import SimResult  # noqa: E402
from gyre_jax.scheduler.vocab import ROLE_COLORS as COLORS  # noqa: E402
from gyre_jax.scheduler.vocab import ROLE_LABELS as LABELS  # noqa: E402


def _draw_cells(ax, r: SimResult, xmax_h: float) -> None:
    bars = collections.defaultdict(list)
    for cell, t0, t1, state in r.segments:
        if t1 > t0:
            bars[(cell, state)].append((t0 / 3600, (t1 - t0) / 3600))
    for (cell, state), xr in bars.items():
        ax.broken_barh(xr, (cell - 0.4, 0.8), facecolors=COLORS[state], linewidth=0)
    for t in r.step_end_s:
        ax.axvline(t / 3600, color="k", lw=0.4, alpha=0.35)
    n = r.n_cells
    ax.set_ylim(-0.7, n - 0.3)
    ax.set_xlim(0, xmax_h)
    ax.set_yticks([0, n - 1] if n > 12 else range(n))
    ax.set_ylabel("cell")
    s = r.summary()
    ax.set_title(
        f"{r.config.policy.mode}: {s['makespan_h']:.1f} h  (x{s['over_lower_bound']:.2f} lower bound), "
        f"staleness mean {s['staleness_mean']:.2f}, {s['switches']} switches, "
        f"busy {100 * s['util_busy']:.0f}%",
        fontsize=9, loc="left",
    )


def _legend(fig) -> None:
    fig.legend(handles=[Patch(color=COLORS[k], label=LABELS[k]) for k in COLORS] +
               [plt.Line2D([], [], color="k", lw=0.6, alpha=0.5, label="step done")],
               loc="lower center", ncol=6, fontsize=8, frameon=False)


def plot_timeline(r: SimResult, path: str, *, title: str = "") -> None:
    """One run: the cells' roles over time, and below, agents and calls over time."""
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(13, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 1.3]})
    xmax = r.makespan_s / 3600 * 1.01
    _draw_cells(ax, r, xmax)
    t = [x[0] / 3600 for x in r.series]
    ax2.step(t, [x[1] for x in r.series], where="post", lw=0.8, label="running agents", color="#54a24b")
    ax2.step(t, [x[2] for x in r.series], where="post", lw=0.8, label="model calls in flight", color="#4c78a8")
    ax2.step(t, [x[3] for x in r.series], where="post", lw=0.8, label="calls queued", color="#e45756")
    ax2.set_ylabel("count")
    ax2.set_xlabel("time (h)")
    ax3 = ax2.twinx()
    ax3.step(t, [x[4] for x in r.series], where="post", lw=0.8, color="#f58518", label="cells training")
    ax3.set_ylabel("cells training", color="#f58518")
    ax3.set_ylim(0, r.n_cells + 0.5)
    h1, l1 = ax2.get_legend_handles_labels()
    h3, l3 = ax3.get_legend_handles_labels()
    ax2.legend(h1 + h3, l1 + l3, fontsize=7, loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=4, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    _legend(fig)
    fig.tight_layout(rect=(0, 0.05, 1, 0.97 if title else 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_timelines(results: Sequence[SimResult], path: str, *, title: str = "") -> None:
    """Several modes stacked on one time axis, so their makespans compare at a glance."""
    fig, axes = plt.subplots(len(results), 1, figsize=(13, 1.2 + 1.7 * len(results)), sharex=True, squeeze=False)
    xmax = max(r.makespan_s for r in results) / 3600 * 1.01
    for ax, r in zip(axes[:, 0], results):
        _draw_cells(ax, r, xmax)
    axes[-1, 0].set_xlabel("time (h)")
    if title:
        fig.suptitle(title, fontsize=10)
    _legend(fig)
    fig.tight_layout(rect=(0, 0.06, 1, 0.97 if title else 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
