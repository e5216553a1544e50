"""What every plot of a run shares: the Agg canvas, resolution and units, the end of the
recorded step, zoom windows, empty panels and saving.

Part of :mod:`sim.outputs.plot` (which re-exports the public names); each figure lives in its own
module (:mod:`sim.outputs.plot.timeline`, :mod:`sim.outputs.plot.traffic`,
:mod:`sim.outputs.plot.memory`).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import matplotlib

# Figures are drawn on the Agg canvas, with no display needed (set before pyplot is imported).
matplotlib.use("Agg")
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from sim.analysis.metrics import Interval  # noqa: E402
from sim.engine.recorder import Recorder  # noqa: E402

DPI = 120
GIB = float(2**30)
GB = 1e9
"""Transfer is billed per decimal gigabyte (as :mod:`sim.analysis.cost` counts it)."""
OTHER_COLOR = "#A0A0A0"
"""Grey for what the palettes do not name (categories, memory kinds)."""


def step_end(rec: Recorder) -> float:
    """The end of the recorded run: its last op or its last rate change."""
    ends = [r.end for r in rec.ops] + [t for t, _ in rec.rate_series[-1:]]
    return max(ends, default=0.0)


def check_window(window: tuple[float, float] | None) -> None:
    """Refuse a zoom window that ends before it starts."""
    if window is not None and not window[1] > window[0]:
        raise ValueError(f"window: end {window[1]} must come after start {window[0]}")


def clip(intervals: Iterable[Interval], window: tuple[float, float] | None) -> list[Interval]:
    """The intervals cut to ``window`` (all of them, unchanged, without one)."""
    if window is None:
        return [(a, b) for a, b in intervals]
    t0, t1 = window
    return [(max(a, t0), min(b, t1)) for a, b in intervals if b > t0 and a < t1]


def empty(fig: Figure, ax: Axes, text: str) -> Figure:
    """``fig`` with ``text`` in place of the axes' drawing (nothing recorded to plot)."""
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, wrap=True)
    ax.set_axis_off()
    return fig


def save_png(fig: Figure, path: Path) -> None:
    """Save ``fig`` as a PNG at :data:`DPI` and free what it drew."""
    fig.savefig(path, dpi=DPI)
    fig.clear()
