"""Plots of a run: the timeline, bytes over time, memory over time and link utilisation.

Each plot has a builder, ``*_figure(...)``, that returns a :class:`matplotlib.figure.Figure`
(tests inspect it) and a writer that saves it as PNG at :data:`DPI` dots per inch. Figures are
made with :class:`~matplotlib.figure.Figure` directly, not through ``pyplot``: no global figure
registry holds them, so nothing needs closing and nothing leaks between plots (the Agg canvas
draws them without a display).

* :func:`timeline` -- a Gantt chart, one row per simulated rank class and stream, ops coloured
  by :attr:`sim.program.ir.Op.category`; pipeline bubbles shaded and exposed communication marked,
  as :mod:`sim.analysis.metrics` defines them (:func:`sim.analysis.metrics.bubble_intervals`,
  :func:`sim.analysis.metrics.exposed_comm_intervals`). The plots compute no analysis of their own:
  intervals, exposed communication, bubbles and the critical rank class come from
  :mod:`sim.analysis.metrics`.
* :func:`bytes_over_time` -- bytes/s per link class, and the cumulative bytes that crossed
  a zone or region boundary with what they cost.
* :func:`memory_over_time` -- memory per rank class by category, stacked.
* :func:`links` -- utilisation of the busiest links over time (needs the recorder's
  ``keep_link_series``).

One module per figure, each name re-exported here: :mod:`sim.outputs.plot.timeline`,
:mod:`sim.outputs.plot.traffic` (bytes over time and link utilisation),
:mod:`sim.outputs.plot.memory`, and
:mod:`sim.outputs.plot.common` (resolution, units, windows and saving, which they share).
"""

from __future__ import annotations

# The analysis the plots draw: one home, sim.analysis.metrics. Names re-exported here (``as``) stay
# importable from sim.outputs.plot, where the tests and the first callers found them.
from sim.analysis.metrics import BUSY_KINDS as BUSY_KINDS
from sim.analysis.metrics import COMM_KINDS as COMM_KINDS
from sim.analysis.metrics import Interval as Interval
from sim.analysis.metrics import bubble_intervals as bubble_intervals
from sim.analysis.metrics import critical_class as critical_class
from sim.analysis.metrics import exposed_comm_intervals as exposed_comm_intervals
from sim.analysis.metrics import merge_intervals as merge_intervals
from sim.analysis.metrics import records_by_class as records_by_class
from sim.analysis.metrics import step_spans as step_spans
from sim.analysis.metrics import subtract_intervals as subtract_intervals
from sim.analysis.metrics import total_length as total_length

# The figures, one module each; every name importers used stays importable from here.
from sim.outputs.plot.common import DPI, GB, GIB, OTHER_COLOR
from sim.outputs.plot.memory import (
    CAPACITY_AXIS_SHARE,
    MEMORY_COLORS,
    memory_figure,
    memory_over_time,
    memory_stack,
)
from sim.outputs.plot.timeline import (
    BUBBLE_EDGE,
    BUBBLE_FACE,
    BUBBLE_LABEL,
    CATEGORY_COLORS,
    COMPUTE_STREAM,
    EXPOSED_COLOR,
    EXPOSED_LABEL,
    select_rank_classes,
    timeline,
    timeline_figure,
)
from sim.outputs.plot.traffic import (
    LINK_KIND_COLORS,
    LOG_RATE_SPAN,
    LinkUtilisation,
    bytes_figure,
    bytes_over_time,
    cumulative_bytes,
    link_label,
    link_utilisation,
    links,
    links_figure,
)

__all__ = [
    "BUBBLE_EDGE", "BUBBLE_FACE", "BUBBLE_LABEL", "BUSY_KINDS", "CAPACITY_AXIS_SHARE",
    "CATEGORY_COLORS", "COMM_KINDS", "COMPUTE_STREAM", "DPI", "EXPOSED_COLOR", "EXPOSED_LABEL",
    "GB", "GIB", "LINK_KIND_COLORS", "LOG_RATE_SPAN", "MEMORY_COLORS", "OTHER_COLOR",
    "Interval", "LinkUtilisation", "bubble_intervals", "bytes_figure", "bytes_over_time",
    "critical_class", "cumulative_bytes", "exposed_comm_intervals", "link_label",
    "link_utilisation", "links", "links_figure", "memory_figure", "memory_over_time",
    "memory_stack", "merge_intervals", "records_by_class", "select_rank_classes", "step_spans",
    "subtract_intervals", "timeline", "timeline_figure", "total_length",
]
