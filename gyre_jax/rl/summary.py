"""After a run: the cell-role timeline PNG, utilization by role, and the summary table.

The colours are the scheduler's (``gyre_jax.scheduler.plot.COLORS``) so a real
run and a simulated one read the same; the time axis is in seconds here (the
simulator plots hours).
"""
from __future__ import annotations

import collections
import glob
import json
import os
from typing import Sequence

from gyre_jax.scheduler.vocab import ROLLOUT, SWITCHING_ROLES, TRAIN


def utilization(segments: Sequence[tuple[int, float, float, str]], n_cells: int, wall_s: float) -> dict[str, float]:
    """Fraction of cell-time (cells x wall time) spent in each role."""
    t: dict[str, float] = collections.defaultdict(float)
    for _, t0, t1, role in segments:
        t[role] += max(0.0, t1 - t0)
    total = max(n_cells * wall_s, 1e-9)
    out = {r: t[r] / total for r in (ROLLOUT, TRAIN)}
    out["switching"] = sum(t[r] for r in SWITCHING_ROLES) / total
    return out


def plot_timeline(segments, n_cells: int, step_end_s: Sequence[float], path: str, *, title: str = "",
                  restarts: Sequence[tuple[float, str]] = ()) -> None:
    """The cells' roles over time; ``restarts``: (t, label) where a resumed attempt begins (a red line)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    from gyre_jax.scheduler.plot import COLORS, LABELS

    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.6 * n_cells))
    bars = collections.defaultdict(list)
    for cell, t0, t1, role in segments:
        if t1 > t0:
            bars[(cell, role)].append((t0, t1 - t0))
    for (cell, role), xr in bars.items():
        ax.broken_barh(xr, (cell - 0.4, 0.8), facecolors=COLORS[role], linewidth=0)
    for t in step_end_s:
        ax.axvline(t, color="k", lw=0.5, alpha=0.4)
    for t, label in restarts:
        ax.axvline(t, color="tab:red", lw=1.2, ls="--")
        ax.annotate(label, (t, -0.5), xytext=(3, 0), textcoords="offset points", color="tab:red", fontsize=7,
                    va="bottom")
    ax.set_yticks(range(n_cells), [f"cell {c}" + (" (core)" if c == 0 else "") for c in range(n_cells)])
    ax.set_ylim(-0.6, n_cells - 0.4)
    ax.invert_yaxis()
    ax.set_xlabel("time (s)")
    ax.set_title(title, fontsize=10)
    used = sorted({r for _, _, _, r in segments})
    ax.legend(handles=[Patch(color=COLORS[k], label=LABELS[k]) for k in used]
              + [plt.Line2D([], [], color="k", lw=0.6, alpha=0.5, label="step done")]
              + ([plt.Line2D([], [], color="tab:red", lw=1.2, ls="--", label="resumed")] if restarts else []),
              loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=5, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def mode_summaries(root: str) -> list[dict]:
    """Every ``<root>/<mode>/summary.json`` written so far (one per mode run under this workdir)."""
    out = []
    for p in sorted(glob.glob(os.path.join(root, "*", "summary.json"))):
        with open(p) as f:
            out.append(json.load(f))
    return out


def table(summaries: Sequence[dict]) -> str:
    cols = [("mode", "{}"), ("steps", "{}"), ("wall_s", "{:.1f}"), ("rl_s", "{:.1f}"),
            ("reward_first", "{:.3f}"), ("reward_last", "{:.3f}"),
            ("eval_first", "{:.3f}"), ("eval_last", "{:.3f}"), ("util_rollout", "{:.2f}"),
            ("util_train", "{:.2f}"), ("util_train_busy", "{:.2f}"), ("util_switching", "{:.2f}"), ("staleness_mean", "{:.2f}"),
            ("switches", "{}"), ("statuses", "{}")]
    rows = [[name for name, _ in cols]]
    for s in summaries:
        # null: a mean over nothing scored (summary.json writes NaN as null), or a field an older run lacks
        rows.append([fmt.format(s[name]) if s.get(name) is not None and s.get(name) != "" else "-"
                     for name, fmt in cols])
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in rows)
