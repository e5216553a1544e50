"""The summary of a run, computed from the recorder: times, utilisation, memory, bytes.

Definitions follow CONTRACT.md. Interval arithmetic is on the critical rank class (the one
whose last op ends last): compute time is the union of its compute and copy ops; comm time the
union of its collectives from the moment they actually run (all members arrived) to their end;
exposed comm the part of comm time with no compute beside it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sim.catalog import GpuSpec
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


def memory_summary(rec: Recorder, program: Program, gpu: GpuSpec) -> dict[str, Any]:
    """The memory keys of the summary.

    ``peak_memory_gib``: bytes of live tensors at their peak (``max_memory_allocated``);
    ``peak_reserved_gib``: the caching allocator's segments at their peak
    (``max_memory_reserved``, what torchtitan reports); ``peak_nvidia_smi_gib``: that plus
    the CUDA context and NCCL's buffers, what ``nvidia-smi`` shows. ``oom`` is judged on the
    last against the memory CUDA reports (or a ``cudaMalloc`` that failed even after the
    allocator released its cache), on every rank class.
    """
    usable = gpu.usable_memory_bytes
    rows: list[dict[str, Any]] = []
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
