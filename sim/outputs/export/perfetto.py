"""The Chrome trace-event document of a run (opens in ui.perfetto.dev and chrome://tracing).

Part of :mod:`sim.outputs.export` (which re-exports every public name here): one process per
simulated
rank class, one thread per stream, one complete event per op, counter tracks for bytes/s per
link class and memory per rank class; :func:`overlapping_slices` checks that no two slices of
a track partly overlap. Times go through :func:`sim.outputs.export.common.time_ns` and
:func:`~sim.outputs.export.common.us_from_ns` (see :mod:`sim.outputs.export`, "Times").
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from sim.engine.recorder import Recorder
from sim.fabric.topology import LINK_KINDS
from sim.outputs.export.common import GIB, op_args, rank_list, stream_order, time_ns, us_from_ns
from sim.program.ir import MEMORY_CATEGORIES, Op, Program


def chrome_trace(rec: Recorder, labels: dict[int, str] | None = None, *,
                 program: Program | None = None, scenario: str = "") -> dict[str, Any]:
    """A Chrome trace-event document of a run (opens in ui.perfetto.dev).

    Parameters
    ----------
    rec : the run's recorder
    labels : optional name per rank class id (overrides the program's labels)
    program : the run's program: names each process after its class label and the ranks it
        stands for, and orders streams; without it, processes are named by label alone
    scenario : scenario name, written into the document's ``otherData``

    Returns
    -------
    dict
        ``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}``: one process
        per rank class (``process_name``, ``process_sort_index``), one thread per stream
        (``thread_name``, ``thread_sort_index``, compute first), one complete ("X") event per
        op on integer-nanosecond times, a counter ("C") per link class in GB/s on a "fabric"
        process, and a memory counter per rank class in GiB by category.
    """
    events: list[dict[str, Any]] = []
    classes = {c.id: c for c in program.classes} if program is not None else {}
    class_ids = sorted(set(classes) | {r.cls for r in rec.ops} | set(rec.memory))
    # pid 0 is the idle process in Perfetto's model of a system: start at 1.
    pid = {c: i + 1 for i, c in enumerate(class_ids)}
    fabric_pid = len(class_ids) + 1

    for c in class_ids:
        label = (labels or {}).get(c) or (classes[c].label if c in classes else "") \
            or f"rank class {c}"
        if c in classes:
            members = classes[c].members
            label = f"{label} [ranks {rank_list(members)}]"
        events.append({"ph": "M", "name": "process_name", "pid": pid[c], "tid": 0,
                       "args": {"name": label}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid[c], "tid": 0,
                       "args": {"sort_index": c + 1}})
    events.append({"ph": "M", "name": "process_name", "pid": fabric_pid, "tid": 0,
                   "args": {"name": "fabric: bytes/s per link class (all ranks)"}})
    events.append({"ph": "M", "name": "process_sort_index", "pid": fabric_pid, "tid": 0,
                   "args": {"sort_index": 0}})

    # Threads: one per stream of each class.
    tid: dict[tuple[int, str], int] = {}
    for c in class_ids:
        if c in classes:
            ops: Iterable[Op] = (o for s in classes[c].streams.values() for o in s)
        else:
            ops = (r.op for r in rec.ops if r.cls == c)
        for i, stream in enumerate(stream_order(ops)):
            tid[(c, stream)] = i + 1
            events.append({"ph": "M", "name": "thread_name", "pid": pid[c], "tid": i + 1,
                           "args": {"name": stream}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": pid[c],
                           "tid": i + 1, "args": {"sort_index": i}})

    slices: list[dict[str, Any]] = []
    # Background ops (an asynchronous checkpoint's write) on their own thread of the class.
    for r in (*rec.ops, *rec.background_ops):
        key = (r.cls, r.op.stream)
        if key not in tid:  # a stream the program did not list (defensive)
            tid[key] = 1 + max((t for (c, _), t in tid.items() if c == r.cls), default=0)
            events.append({"ph": "M", "name": "thread_name", "pid": pid[r.cls],
                           "tid": tid[key], "args": {"name": r.op.stream}})
        a, b = time_ns(r.start), time_ns(r.end)
        slices.append({"ph": "X", "name": r.op.name, "cat": r.op.category or r.op.kind,
                       "pid": pid[r.cls], "tid": tid[key], "ts": a, "dur": max(0, b - a),
                       "args": op_args(r, rec)})
    _clamp_partial_overlaps(slices)
    for e in slices:
        e["ts"], e["dur"] = us_from_ns(e["ts"]), us_from_ns(e["dur"])
    events.extend(slices)

    # Bytes/s per link class: a counter each, piecewise constant from one sample to the
    # next; only changes are written. Times unrounded (no slices here), so integrating the
    # samples gives back the recorder's bytes.
    last: list[float | None] = [None] * len(LINK_KINDS)
    for t, rates in rec.rate_series:
        for k, kind in enumerate(LINK_KINDS):
            v = float(rates[k]) / 1e9
            if v != last[k]:
                events.append({"ph": "C", "name": f"{kind} GB/s", "pid": fabric_pid,
                               "ts": t * 1e6, "args": {"GB/s": v}})
                last[k] = v
    for c, track in sorted(rec.memory.items()):
        # Categories a builder adds (Megatron's moe_dispatch) follow the standard ones.
        cats = MEMORY_CATEGORIES + tuple(sorted(
            {k for _, cur in track.series for k in cur} - set(MEMORY_CATEGORIES)))
        for t, cur in track.series:
            events.append({"ph": "C", "name": "memory (GiB)", "pid": pid[c], "ts": t * 1e6,
                           "args": {k: cur.get(k, 0.0) / GIB for k in cats}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"scenario": scenario, "generator": "fabricsim",
                          "link_counters": "GB/s (1e9 bytes/s) per link class",
                          "memory_counters": "GiB (2^30 bytes) per rank class"}}


def _clamp_partial_overlaps(slices: list[dict[str, Any]]) -> None:
    """Guard, on integer-nanosecond slices: where a slice starts inside the previous one of
    its track and would end after it, end the previous one where it starts. Ops of one stream
    run one after another, so with monotonic rounding this never fires on a recorder's ops."""
    by_track: dict[tuple[Any, Any], list[dict[str, Any]]] = {}
    for e in slices:
        by_track.setdefault((e["pid"], e["tid"]), []).append(e)
    for spans in by_track.values():
        spans.sort(key=lambda e: (e["ts"], -e["dur"]))
        for prev, cur in zip(spans, spans[1:], strict=False):
            prev_end = prev["ts"] + prev["dur"]
            if cur["ts"] < prev_end < cur["ts"] + cur["dur"]:
                prev["dur"] = cur["ts"] - prev["ts"]


def overlapping_slices(trace: dict[str, Any] | list[dict[str, Any]]
                       ) -> list[tuple[tuple[Any, Any], dict[str, Any], dict[str, Any]]]:
    """Pairs of complete events on one (pid, tid) track that partly overlap.

    On a well-formed track every two slices either nest (one inside the other) or are
    disjoint (touching ends allowed); a partial overlap is what trace viewers draw wrongly or
    drop. Times are compared as integer nanoseconds, the way Perfetto's JSON importer reads
    microseconds (``llround(us * 1000)``).

    Parameters
    ----------
    trace : a trace document (``{"traceEvents": [...]}``) or its list of events

    Returns
    -------
    list
        ``((pid, tid), outer, inner)`` for every slice ``inner`` that starts inside ``outer``
        and ends after it; empty when every track nests or is disjoint.

    Examples
    --------
    >>> ok = [{"ph": "X", "pid": 1, "tid": 1, "ts": 0, "dur": 10},
    ...       {"ph": "X", "pid": 1, "tid": 1, "ts": 2, "dur": 3},
    ...       {"ph": "X", "pid": 1, "tid": 1, "ts": 10, "dur": 0}]
    >>> overlapping_slices(ok)
    []
    >>> bad = ok + [{"ph": "X", "pid": 1, "tid": 1, "ts": 9.999, "dur": 1}]
    >>> [(k, o["ts"], i["ts"]) for k, o, i in overlapping_slices(bad)]
    [((1, 1), 0, 9.999)]
    """
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    tracks: dict[tuple[Any, Any], list[tuple[int, int, dict[str, Any]]]] = {}
    for e in events:
        if e.get("ph") != "X":
            continue
        a = _perfetto_ns(float(e["ts"]))
        b = a + _perfetto_ns(float(e.get("dur", 0.0)))
        tracks.setdefault((e.get("pid"), e.get("tid")), []).append((a, b, e))
    found: list[tuple[tuple[Any, Any], dict[str, Any], dict[str, Any]]] = []
    for key, spans in tracks.items():
        spans.sort(key=lambda s: (s[0], -s[1]))
        open_: list[tuple[int, int, dict[str, Any]]] = []  # enclosing slices, innermost last
        for a, b, e in spans:
            while open_ and open_[-1][1] <= a:
                open_.pop()
            if open_ and b > open_[-1][1]:
                found.append((key, open_[-1][2], e))
                continue
            open_.append((a, b, e))
    return found


def _perfetto_ns(us: float) -> int:
    # llround(us * 1000): half a nanosecond rounds away from zero, as in C.
    return int(math.copysign(math.floor(abs(us) * 1000 + 0.5), us))


def write_trace(path: Path, rec: Recorder, labels: dict[int, str] | None = None, *,
                program: Program | None = None, scenario: str = "") -> None:
    """Write :func:`chrome_trace` to ``path`` (``trace.json``)."""
    path.write_text(json.dumps(chrome_trace(rec, labels, program=program, scenario=scenario)))
