"""Exports of a run: summary JSON, every op as CSV, per-class bytes/s as CSV, and a
Chrome/Perfetto trace (one process per simulated rank class, one thread per stream)."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from sim.recorder import Recorder
from sim.topology import LINK_KINDS


def write_summary(path: Path, summary: dict[str, Any]) -> None:
    path.write_text(json.dumps(summary, indent=2) + "\n")


def write_events_csv(path: Path, rec: Recorder) -> None:
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


def chrome_trace(rec: Recorder, labels: dict[int, str] | None = None) -> dict[str, Any]:
    """A Chrome trace-event document (opens in ui.perfetto.dev): complete events per op,
    counter tracks for bytes/s per link class and memory per rank class."""
    events: list[dict[str, Any]] = []
    tids: dict[tuple[int, str], int] = {}
    for r in rec.ops:
        key = (r.cls, r.op.stream)
        if key not in tids:
            tids[key] = len([k for k in tids if k[0] == r.cls]) + 1
            events.append({"ph": "M", "name": "thread_name", "pid": r.cls, "tid": tids[key],
                           "args": {"name": r.op.stream}})
        args: dict[str, Any] = {"category": r.op.category, "phase": r.op.phase}
        if r.op.nbytes:
            args["bytes"] = r.op.nbytes
        if r.op.group:
            args["group_size"] = len(r.op.group)
        if r.op.layer is not None:
            args["layer"] = r.op.layer
        if r.op.micro_batch is not None:
            args["micro_batch"] = r.op.micro_batch
        events.append({"ph": "X", "name": r.op.name, "cat": r.op.category, "pid": r.cls,
                       "tid": tids[key], "ts": r.start * 1e6,
                       "dur": max(0.0, (r.end - r.start) * 1e6), "args": args})
    for pid in sorted({k[0] for k in tids}):
        name = (labels or {}).get(pid, f"rank class {pid}")
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}})
    for t, rates in rec.rate_series:
        events.append({"ph": "C", "name": "bytes/s by link class", "pid": 0, "ts": t * 1e6,
                       "args": {k: float(v) for k, v in zip(LINK_KINDS, rates, strict=True)}})
    for cls, track in rec.memory.items():
        for t, cur in track.series:
            events.append({"ph": "C", "name": "memory (GiB)", "pid": cls, "ts": t * 1e6,
                           "args": {k: v / 2**30 for k, v in cur.items()}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(path: Path, rec: Recorder, labels: dict[int, str] | None = None) -> None:
    path.write_text(json.dumps(chrome_trace(rec, labels)))
