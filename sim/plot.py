"""Plots of a run: the timeline, bytes over time, memory over time and link utilisation.

Each plot has a builder, ``*_figure(...)``, that returns a :class:`matplotlib.figure.Figure`
(tests inspect it) and a writer that saves it as PNG at :data:`DPI` dots per inch. Figures are
made with :class:`~matplotlib.figure.Figure` directly, not through ``pyplot``: no global figure
registry holds them, so nothing needs closing and nothing leaks between plots (the Agg canvas
draws them without a display).

* :func:`timeline` -- a Gantt chart, one row per simulated rank class and stream, ops coloured
  by :attr:`sim.program.Op.category`; pipeline bubbles shaded and exposed communication marked,
  as :mod:`sim.metrics` defines them (:func:`sim.metrics.bubble_intervals`,
  :func:`sim.metrics.exposed_comm_intervals`). The plots compute no analysis of their own:
  intervals, exposed communication, bubbles and the critical rank class come from
  :mod:`sim.metrics`.
* :func:`bytes_over_time` -- bytes/s per link class, and the cumulative bytes that crossed
  a zone or region boundary with what they cost.
* :func:`memory_over_time` -- memory per rank class by category, stacked.
* :func:`links` -- utilisation of the busiest links over time (needs the recorder's
  ``keep_link_series``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import numpy as np  # noqa: E402
from matplotlib.artist import Artist  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.colors import PowerNorm  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

# The analysis the plots draw: one home, sim.metrics. Names re-exported here (``as``) stay
# importable from sim.plot, where the tests and the first callers found them.
from sim.metrics import BUSY_KINDS as BUSY_KINDS  # noqa: E402
from sim.metrics import COMM_KINDS as COMM_KINDS  # noqa: E402
from sim.metrics import Interval as Interval  # noqa: E402
from sim.metrics import bubble_intervals as bubble_intervals  # noqa: E402
from sim.metrics import critical_class as critical_class  # noqa: E402
from sim.metrics import exposed_comm_intervals as exposed_comm_intervals  # noqa: E402
from sim.metrics import merge_intervals as merge_intervals  # noqa: E402
from sim.metrics import records_by_class  # noqa: E402
from sim.metrics import step_spans as step_spans  # noqa: E402
from sim.metrics import subtract_intervals as subtract_intervals  # noqa: E402
from sim.metrics import total_length as total_length  # noqa: E402
from sim.program import MEMORY_CATEGORIES  # noqa: E402
from sim.recorder import OpRecord, Recorder  # noqa: E402
from sim.topology import LINK_KINDS, Fabric  # noqa: E402

DPI = 120
GIB = float(2**30)
GB = 1e9
"""Transfer is billed per decimal gigabyte (as :mod:`sim.cost` counts it)."""

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
OTHER_COLOR = "#A0A0A0"
BUBBLE_LABEL = "pipeline bubble (idle compute)"
EXPOSED_LABEL = "exposed communication"
EXPOSED_COLOR = "#D62728"
BUBBLE_FACE = "#E6E6E6"
BUBBLE_EDGE = "#9A9A9A"
LINK_KIND_COLORS = dict(zip(LINK_KINDS, ("#4C78A8", "#B279A2", "#54A24B", "#E45756",
                                         "#F58518"), strict=True))
CAPACITY_AXIS_SHARE = 0.1
"""Memory plots draw the GPU's capacity when the highest peak shown uses at least this
share of it (a readability choice)."""
LOG_RATE_SPAN = 10.0
"""Bytes plots use a log rate axis when the link classes' peak rates span more than this
factor (a readability choice)."""
MEMORY_COLORS = {
    "parameters": "#4C78A8",
    "gradients": "#F58518",
    "optimizer": "#54A24B",
    "activations": "#E45756",
    "buffers": "#B0B0B0",
}

COMPUTE_STREAM = "compute"


# ----------------------------------------------------------------------------- layout
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


def _step_end(rec: Recorder) -> float:
    ends = [r.end for r in rec.ops] + [t for t, _ in rec.rate_series[-1:]]
    return max(ends, default=0.0)


def _check_window(window: tuple[float, float] | None) -> None:
    if window is not None and not window[1] > window[0]:
        raise ValueError(f"window: end {window[1]} must come after start {window[0]}")


def _clip(intervals: Iterable[Interval], window: tuple[float, float] | None) -> list[Interval]:
    if window is None:
        return [(a, b) for a, b in intervals]
    t0, t1 = window
    return [(max(a, t0), min(b, t1)) for a, b in intervals if b > t0 and a < t1]


def _empty(fig: Figure, ax: Axes, text: str) -> Figure:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, wrap=True)
    ax.set_axis_off()
    return fig


# ----------------------------------------------------------------------------- timeline
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
    the communication is exposed (:func:`sim.metrics.exposed_comm_intervals`). With
    ``pipeline_stages > 1`` the time in the step when a class runs nothing is shaded on its
    compute row as the pipeline bubble (:func:`sim.metrics.bubble_intervals`).

    Parameters
    ----------
    rec : the run's recorder
    title : first line of the title (the scenario's name)
    labels : rank class id -> label (the program's :attr:`~sim.program.RankClass.label`)
    pipeline_stages : the program's ``meta["pipeline_stages"]``; above 1 bubbles are shaded
    window : (start, end) in seconds to zoom to; ops are clipped to it
    max_rank_classes : above this many classes show the critical one, the first, the last
        and evenly spaced others (:func:`select_rank_classes`), and say so in the title
    """
    _check_window(window)
    labels = labels or {}
    if not rec.ops:
        fig = Figure(figsize=(12, 3), layout="constrained")
        return _empty(fig, fig.add_subplot(), "no ops recorded")
    by_class = records_by_class(rec.ops)
    crit = critical_class(rec.ops)
    shown = select_rank_classes(list(by_class), crit, max_rank_classes)
    rows: list[tuple[int, str]] = [(c, s) for c in shown for s in _stream_order(by_class[c])]
    row_of = {key: i for i, key in enumerate(rows)}

    n = len(rows)
    # 0.28 in per row keeps 8-point labels apart; the height stays between 3 and 26 in.
    height = min(26.0, max(3.0, 1.6 + 0.28 * n))
    fig = Figure(figsize=(14, height), layout="constrained")
    ax = fig.add_subplot()

    # Bars: one collection per (row, colour), so large runs draw quickly.
    bars: dict[tuple[int, str], list[Interval]] = {}
    present: dict[str, str] = {}
    for r in rec.ops:
        y = row_of.get((r.cls, r.op.stream))
        if y is None:
            continue
        color = CATEGORY_COLORS.get(r.op.category, OTHER_COLOR)
        clipped = _clip([(r.start, r.end)], window)
        if not clipped:
            continue
        s, e = clipped[0]
        bars.setdefault((y, color), []).append((s, e - s))
        present.setdefault(r.op.category if r.op.category in CATEGORY_COLORS else "other", color)
    bar_top, bar_h = -0.36, 0.6      # rows grow downwards (inverted axis)
    strip_top, strip_h = 0.27, 0.13  # exposed strip under the bar
    for (y, color), xr in bars.items():
        ax.broken_barh(xr, (y + bar_top, bar_h), facecolors=color, linewidth=0, zorder=2)

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
            xr = [(a, b - a) for a, b in _clip(iv, window)]
            if y is None or not xr:
                continue
            ax.broken_barh(xr, (y - 0.45, 0.9), facecolors=BUBBLE_FACE, edgecolors=BUBBLE_EDGE,
                           hatch="////", linewidth=0, zorder=1, label=BUBBLE_LABEL)
            drawn = True
        if drawn:
            handles.append(Patch(facecolor=BUBBLE_FACE, edgecolor=BUBBLE_EDGE, hatch="////"))
            names.append(BUBBLE_LABEL)

    exposed = exposed_comm_intervals(r for r in rec.ops if r.cls in shown)
    any_exposed = False
    for cls, streams in exposed.items():
        for stream, iv in streams.items():
            xr = [(a, b - a) for a, b in _clip(iv, window)]
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
    ax.set_xlim(window if window is not None else (0.0, _step_end(rec)))
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
    _save(timeline_figure(rec, title, labels, pipeline_stages=pipeline_stages, window=window,
                          max_rank_classes=max_rank_classes), path)


# ----------------------------------------------------------------------------- bytes
def cumulative_bytes(rec: Recorder, kind: str, t_end: float | None = None
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Bytes carried by links of one class (:data:`~sim.topology.LINK_KINDS`) from the start
    up to each rate change: the integral of the piecewise-constant ``rate_series``, as the
    flow network counts ``class_bytes``.

    Returns
    -------
    times, bytes : numpy.ndarray
        Times of the rate changes (and ``t_end`` if later), and the bytes up to each.
    """
    if not rec.rate_series:
        return np.zeros(1), np.zeros(1)
    k = LINK_KINDS.index(kind)
    ts = np.array([t for t, _ in rec.rate_series], dtype=float)
    rates = np.array([r[k] for _, r in rec.rate_series], dtype=float)
    if t_end is not None and t_end > ts[-1]:
        ts = np.append(ts, t_end)
        rates = np.append(rates, rates[-1])
    cum = np.concatenate([[0.0], np.cumsum(rates[:-1] * np.diff(ts))])
    return ts, cum


def bytes_figure(rec: Recorder, title: str = "", *, egress_usd_per_gb: float = 0.0,
                 region_egress_usd_per_gb: float = 0.0,
                 window: tuple[float, float] | None = None) -> Figure:
    """Bytes/s per link class over the step, and what crossed zone and region boundaries.

    The top panel has one step line per link class that carried traffic (GB/s summed over
    the class's links: a flow crossing three network links counts three times, as the
    summary's ``bytes`` do). Below it, for ``cross_az`` and ``cross_region`` when they carried
    bytes, the cumulative GB (the integral of the series, which ends at the summary's bytes)
    with a second y-axis in USD at the given price per GB: the billed amount is read off the
    same curve, GB x price. The time axis is the timeline's.

    Parameters
    ----------
    rec : the run's recorder
    title : first line of the title (the scenario's name)
    egress_usd_per_gb : price per GB crossing a zone boundary (``pricing.egress_usd_per_gb``)
    region_egress_usd_per_gb : price per GB crossing a region boundary
        (``pricing.region_egress_usd_per_gb``)
    window : (start, end) in seconds to zoom to
    """
    _check_window(window)
    t_end = _step_end(rec)
    billed = [(k, p) for k, p in (("cross_az", egress_usd_per_gb),
                                  ("cross_region", region_egress_usd_per_gb))
              if rec.rate_series and any(r[LINK_KINDS.index(k)] > 0 for _, r in rec.rate_series)]
    fig = Figure(figsize=(14, 4.0 + 2.6 * len(billed)), layout="constrained")
    axes = fig.subplots(1 + len(billed), 1, sharex=True, squeeze=False,
                        height_ratios=[1.6] + [1.0] * len(billed))[:, 0]
    ax = axes[0]
    if not rec.rate_series:
        return _empty(fig, ax, "no traffic recorded")
    ts = np.array([t for t, _ in rec.rate_series] + [max(t_end, rec.rate_series[-1][0])])
    peaks = []
    for i, kind in enumerate(LINK_KINDS):
        rate = np.array([r[i] for _, r in rec.rate_series])
        if not (rate > 0).any():
            continue
        peaks.append(rate.max() / GB)
        ax.step(ts, np.append(rate, rate[-1]) / GB, where="post", label=kind,
                color=LINK_KIND_COLORS[kind], linewidth=1.0)
    ax.set_ylabel("GB/s, summed over the\nclass's links (each hop)")
    if max(peaks) > LOG_RATE_SPAN * min(peaks):
        # Link classes an order of magnitude or more apart (NVLink bursts against a zone
        # link): a log axis keeps each readable; idle stretches (0 B/s) leave gaps.
        ax.set_yscale("log")
        ax.set_ylim(min(peaks) / LOG_RATE_SPAN, max(peaks) * 2)
    else:
        ax.set_ylim(0, max(peaks) * 1.1)
    ax.legend(title="link class", loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8,
              frameon=False)
    ax.set_title(f"{title or 'bytes over time'}\nbytes per second by link class", fontsize=10)
    ax.grid(color="#EEEEEE", linewidth=0.5)

    names = {"cross_az": "cross-AZ", "cross_region": "cross-region"}
    for bax, (kind, price) in zip(axes[1:], billed, strict=True):
        t, cum = cumulative_bytes(rec, kind, t_end)
        bax.plot(t, cum / GB, color=LINK_KIND_COLORS[kind],
                 label=f"cumulative {names[kind]} GB")
        bax.set_ylabel(f"cumulative {names[kind]}\nGB (billed)")
        bax.set_ylim(0, max(cum[-1] / GB, 1e-12) * 1.08)
        bax.grid(color="#EEEEEE", linewidth=0.5)
        bax.set_title(f"{names[kind]}: {cum[-1] / GB:,.3f} GB"
                      + (f" x \\${price:g}/GB = \\${cum[-1] / GB * price:,.4f}" if price > 0
                         else " (no price set)"), fontsize=9, loc="left")
        if price > 0:
            usd = bax.secondary_yaxis(
                "right", functions=(lambda gb, p=price: gb * p, lambda usd, p=price: usd / p))
            usd.set_ylabel(f"USD at \\${price:g}/GB")
    axes[-1].set_xlabel("time (s)")
    ax.set_xlim(window if window is not None else (0.0, t_end))
    return fig


def bytes_over_time(path: Path, rec: Recorder, title: str = "", *,
                    egress_usd_per_gb: float = 0.0, region_egress_usd_per_gb: float = 0.0,
                    window: tuple[float, float] | None = None) -> None:
    """Write :func:`bytes_figure` as a PNG."""
    _save(bytes_figure(rec, title, egress_usd_per_gb=egress_usd_per_gb,
                       region_egress_usd_per_gb=region_egress_usd_per_gb, window=window), path)


# ----------------------------------------------------------------------------- memory
def memory_stack(rec: Recorder, cls: int, t_end: float | None = None
                 ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """One rank class's memory by category over time, bytes, piecewise constant from each
    time on; categories in :data:`~sim.program.MEMORY_CATEGORIES` order (others after), only
    those ever held. ``t_end`` repeats the last state at that time."""
    series = rec.memory[cls].series if cls in rec.memory else []
    if not series:
        return np.zeros(0), {}
    cats = [c for c in MEMORY_CATEGORIES] + sorted(
        {k for _, cur in series for k in cur} - set(MEMORY_CATEGORIES))
    ts = np.array([t for t, _ in series], dtype=float)
    values = {c: np.array([cur.get(c, 0.0) for _, cur in series], dtype=float) for c in cats}
    values = {c: v for c, v in values.items() if np.any(v != 0.0)}
    if t_end is not None and t_end > ts[-1]:
        ts = np.append(ts, t_end)
        values = {c: np.append(v, v[-1]) for c, v in values.items()}
    return ts, values


def memory_figure(rec: Recorder, title: str = "", labels: Mapping[int, str] | None = None,
                  capacity_gib: float | None = None, *, max_panels: int = 8,
                  window: tuple[float, float] | None = None) -> Figure:
    """GPU memory per rank class over time, stacked by category, GiB per GPU.

    One panel per rank class (up to ``max_panels``: those with the highest peaks, said in
    the title), each a stacked step area of :data:`~sim.program.MEMORY_CATEGORIES` with the
    GPU's usable memory as a dashed line.

    Parameters
    ----------
    rec : the run's recorder (with ``keep_memory_series``)
    title : first line of the title (the scenario's name)
    labels : rank class id -> label
    capacity_gib : the GPU's usable memory (the summary's ``gpu_memory_gib``)
    max_panels : most rank classes shown
    window : (start, end) in seconds to zoom to
    """
    _check_window(window)
    labels = labels or {}
    t_end = _step_end(rec)
    tracked = [c for c, tr in rec.memory.items() if tr.series]
    if not tracked:
        fig = Figure(figsize=(12, 3), layout="constrained")
        return _empty(fig, fig.add_subplot(), "no memory series recorded")
    ranked = sorted(tracked, key=lambda c: (-rec.memory[c].peak, c))
    shown = sorted(ranked[:max_panels])
    ncols = 1 if len(shown) == 1 else 2
    nrows = math.ceil(len(shown) / ncols)
    fig = Figure(figsize=(14 if ncols > 1 else 12, min(24.0, 1.6 + 2.7 * nrows)),
                 layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False, sharex=True, sharey=True).ravel()
    ymax = max(max(rec.memory[c].peak, rec.memory[c].reserved_peak) for c in shown) / GIB
    # The capacity line shows the headroom; when the peaks use under a tenth of the GPU it
    # would squash them flat, so it is named in the title instead.
    cap_line = (capacity_gib if capacity_gib and ymax >= CAPACITY_AXIS_SHARE * capacity_gib
                else None)
    if cap_line is not None:
        ymax = max(ymax, cap_line)
    legend: dict[str, Artist] = {}
    for ax, cls in zip(axes, shown, strict=False):
        ts, values = memory_stack(rec, cls, t_end)
        lower = np.zeros_like(ts)
        for cat, v in values.items():
            upper = lower + v / GIB
            poly = ax.fill_between(ts, lower, upper, step="post", linewidth=0,
                                   color=MEMORY_COLORS.get(cat, OTHER_COLOR), label=cat)
            legend.setdefault(cat, poly)
            lower = upper
        tr = rec.memory[cls]
        if tr.reserved_series:
            # What the caching allocator holds (torch.cuda.memory_reserved): the stack plus
            # rounding and cached free blocks.
            rt = np.array([t for t, _ in tr.reserved_series] + [t_end], dtype=float)
            rv = np.array([v for _, v in tr.reserved_series], dtype=float) / GIB
            (res,) = ax.step(rt, np.append(rv, rv[-1]), where="post", color="#222222",
                             linewidth=1.0, label="reserved (caching allocator)")
            legend.setdefault("reserved (caching allocator)", res)
        if cap_line is not None:
            line = ax.axhline(cap_line, color="black", linestyle="--", linewidth=1,
                              label="usable GPU memory")
            legend.setdefault("usable GPU memory", line)
        ax.set_title(f"{labels.get(cls, f'rank class {cls}')}: peak {tr.peak / GIB:,.1f} GiB "
                     f"at {tr.peak_time:.3g} s, reserved {tr.reserved_peak / GIB:,.1f} GiB",
                     fontsize=9, loc="left")
        ax.set_ylim(0, ymax * 1.08)
        ax.set_xlim(window if window is not None else (0.0, t_end))
        ax.grid(color="#EEEEEE", linewidth=0.5)
        ax.set_axisbelow(True)
        ax.set_ylabel("GiB per GPU")
    for ax in axes[len(shown):]:
        ax.set_axis_off()
    for ax in axes[max(0, len(shown) - ncols):len(shown)]:
        ax.set_xlabel("time (s)")
        ax.xaxis.set_tick_params(labelbottom=True)
    head = title or "memory"
    sub = "GPU memory allocated by category, reserved as a line"
    over = max(rec.overheads.values(), key=lambda o: o.outside_allocator, default=None)
    if over is not None:
        sub += f"; nvidia-smi adds {over.outside_allocator / GIB:.2f} GiB (context, NCCL)"
    if capacity_gib and cap_line is None:
        sub += f"; usable GPU memory {capacity_gib:,.1f} GiB is off the scale"
    if len(shown) < len(tracked):
        sub += f"; showing {len(shown)} of {len(tracked)} rank classes (the highest peaks)"
    fig.suptitle(f"{head}\n{sub}", fontsize=10)
    order = [c for c in [*MEMORY_CATEGORIES, *sorted(legend)] if c in legend]
    order = list(dict.fromkeys(order))
    fig.legend([legend[c] for c in order], order, loc="outside right upper", fontsize=8,
               frameon=False)
    return fig


def memory_over_time(path: Path, rec: Recorder, title: str = "",
                     labels: Mapping[int, str] | None = None, capacity_gib: float | None = None,
                     *, max_panels: int = 8, window: tuple[float, float] | None = None) -> None:
    """Write :func:`memory_figure` as a PNG."""
    _save(memory_figure(rec, title, labels, capacity_gib, max_panels=max_panels,
                        window=window), path)


# ----------------------------------------------------------------------------- links
@dataclass
class LinkUtilisation:
    """Utilisation of the busiest links over time bins."""

    links: np.ndarray
    """Link indices into the fabric, busiest first."""
    bytes: np.ndarray
    """Bytes each carried over the whole series."""
    edges: np.ndarray
    """Bin edges, seconds (``len = bins + 1``)."""
    utilisation: np.ndarray
    """Mean rate over each bin / link capacity, shape (links, bins)."""


def link_utilisation(rec: Recorder, fabric: Fabric, top_links: int = 32, time_bins: int = 200,
                     window: tuple[float, float] | None = None) -> LinkUtilisation:
    """The ``top_links`` links that carried the most bytes, and their mean utilisation in
    each of ``time_bins`` equal bins of the step (or of ``window``).

    Utilisation is a link's rate (``rec.link_series``, piecewise constant) averaged over the
    bin, over its physical capacity (:attr:`Fabric.capacity`). The flow network runs on
    what NCCL's transports achieve (a fraction of it), so a saturated link shows below 1.
    Rates are stored as float32; they are divided by the capacity rounded the same way, so a
    link at capacity reads 1, not 1 + float32 rounding.
    """
    _check_window(window)
    t_end = _step_end(rec)
    if not rec.link_series:
        empty = np.zeros(0)
        return LinkUtilisation(empty.astype(int), empty, empty, np.zeros((0, 0)))
    ts = np.array([t for t, _, _ in rec.link_series] + [max(t_end, rec.link_series[-1][0])])
    dt = np.diff(ts)
    carried = np.zeros(fabric.n_links)
    for (_, idx, rate), d in zip(rec.link_series, dt, strict=True):
        carried[idx] += rate.astype(float) * d
    order = np.argsort(-carried, kind="stable")
    links = order[carried[order] > 0][:top_links]
    pos = np.full(fabric.n_links, -1)
    pos[links] = np.arange(len(links))
    # Dense rates of the chosen links per series entry; their running bytes are piecewise
    # linear in time, so interpolating them at the bin edges integrates each bin exactly.
    rates = np.zeros((len(ts) - 1, len(links)))
    for i, (_, idx, rate) in enumerate(rec.link_series):
        sel = pos[idx] >= 0
        rates[i, pos[idx[sel]]] = rate[sel]
    cum = np.vstack([np.zeros(len(links)), np.cumsum(rates * dt[:, None], axis=0)])
    t0, t1 = window if window is not None else (0.0, ts[-1])
    edges = np.linspace(t0, t1, time_bins + 1)
    at_edges = np.stack([np.interp(edges, ts, cum[:, j]) for j in range(len(links))]) \
        if len(links) else np.zeros((0, len(edges)))
    capacity = fabric.capacity[links].astype(np.float32).astype(float)
    util = np.diff(at_edges, axis=1) / np.diff(edges)[None, :] / capacity[:, None]
    return LinkUtilisation(links, carried[links], edges, util)


def _node_name(node: tuple) -> str:
    kind, *where = node
    return f"{kind} {':'.join(str(w) for w in where)}" if where else str(kind)


def link_label(fabric: Fabric, link: int) -> str:
    """``"gpu 0:1 → nvswitch 0 (nvlink)"``: a link's endpoints and kind."""
    u, v = fabric.endpoints[link]
    return f"{_node_name(u)} → {_node_name(v)} ({LINK_KINDS[int(fabric.kind[link])]})"


def links_figure(rec: Recorder, fabric: Fabric, title: str = "", *, top_links: int = 32,
                 time_bins: int = 200, window: tuple[float, float] | None = None) -> Figure:
    """A heatmap of the busiest links' utilisation over time (:func:`link_utilisation`).

    One row per link (its endpoints and kind), busiest by bytes first; colour is the mean
    rate over each time bin divided by the link's capacity, 0 to 1, on a square-root scale.

    A folded collective (one op standing for the identical groups of every replica of a rank
    class, :attr:`sim.program.Op.groups`) puts only its representative group's flows on the
    fabric, counted several times: only that group's links show here, carrying one group's
    rate, and the other groups' links look idle.

    Parameters
    ----------
    rec : the run's recorder, made with ``keep_link_series=True``
    fabric : the run's fabric (:attr:`sim.api.RunResult.fabric`)
    title : first line of the title (the scenario's name)
    top_links : how many links, busiest by bytes carried
    time_bins : equal time bins over the step (or the window)
    window : (start, end) in seconds to zoom to
    """
    lu = link_utilisation(rec, fabric, top_links, time_bins, window)
    n = len(lu.links)
    fig = Figure(figsize=(14, min(22.0, max(4.0, 1.8 + 0.24 * n))), layout="constrained")
    ax = fig.add_subplot()
    head = title or "link utilisation"
    if not rec.link_series:
        ax.set_title(head, fontsize=10)
        return _empty(fig, ax, "No per-link rates were recorded: simulate with "
                      "keep_link_series=True to see each link's utilisation.")
    if n == 0:
        ax.set_title(head, fontsize=10)
        return _empty(fig, ax, "No link carried any traffic in this run.")
    # A square-root colour scale: links a few percent busy stand apart from idle ones.
    img = ax.imshow(lu.utilisation, aspect="auto", interpolation="nearest", cmap="magma",
                    norm=PowerNorm(0.5, vmin=0.0, vmax=1.0),
                    extent=(lu.edges[0], lu.edges[-1], n, 0))
    ax.set_yticks(np.arange(n) + 0.5)
    ax.set_yticklabels([f"{link_label(fabric, int(i))}  {b / GB:,.1f} GB"
                        for i, b in zip(lu.links, lu.bytes, strict=True)],
                       fontsize=8 if n <= 40 else 6)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("link (busiest by bytes carried first)")
    ax.set_title(f"{head}\nutilisation of the {n} busiest of {fabric.n_links} links "
                 f"(mean rate per {np.diff(lu.edges)[0] * 1e3:.3g} ms bin / link capacity); "
                 "folded collectives show one representative group's links", fontsize=10)
    bar = fig.colorbar(img, ax=ax, pad=0.01, fraction=0.03)
    bar.set_label("utilisation")
    return fig


def links(path: Path, rec: Recorder, fabric: Fabric, title: str = "", *, top_links: int = 32,
          time_bins: int = 200, window: tuple[float, float] | None = None) -> None:
    """Write :func:`links_figure` as a PNG."""
    _save(links_figure(rec, fabric, title, top_links=top_links, time_bins=time_bins,
                       window=window), path)


def _save(fig: Figure, path: Path) -> None:
    fig.savefig(path, dpi=DPI)
    fig.clear()
