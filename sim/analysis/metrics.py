"""Analysis of a recorded run: its intervals, exposed communication, bubbles and summary.

The one home of these rules (the plots and exports draw from here and compute none of their
own). Definitions follow CONTRACT.md. Interval arithmetic is per rank class: compute time is
the union of its compute and copy ops (:data:`BUSY_KINDS`); comm time the union of its
communication ops (:data:`COMM_KINDS`) from the moment they actually run (all members
arrived) to their end; exposed communication the part of comm time with no compute beside it;
a pipeline bubble the time in the step when the class runs neither. The summary reports them
on the critical rank class (:func:`critical_class`, the one whose last op ends last).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from sim.analysis.summary import BytesByClass, MemorySummary, RankClassMemory
from sim.catalog import GpuSpec
from sim.engine.recorder import OpRecord, Recorder
from sim.fabric.topology import LINK_KINDS
from sim.program.ir import Program

GIB = float(2**30)

Interval = tuple[float, float]

BUSY_KINDS = ("compute", "copy", "host")
"""Op kinds that count as compute time: kernels and copies keep the GPU busy, and the host's
own work (a CPU optimizer step) holds the step as they do: it is neither communication nor a
pipeline bubble."""
COMM_KINDS = ("collective", "send", "recv")
"""Op kinds that count as communication time."""


# ----------------------------------------------------------------------------- intervals
def merge_intervals(intervals: Iterable[Interval], gap: float = 0.0) -> list[Interval]:
    """Sorted, disjoint intervals covering the same points as ``intervals``; with ``gap``,
    intervals less than ``gap`` apart are joined too (covering the gap between them).

    Empty intervals (end <= start) are dropped.

    Examples
    --------
    >>> merge_intervals([(3, 4), (0, 2), (1, 2.5), (5, 5)])
    [(0, 2.5), (3, 4)]
    >>> merge_intervals([(2.0, 3.0), (0.0, 1.0), (1.05, 1.55)], gap=0.1)
    [(0.0, 1.55), (2.0, 3.0)]
    """
    spans = [(a, b) for a, b in intervals if b > a]
    if len(spans) > _MERGE_BY_ARRAY:
        return _merge_sorted_array(spans, gap)
    out: list[Interval] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1] + gap:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


_MERGE_BY_ARRAY = 256
"""Above this many intervals :func:`merge_intervals` merges with numpy (a large run's plots
merge hundreds of thousands of ops' intervals)."""


def _merge_sorted_array(spans: list[Interval], gap: float) -> list[Interval]:
    """:func:`merge_intervals`' loop as array operations, the same values: sorted by start
    then end, an interval opens a new run where its start is beyond the running greatest end
    so far plus ``gap`` (the end of the run it would join), and each run ends at its greatest
    end."""
    arr = np.asarray(spans, dtype=float)
    arr = arr[np.lexsort((arr[:, 1], arr[:, 0]))]
    reach = np.maximum.accumulate(arr[:, 1])
    opens = np.ones(len(arr), dtype=bool)
    opens[1:] = arr[1:, 0] > reach[:-1] + gap
    first = np.flatnonzero(opens)
    return list(zip(arr[first, 0].tolist(), np.maximum.reduceat(arr[:, 1], first).tolist(),
                    strict=True))


def subtract_intervals(a: Iterable[Interval], b: Iterable[Interval]) -> list[Interval]:
    """The parts of the union of ``a`` not covered by the union of ``b``, merged.

    Examples
    --------
    >>> subtract_intervals([(0, 10)], [(1, 2), (5, 12)])
    [(0, 1), (2, 5)]
    """
    cover = merge_intervals(b)
    out: list[Interval] = []
    j = 0
    for s, e in merge_intervals(a):
        while j < len(cover) and cover[j][1] <= s:
            j += 1
        cur = s
        k = j
        while k < len(cover) and cover[k][0] < e:
            if cover[k][0] > cur:
                out.append((cur, cover[k][0]))
            cur = max(cur, cover[k][1])
            k += 1
        if cur < e:
            out.append((cur, e))
    return out


def union_length(intervals: Iterable[Interval]) -> float:
    """Total length covered by intervals: the merged intervals' lengths summed in time order.

    The sum is an explicit left-to-right float loop, so the result does not depend on the
    Python version (``sum`` of floats is compensated from Python 3.12).

    Examples
    --------
    >>> union_length([(0, 2), (1, 3), (5, 6)])
    4.0
    """
    total = 0.0
    for s, e in merge_intervals(intervals):
        total += e - s
    return total


total_length = union_length
"""Another name for :func:`union_length` (as :mod:`sim.outputs.plot` first exported it)."""


# ----------------------------------------------------------------------------- per run
def records_by_class(records: Iterable[OpRecord]) -> dict[int, list[OpRecord]]:
    """Op records grouped by rank class, each class's in recorded order."""
    out: dict[int, list[OpRecord]] = {}
    for r in records:
        out.setdefault(r.cls, []).append(r)
    return out


def _critical(by_class: dict[int, list[OpRecord]]) -> int:
    return max(by_class, key=lambda c: (max(r.end for r in by_class[c]), -c))


def critical_class(records: Iterable[OpRecord]) -> int:
    """The rank class whose last op ends last (lowest id on ties): the one the summary's
    interval metrics describe.

    Examples
    --------
    >>> from sim.program.ir import Op
    >>> op = Op("forward", "compute", "compute", "fwd")
    >>> critical_class([OpRecord(0, op, 0, 0, 1, 0), OpRecord(1, op, 0, 0, 2, 0)])
    1
    """
    return _critical(records_by_class(records))


def busy_intervals(records: Iterable[OpRecord]) -> list[Interval]:
    """(start, end) of every compute or copy op (:data:`BUSY_KINDS`) among ``records``."""
    return [(r.start, r.end) for r in records if r.op.kind in BUSY_KINDS]


def comm_intervals(records: Iterable[OpRecord]) -> list[Interval]:
    """(start, end) of every communication op (:data:`COMM_KINDS`) among ``records``: from
    the moment it ran, all members arrived, to its end."""
    return [(r.start, r.end) for r in records if r.op.kind in COMM_KINDS]


def exposed_comm_intervals(records: Iterable[OpRecord]) -> dict[int, dict[str, list[Interval]]]:
    """Exposed communication per rank class and stream.

    On each stream, the parts of its communication ops (:func:`comm_intervals`) that no
    compute or copy op of the same rank class covers, on any stream. The union over a class's
    streams is what :func:`step_times` reports as exposed communication for that class.

    Parameters
    ----------
    records : the recorder's op records (:attr:`sim.engine.recorder.Recorder.ops`)

    Returns
    -------
    dict
        ``{rank class id: {stream: merged intervals}}``, only streams with exposed time.

    Examples
    --------
    A 2 s all-reduce starting 1 s into a 2 s forward is exposed for its last second:

    >>> from sim.program.ir import Op
    >>> fwd = Op("forward", "compute", "compute", "fwd")
    >>> ar = Op("all-reduce", "collective", "comm", "comm")
    >>> recs = [OpRecord(0, fwd, 0.0, 0.0, 2.0, 0), OpRecord(0, ar, 1.0, 1.0, 3.0, 0)]
    >>> exposed_comm_intervals(recs)
    {0: {'comm': [(2.0, 3.0)]}}
    """
    out: dict[int, dict[str, list[Interval]]] = {}
    for cls, recs in records_by_class(records).items():
        streams = class_exposed_comm(recs)
        if streams:
            out[cls] = streams
    return out


def class_exposed_comm(recs: list[OpRecord]) -> dict[str, list[Interval]]:
    """One rank class's exposed communication by stream (only streams with some): the rule
    :func:`exposed_comm_intervals` applies to each class and :func:`step_times` to the
    critical one."""
    busy = merge_intervals(busy_intervals(recs))
    comm_by_stream: dict[str, list[Interval]] = {}
    for r in recs:
        if r.op.kind in COMM_KINDS:
            comm_by_stream.setdefault(r.op.stream, []).append((r.start, r.end))
    streams = {s: subtract_intervals(iv, busy) for s, iv in comm_by_stream.items()}
    return {s: iv for s, iv in streams.items() if iv}


def step_spans(records: Iterable[OpRecord]) -> list[Interval]:
    """Start and end of each recorded step.

    Steps run back to back from time 0 (:meth:`sim.engine.core.Engine.run_step` starts a step when
    the previous one's last op, over every rank class, has ended).

    Examples
    --------
    >>> from sim.program.ir import Op
    >>> op = Op("forward", "compute", "compute", "fwd")
    >>> step_spans([OpRecord(0, op, 0.1, 0.1, 1.0, 0), OpRecord(1, op, 0.0, 1.2, 2.0, 1)])
    [(0.0, 1.0), (1.0, 2.0)]
    """
    ends: dict[int, float] = {}
    for r in records:
        ends[r.step] = max(ends.get(r.step, 0.0), r.end)
    spans: list[Interval] = []
    start = 0.0
    for step in sorted(ends):
        spans.append((start, ends[step]))
        start = ends[step]
    return spans


def class_idle(spans: list[Interval], recs: list[OpRecord]) -> list[Interval]:
    """One rank class's idle time within the steps ``spans`` (:func:`step_spans`): the rule
    :func:`bubble_intervals` applies to each class and :func:`step_times` to the critical
    one."""
    return subtract_intervals(spans, busy_intervals(recs) + comm_intervals(recs))


def bubble_intervals(records: Iterable[OpRecord]) -> dict[int, list[Interval]]:
    """Idle time per rank class: the pipeline bubbles.

    The times within the step when none of a class's ops runs: no compute or copy op (on
    any stream) and no communication op (that part is exposed communication, see
    :func:`exposed_comm_intervals`). For a pipeline stage this is the warm-up wait for the
    first micro-batch, the gaps between its forwards and backwards, and the drain after its
    last. On the critical class its length is :func:`step_times`'s bubble:
    step time less compute less exposed communication.

    Parameters
    ----------
    records : the recorder's op records (:attr:`sim.engine.recorder.Recorder.ops`)

    Returns
    -------
    dict
        ``{rank class id: merged idle intervals}`` for every class with ops.

    Examples
    --------
    In a 4 s step, a stage computes for 1 s, sends for 0.5 s, waits, and computes from 3 s
    to 3.5 s; another class ends the step at 4 s:

    >>> from sim.program.ir import Op
    >>> fwd = Op("forward", "compute", "compute", "fwd")
    >>> send = Op("send", "send", "pp-fwd", "comm")
    >>> recs = [OpRecord(0, fwd, 0.0, 0.0, 1.0, 0), OpRecord(0, send, 1.0, 1.0, 1.5, 0),
    ...         OpRecord(0, fwd, 3.0, 3.0, 3.5, 0), OpRecord(1, fwd, 0.0, 0.0, 4.0, 0)]
    >>> bubble_intervals(recs)
    {0: [(1.5, 3.0), (3.5, 4.0)], 1: []}
    """
    records = list(records)
    spans = step_spans(records)
    out: dict[int, list[Interval]] = {}
    for cls, recs in records_by_class(records).items():
        out[cls] = class_idle(spans, recs)
    return out


def host_bound_intervals(spans: list[Interval], recs: list[OpRecord]) -> list[Interval]:
    """One rank class's host-bound time within the steps ``spans``: the part of its idle time
    (:func:`class_idle`: none of its ops runs) in which an op whose inputs were all there was
    still waiting for the host to issue it (:attr:`OpRecord.held`: Python and launch
    overhead the GPU could not hide).

    Examples
    --------
    A 4 s step: a forward from 0 to 1 s; the next op's input is there at 1 s but the host
    issues it at 2.5 s and it runs to 3 s; a collective then waits for a peer until 3.5 s:

    >>> from sim.program.ir import Op
    >>> fwd = Op("forward", "compute", "compute", "fwd")
    >>> ag = Op("all_gather", "collective", "comm", "comm")
    >>> recs = [OpRecord(0, fwd, 0.0, 0.0, 1.0, 0), OpRecord(0, fwd, 2.5, 2.5, 3.0, 0, 1.5),
    ...         OpRecord(0, ag, 3.0, 3.5, 4.0, 0)]
    >>> host_bound_intervals([(0.0, 4.0)], recs)
    [(1.0, 2.5)]
    """
    held = merge_intervals((r.ready - r.held, r.ready) for r in recs if r.held > 0)
    if not held:
        return []
    return subtract_intervals(class_idle(spans, recs), subtract_intervals(spans, held))


# ----------------------------------------------------------------------------- summary
@dataclass
class StepTimes:
    step_time_s: float
    compute_time_s: float
    comm_time_s: float
    exposed_comm_s: float
    bubble_fraction: float
    critical_class: int
    host_bound_s: float = 0.0
    """Per step, the critical class's host-bound time (:func:`host_bound_intervals`)."""


def step_times(rec: Recorder, program: Program, steps: int, wall: float) -> StepTimes:
    """Per-step averages of the interval metrics, on the critical rank class.

    Exposed communication is the length of that class's exposed intervals
    (:func:`class_exposed_comm`, what :func:`exposed_comm_intervals` gives the timeline), the
    bubble (with more than one pipeline stage) the share of the run ``wall`` in its idle
    intervals (:func:`class_idle`, what :func:`bubble_intervals` shades): the same sets the
    plots draw, measured once. (Until issue 12 the summary measured them as union of
    communication and compute less union of compute, and as run time less compute less
    exposed communication: equal up to rounding, about 1e-14 s.)
    """
    by_class = records_by_class(rec.ops)
    critical = _critical(by_class)
    recs = by_class[critical]
    compute_t = union_length(busy_intervals(recs))
    comm_t = union_length(comm_intervals(recs))
    exposed = union_length(iv for ivs in class_exposed_comm(recs).values() for iv in ivs)
    spans = step_spans(rec.ops)
    bubble = 0.0
    if program.pipeline_stages > 1 and wall > 0:
        bubble = union_length(class_idle(spans, recs)) / wall
    host = union_length(host_bound_intervals(spans, recs))
    return StepTimes(wall / steps, compute_t / steps, comm_t / steps, exposed / steps, bubble,
                     critical, host / steps)


def bytes_by_class(class_bytes: Iterable[float], steps: int) -> BytesByClass:
    """The summary's ``bytes``: the network's bytes per link class (in :data:`LINK_KINDS`
    order, each hop counted) per step.

    Examples
    --------
    >>> bytes_by_class([8.0, 4.0, 2.0, 0.0, 0.0], 2)["pcie"]
    2.0
    """
    per_step = dict(zip(LINK_KINDS, (float(v) / steps for v in class_bytes), strict=True))
    return {"nvlink": per_step["nvlink"], "pcie": per_step["pcie"],
            "network": per_step["network"], "cross_az": per_step["cross_az"],
            "cross_region": per_step["cross_region"]}


def memory_summary(rec: Recorder, program: Program, gpu: GpuSpec) -> MemorySummary:
    """The memory keys of the summary.

    ``peak_memory_gib``: bytes of live tensors at their peak (``max_memory_allocated``);
    ``peak_reserved_gib``: the caching allocator's segments at their peak
    (``max_memory_reserved``, what torchtitan reports); ``peak_nvidia_smi_gib``: that plus
    the CUDA context and NCCL's buffers, what ``nvidia-smi`` shows. ``oom`` is judged on the
    last against the memory CUDA reports (or a ``cudaMalloc`` that failed even after the
    allocator released its cache), on every rank class.
    """
    usable = gpu.usable_memory_bytes
    rows: list[RankClassMemory] = []
    for c in program.classes:
        tr = rec.memory.get(c.id)
        over = rec.overheads.get(c.id)
        outside = over.outside_allocator if over is not None else 0.0
        reserved = tr.reserved_peak if tr is not None else 0.0
        smi = reserved + outside
        rows.append({
            "rank_class": c.id, "label": c.label, "ranks": len(c.members),
            "peak_gib": tr.peak / GIB if tr is not None else 0.0,
            "peak_time_s": tr.peak_time if tr is not None else 0.0,
            "breakdown_gib": ({k: v / GIB for k, v in tr.peak_breakdown.items()}
                              if tr is not None else {}),
            "peak_reserved_gib": reserved / GIB,
            "peak_reserved_time_s": tr.reserved_peak_time if tr is not None else 0.0,
            "peak_nvidia_smi_gib": smi / GIB,
            "oom": smi > usable or (tr is not None and tr.ledger.allocator.oom),
            # cudaMalloc failures the allocator survived by freeing its cache and retrying
            # (torch.cuda.memory_stats' num_alloc_retries; DeepSpeed warns about them).
            "allocator_retries": tr.ledger.allocator.retries if tr is not None else 0,
        })
    critical = max(rec.memory.values(), key=lambda t: t.peak) if rec.memory else None
    over = max(rec.overheads.values(), key=lambda o: o.outside_allocator + o.cublas_workspace,
               default=None)
    return {
        "peak_memory_gib": max((r["peak_gib"] for r in rows), default=0.0),
        "peak_reserved_gib": max((r["peak_reserved_gib"] for r in rows), default=0.0),
        "peak_nvidia_smi_gib": max((r["peak_nvidia_smi_gib"] for r in rows), default=0.0),
        "gpu_memory_gib": gpu.usable_memory_gib,
        "oom": any(r["oom"] for r in rows),
        "memory_overheads_gib": ({"cuda_context": over.cuda_context / GIB,
                                  "nccl": over.nccl / GIB,
                                  "cublas_workspace": over.cublas_workspace / GIB}
                                 if over is not None else {}),
        "peak_memory_breakdown_gib": (
            {k: v / GIB for k, v in critical.peak_breakdown.items()} if critical else {}),
        "memory_by_rank_class": rows,
    }
