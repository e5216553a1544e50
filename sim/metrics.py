"""The summary of a run, computed from the recorder: times, utilisation, memory, bytes.

Definitions follow CONTRACT.md. Interval arithmetic is on the critical rank class (the one
whose last op ends last): compute time is the union of its compute and copy ops; comm time the
union of its collectives from the moment they actually run (all members arrived) to their end;
exposed comm the part of comm time with no compute beside it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from sim.program import Program
from sim.recorder import OpRecord, Recorder
from sim.topology import LINK_KINDS

GIB = float(2**30)


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by intervals.

    Examples
    --------
    >>> union_length([(0, 2), (1, 3), (5, 6)])
    4.0
    """
    total = 0.0
    start = end = None
    for a, b in sorted(intervals):
        if end is None or start is None or a > end:
            if end is not None and start is not None:
                total += end - start
            start, end = a, b
        else:
            end = max(end, b)
    if end is not None and start is not None:
        total += end - start
    return total


def subtract_length(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the union of ``a`` not covered by the union of ``b``."""
    return union_length(a + b) - union_length(b)


@dataclass
class StepTimes:
    step_time_s: float
    compute_time_s: float
    comm_time_s: float
    exposed_comm_s: float
    bubble_fraction: float
    critical_class: int


def step_times(rec: Recorder, program: Program, steps: int, wall: float) -> StepTimes:
    """Per-step averages of the interval metrics."""
    by_class: dict[int, list[OpRecord]] = {}
    for r in rec.ops:
        by_class.setdefault(r.cls, []).append(r)
    critical = max(by_class, key=lambda c: (max(r.end for r in by_class[c]), -c))
    recs = by_class[critical]
    compute = [(r.start, r.end) for r in recs if r.op.kind in ("compute", "copy")]
    comm = [(r.start, r.end) for r in recs if r.op.kind in ("collective", "send", "recv")]
    compute_t = union_length(compute)
    comm_t = union_length(comm)
    exposed = subtract_length(comm, compute)
    bubble = 0.0
    if int(str(program.meta.get("pipeline_stages", 1))) > 1:
        # Idle compute on the critical stage, less the exposed communication already counted.
        bubble = max(0.0, (wall - compute_t - exposed) / wall) if wall > 0 else 0.0
    return StepTimes(wall / steps, compute_t / steps, comm_t / steps, exposed / steps, bubble,
                     critical)


def bytes_by_class(class_bytes: Iterable[float], steps: int) -> dict[str, float]:
    return {k: float(v) / steps for k, v in zip(LINK_KINDS, class_bytes, strict=True)}
