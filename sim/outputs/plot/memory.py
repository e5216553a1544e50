"""GPU memory per rank class over time, stacked by category, with what the caching allocator
reserves and the GPU's usable memory.

Part of :mod:`sim.outputs.plot` (which re-exports every public name here).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from matplotlib.artist import Artist
from matplotlib.figure import Figure

from sim.engine.recorder import Recorder
from sim.outputs.plot.common import GIB, OTHER_COLOR, check_window, empty, save_png, step_end
from sim.program.ir import MEMORY_CATEGORIES

CAPACITY_AXIS_SHARE = 0.1
"""Memory plots draw the GPU's capacity when the highest peak shown uses at least this
share of it (a readability choice)."""
MEMORY_COLORS = {
    "parameters": "#4C78A8",
    "gradients": "#F58518",
    "optimizer": "#54A24B",
    "activations": "#E45756",
    "buffers": "#B0B0B0",
    "moe_dispatch": "#B279A2",   # Megatron's MoE token-dispatch buffers (moe_memory.py)
}


def memory_stack(rec: Recorder, cls: int, t_end: float | None = None
                 ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """One rank class's memory by category over time, bytes, piecewise constant from each
    time on; categories in :data:`~sim.program.ir.MEMORY_CATEGORIES` order (others after), only
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
    the title), each a stacked step area of :data:`~sim.program.ir.MEMORY_CATEGORIES` with the
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
    check_window(window)
    labels = labels or {}
    t_end = step_end(rec)
    tracked = [c for c, tr in rec.memory.items() if tr.series]
    if not tracked:
        fig = Figure(figsize=(12, 3), layout="constrained")
        return empty(fig, fig.add_subplot(), "no memory series recorded")
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
    save_png(memory_figure(rec, title, labels, capacity_gib, max_panels=max_panels,
                        window=window), path)
