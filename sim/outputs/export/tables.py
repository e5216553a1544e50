"""CSV and JSON exports of a run: the summary, every op, bytes/s per link class, memory.

Part of :mod:`sim.outputs.export` (which re-exports every name here): ``fabricsim run --out`` writes
``summary.json``, ``events.csv``, ``timeseries.csv`` and ``memory.csv`` with these.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from sim.analysis.summary import Summary
from sim.engine.recorder import Recorder
from sim.fabric.topology import LINK_KINDS


def write_summary(path: Path, summary: Summary) -> None:
    """The run summary as indented JSON (``summary.json``)."""
    path.write_text(json.dumps(summary, indent=2) + "\n")


def write_events_csv(path: Path, rec: Recorder) -> None:
    """Every recorded op, one row each: where, what, when (seconds) and bytes."""
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["step", "rank_class", "stream", "name", "kind", "category", "phase",
                    "layer", "micro_batch", "ready_s", "start_s", "end_s", "bytes"])
        for r in rec.ops:
            op = r.op
            w.writerow([r.step, r.cls, op.stream, op.name, op.kind, op.category, op.phase,
                        "" if op.layer is None else op.layer,
                        "" if op.micro_batch is None else op.micro_batch,
                        f"{r.ready:.9f}", f"{r.start:.9f}", f"{r.end:.9f}",
                        f"{op.nbytes:.0f}" if op.nbytes else ""])


def write_timeseries_csv(path: Path, rec: Recorder) -> None:
    """Bytes/s per link class, piecewise constant from each row's time to the next row's."""
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["time_s"] + [f"{k}_bytes_per_s" for k in LINK_KINDS])
        for t, rates in rec.rate_series:
            w.writerow([f"{t:.9f}"] + [f"{x:.6g}" for x in rates])


def write_memory_csv(path: Path, rec: Recorder, labels: dict[int, str] | None = None
                     ) -> None:
    """GPU memory per rank class over time, by category, piecewise constant from each row's
    time to the next row's of the same class."""
    cats = sorted({k for track in rec.memory.values() for _, cur in track.series for k in cur})
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["rank_class", "label", "time_s"] + [f"{c}_bytes" for c in cats]
                   + ["total_bytes"])
        for cls, track in sorted(rec.memory.items()):
            label = (labels or {}).get(cls, f"rank class {cls}")
            for t, cur in track.series:
                vals = [cur.get(c, 0.0) for c in cats]
                w.writerow([cls, label, f"{t:.9f}"] + [f"{v:.0f}" for v in vals]
                           + [f"{sum(vals):.0f}"])

