"""Plots of a run: a Gantt timeline per rank class and stream, and bytes/s per link class.

matplotlib with the Agg backend (no display needed).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from sim.recorder import Recorder  # noqa: E402
from sim.topology import LINK_KINDS  # noqa: E402

CATEGORY_COLORS = {
    "forward": "#4C78A8",
    "backward": "#F58518",
    "recompute+backward": "#E45756",
    "optimizer": "#54A24B",
    "copy": "#B279A2",
    "all_gather": "#72B7B2",
    "reduce_scatter": "#EECA3B",
    "all_reduce": "#9D755D",
    "send_recv": "#BAB0AC",
}


def timeline(path: Path, rec: Recorder, title: str = "") -> None:
    rows: dict[tuple[int, str], int] = {}
    for r in rec.ops:
        rows.setdefault((r.cls, r.op.stream), len(rows))
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.5 * len(rows)))
    for r in rec.ops:
        y = rows[(r.cls, r.op.stream)]
        color = CATEGORY_COLORS.get(r.op.category, "#888888")
        ax.barh(y, r.end - r.start, left=r.start, height=0.8, color=color, linewidth=0)
    ax.set_yticks(list(rows.values()))
    ax.set_yticklabels([f"class {c} · {s}" for c, s in rows])
    ax.invert_yaxis()
    ax.set_xlabel("time (s)")
    ax.set_title(title or "timeline")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in CATEGORY_COLORS.values()]
    ax.legend(handles, list(CATEGORY_COLORS), loc="upper center", ncol=5, fontsize=7,
              bbox_to_anchor=(0.5, -0.15 if len(rows) > 2 else -0.4))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def bytes_over_time(path: Path, rec: Recorder, title: str = "") -> None:
    fig, ax = plt.subplots(figsize=(12, 4))
    if rec.rate_series:
        ts = [t for t, _ in rec.rate_series]
        for i, kind in enumerate(LINK_KINDS):
            ax.step(ts, [r[i] / 1e9 for _, r in rec.rate_series], where="post", label=kind)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("GB/s (all hops)")
    ax.set_title(title or "bytes per link class")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def memory_over_time(path: Path, rec: Recorder, title: str = "",
                     labels: dict[int, str] | None = None, capacity_gib: float | None = None
                     ) -> None:
    """GPU memory of each rank class over the step (total, stepped), with the GPU's usable
    memory as a line: pipeline stages and the embedding/head stages show apart."""
    fig, ax = plt.subplots(figsize=(12, 4))
    for cls, track in sorted(rec.memory.items()):
        if not track.series:
            continue
        ts = [t for t, _ in track.series]
        ys = [sum(cur.values()) / 2**30 for _, cur in track.series]
        ax.step(ts, ys, where="post", label=(labels or {}).get(cls, f"rank class {cls}"))
    if capacity_gib:
        ax.axhline(capacity_gib, color="black", linestyle="--", linewidth=1,
                   label="GPU memory")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("GiB per GPU")
    ax.set_title(title or "memory")
    if len(rec.memory) <= 16:
        ax.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
