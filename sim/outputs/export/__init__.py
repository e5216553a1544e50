"""Exports of a run: summary JSON, every op as CSV, per-class bytes/s as CSV, a Chrome/Perfetto
trace, and per-rank traces in the layout Holistic Trace Analysis reads.

* :func:`chrome_trace` / :func:`write_trace`: one Chrome trace-event document (opens in
  ui.perfetto.dev and chrome://tracing): one process per simulated rank class, one thread per
  stream, one complete event per op, counter tracks for bytes/s per link class and memory per
  rank class. :func:`overlapping_slices` checks that no two slices of a track partly overlap.
* :func:`hta_traces` / :func:`write_hta_traces`: one JSON file per rank shaped like a PyTorch
  profiler (Kineto) trace, so that ``hta.trace_analysis.TraceAnalysis(trace_dir=...)`` runs on a
  simulated job exactly as on a measured one (``get_comm_comp_overlap``,
  ``get_temporal_breakdown``, ...).

Times: the recorder keeps seconds as floats; slices are written on integer nanoseconds (each
time rounded once, :func:`time_ns`) as microseconds with three decimals, so a slice that ends
where the next one starts still does after Perfetto's JSON importer turns microseconds back
into integer nanoseconds (src/trace_processor/importers/json, ``CoerceToTs``: ``llround(value *
1000)``; older versions truncate, :func:`us_from_ns` serves both), and rounding cannot make two
ops of one stream overlap.

One module per format, each name re-exported here: :mod:`sim.outputs.export.tables` (summary JSON
and the
CSVs), :mod:`sim.outputs.export.perfetto` (the Chrome/Perfetto trace), :mod:`sim.outputs.export.hta`
(the HTA
traces) and :mod:`sim.outputs.export.common` (the time rounding, rank lists and op arguments both
traces use).
"""

from __future__ import annotations

# The exports live in one module per format; every name importers used stays importable
# from here (``from sim import export; export.write_trace(...)``).
from sim.outputs.export.common import (
    ARG_RANKS,
    GIB,
    op_args,
    rank_list,
    time_ns,
    us_from_ns,
)
from sim.outputs.export.hta import (
    COMPUTE_CAPABILITY,
    CORRELATION_BASE,
    DEFAULT_STREAM_ID,
    NCCL_TYPES,
    SIDE_STREAM_ID0,
    hta_kernel_span,
    hta_traces,
    nccl_kernel_name,
    write_hta_traces,
)
from sim.outputs.export.perfetto import (
    chrome_trace,
    overlapping_slices,
    write_trace,
)
from sim.outputs.export.tables import (
    write_events_csv,
    write_memory_csv,
    write_summary,
    write_timeseries_csv,
)

__all__ = [
    "ARG_RANKS", "COMPUTE_CAPABILITY", "CORRELATION_BASE", "DEFAULT_STREAM_ID", "GIB",
    "NCCL_TYPES", "SIDE_STREAM_ID0", "chrome_trace", "hta_kernel_span", "hta_traces",
    "nccl_kernel_name", "op_args", "overlapping_slices", "rank_list", "time_ns", "us_from_ns",
    "write_events_csv", "write_hta_traces", "write_memory_csv", "write_summary",
    "write_timeseries_csv", "write_trace",
]
