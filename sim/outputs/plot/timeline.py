"""The timeline: a Gantt chart, one row per simulated rank class and stream.

Part of :mod:`sim.outputs.plot` (which re-exports every public name here). Ops are coloured by
:attr:`sim.program.ir.Op.category`; pipeline bubbles are shaded and exposed communication marked
as :mod:`sim.analysis.metrics` defines them (:func:`sim.analysis.metrics.bubble_intervals`,
:func:`sim.analysis.metrics.exposed_comm_intervals`); the critical rank class is
:func:`sim.analysis.metrics.critical_class`'s.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from sim.analysis.metrics import (
    COMM_KINDS,
    Interval,
    bubble_intervals,
    critical_class,
    exposed_comm_intervals,
    merge_intervals,
    records_by_class,
)
from sim.engine.recorder import OpRecord, Recorder
from sim.outputs.plot.common import (
    DPI,
    OTHER_COLOR,
    check_window,
    clip,
    empty,
    save_png,
    step_end,
)

# Tableau 10 colours (matplotlib's ``tab10``/Vega palette), one per op category; categories
# not named here are drawn grey as "other".
CATEGORY_COLORS = {
    "forward": "#4C78A8",
    "backward": "#F58518",
    "recompute": "#FF9DA6",
    "recompute+backward": "#E45756",
    "optimizer": "#54A24B",
    "copy": "#B279A2",
    "all_gather": "#72B7B2",
    "reduce_scatter": "#EECA3B",
    "all_reduce": "#9D755D",
    "send_recv": "#17BECF",
    "sync": "#000000",
}
BUBBLE_LABEL = "pipeline bubble (idle compute)"
EXPOSED_LABEL = "exposed communication"
EXPOSED_COLOR = "#D62728"
BUBBLE_FACE = "#E6E6E6"
BUBBLE_EDGE = "#9A9A9A"

COMPUTE_STREAM = "compute"
"""The stream drawn first in each rank class (the one bubbles are shaded on)."""


def select_rank_classes(ids: Sequence[int], critical: int, limit: int) -> list[int]:
    """At most ``limit`` of ``ids``: the critical one, the first, the last and evenly spaced
    others, in id order.

    Examples
    --------
    >>> select_rank_classes(list(range(64)), 37, 6)
    [0, 11, 31, 37, 52, 63]
    >>> select_rank_classes([0, 1, 2], 1, 16)
    [0, 1, 2]
    """
    ids = sorted(ids)
    if len(ids) <= limit:
        return ids
    keep = list(dict.fromkeys([critical, ids[0], ids[-1]]))[:max(1, limit)]
    others = [i for i in ids if i not in keep]
    slots = max(0, limit - len(keep))
    keep += [others[int((j + 0.5) * len(others) / slots)] for j in range(slots)]
    return sorted(keep)



FIGURE_WIDTH_IN = 14.0
MERGED_GAP_PX = 0.125
"""Bars of one row and colour closer than this many pixels (at :data:`DPI`) are drawn as
one: a 1,024-GPU MoE step has 250,000 ops, and drawing each took most of its outputs' time,
for gaps no eye can see."""


def _stream_order(recs: list[OpRecord]) -> list[str]:
    """Compute stream first, then communication streams, then the rest (copy engines, CPU,
    host, side streams), each group by first start."""
    first: dict[str, float] = {}
    comm: set[str] = set()
    for r in recs:
        first[r.op.stream] = min(first.get(r.op.stream, math.inf), r.start)
        if r.op.kind in COMM_KINDS:
            comm.add(r.op.stream)

    def rank(s: str) -> tuple[int, float, str]:
        group = 0 if s == COMPUTE_STREAM else 1 if s in comm else 2
        return group, first[s], s

    return sorted(first, key=rank)


def timeline_figure(rec: Recorder, title: str = "", labels: Mapping[int, str] | None = None,
                    *, pipeline_stages: int = 1, window: tuple[float, float] | None = None,
                    max_rank_classes: int = 16) -> Figure:
    """A Gantt chart of the run: one row per simulated rank class and stream.

    Ops are coloured by category (:data:`CATEGORY_COLORS`; others grey); the legend names only
    the categories present. Communication rows carry a thin red strip under the bars where
    the communication is exposed (:func:`sim.analysis.metrics.exposed_comm_intervals`). With
    ``pipeline_stages > 1`` the time in the step when a class runs nothing is shaded on its
    compute row as the pipeline bubble (:func:`sim.analysis.metrics.bubble_intervals`).

    Parameters
    ----------
    rec : the run's recorder
    title : first line of the title (the scenario's name)
    labels : rank class id -> label (the program's :attr:`~sim.program.ir.RankClass.label`)
    pipeline_stages : the program's :attr:`~sim.program.ir.Program.pipeline_stages`; above 1
        bubbles are shaded
    window : (start, end) in seconds to zoom to; ops are clipped to it
    max_rank_classes : above this many classes show the critical one, the first, the last
        and evenly spaced others (:func:`select_rank_classes`), and say so in the title
    """
    check_window(window)
    labels = labels or {}
    if not rec.ops:
        fig = Figure(figsize=(12, 3), layout="constrained")
        return empty(fig, fig.add_subplot(), "no ops recorded")
    by_class = records_by_class(rec.ops)
    crit = critical_class(rec.ops)
    shown = select_rank_classes(list(by_class), crit, max_rank_classes)
    rows: list[tuple[int, str]] = [(c, s) for c in shown for s in _stream_order(by_class[c])]
    row_of = {key: i for i, key in enumerate(rows)}

    n = len(rows)
    # 0.28 in per row keeps 8-point labels apart; the height stays between 3 and 26 in.
    height = min(26.0, max(3.0, 1.6 + 0.28 * n))
    fig = Figure(figsize=(FIGURE_WIDTH_IN, height), layout="constrained")
    ax = fig.add_subplot()

    # Bars: one collection per (row, colour), so large runs draw quickly.
    bars: dict[tuple[int, str], list[Interval]] = {}
    present: dict[str, str] = {}
    for r in rec.ops:
        y = row_of.get((r.cls, r.op.stream))
        if y is None:
            continue
        color = CATEGORY_COLORS.get(r.op.category, OTHER_COLOR)
        clipped = clip([(r.start, r.end)], window)
        if not clipped:
            continue
        bars.setdefault((y, color), []).append(clipped[0])
        present.setdefault(r.op.category if r.op.category in CATEGORY_COLORS else "other", color)
    bar_top, bar_h = -0.36, 0.6      # rows grow downwards (inverted axis)
    strip_top, strip_h = 0.27, 0.13  # exposed strip under the bar
    x0, x1 = window if window is not None else (0.0, step_end(rec))
    pixel = (x1 - x0) / (FIGURE_WIDTH_IN * DPI)
    gap = pixel * MERGED_GAP_PX
    for (y, color), iv in bars.items():
        ax.broken_barh([(a, b - a) for a, b in merge_intervals(iv, gap)],
                       (y + bar_top, bar_h), facecolors=color, linewidth=0, zorder=2)

    handles: list[Patch] = []
    names: list[str] = []
    for cat in [*CATEGORY_COLORS, "other"]:
        if cat in present:
            handles.append(Patch(facecolor=present[cat]))
            names.append(cat)

    if pipeline_stages > 1:
        bubbles = bubble_intervals(rec.ops)
        drawn = False
        for cls, iv in bubbles.items():
            y = row_of.get((cls, COMPUTE_STREAM))
            xr = [(a, b - a) for a, b in merge_intervals(clip(iv, window), gap)]
            if y is None or not xr:
                continue
            # Hatching is drawn shape by shape and cost seconds for a large run's thousands
            # of idle moments narrower than a pixel, where no hatch can show: those are filled
            # plain, the same face.
            wide = [x for x in xr if x[1] >= pixel]
            narrow = [x for x in xr if x[1] < pixel]
            if wide:
                ax.broken_barh(wide, (y - 0.45, 0.9), facecolors=BUBBLE_FACE,
                               edgecolors=BUBBLE_EDGE, hatch="////", linewidth=0, zorder=1,
                               label=BUBBLE_LABEL)
            if narrow:
                ax.broken_barh(narrow, (y - 0.45, 0.9), facecolors=BUBBLE_FACE, linewidth=0,
                               zorder=1)
            drawn = True
        if drawn:
            handles.append(Patch(facecolor=BUBBLE_FACE, edgecolor=BUBBLE_EDGE, hatch="////"))
            names.append(BUBBLE_LABEL)

    exposed = exposed_comm_intervals(r for r in rec.ops if r.cls in shown)
    any_exposed = False
    for cls, streams in exposed.items():
        for stream, iv in streams.items():
            xr = [(a, b - a) for a, b in clip(iv, window)]
            if not xr:
                continue
            ax.broken_barh(xr, (row_of[(cls, stream)] + strip_top, strip_h),
                           facecolors=EXPOSED_COLOR, linewidth=0, zorder=3, label=EXPOSED_LABEL)
            any_exposed = True
    if any_exposed:
        handles.append(Patch(facecolor=EXPOSED_COLOR))
        names.append(EXPOSED_LABEL)

    # A rule between rank classes.
    for i in range(1, n):
        if rows[i][0] != rows[i - 1][0]:
            ax.axhline(i - 0.5, color="#555555", linewidth=0.6, zorder=0)
    ax.set_yticks(range(n))
    ax.set_yticklabels([f"{labels.get(c, f'rank class {c}')} · {s}" for c, s in rows],
                       fontsize=8 if n <= 60 else 6)
    ax.set_ylim(n - 0.5, -0.5)
    ax.set_xlim(window if window is not None else (0.0, step_end(rec)))
    ax.set_xlabel("time (s)")
    ax.set_ylabel("rank class · stream")
    ax.grid(axis="x", color="#DDDDDD", linewidth=0.5, zorder=0)
    ax.set_axisbelow(True)
    head = title or "timeline"
    notes = []
    if len(by_class) > 1:
        notes.append(f"critical rank class (last op ends last): "
                     f"{labels.get(crit, f'rank class {crit}')}")
    if len(shown) < len(by_class):
        notes.append(f"showing {len(shown)} of {len(by_class)} rank classes "
                     "(critical, first, last, evenly spaced others)")
    if window is not None:
        notes.append(f"window {window[0]:.6g}–{window[1]:.6g} s")
    ax.set_title("\n".join([head, "; ".join(notes)]) if notes else head, fontsize=10)
    ax.legend(handles, names, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8,
              frameon=False)
    return fig


def timeline(path: Path, rec: Recorder, title: str = "",
             labels: Mapping[int, str] | None = None, *, pipeline_stages: int = 1,
             window: tuple[float, float] | None = None, max_rank_classes: int = 16) -> None:
    """Write :func:`timeline_figure` as a PNG."""
    save_png(timeline_figure(rec, title, labels, pipeline_stages=pipeline_stages, window=window,
                          max_rank_classes=max_rank_classes), path)
