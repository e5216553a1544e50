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
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from sim.catalog import GpuSpec
from sim.metrics import COMM_KINDS, records_by_class
from sim.program import MEMORY_CATEGORIES, Op, Program, RankClass
from sim.recorder import OpRecord, Recorder
from sim.topology import LINK_KINDS

GIB = float(2**30)

# How many ranks of a group an op's arguments list before "..." (a 4,096-rank data-parallel
# group would otherwise fill the details panel).
ARG_RANKS = 8


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


# --------------------------------------------------------------------------- shared helpers
def time_ns(t: float) -> int:
    """Simulated seconds as integer nanoseconds: the one rounding every slice goes through.

    Rounding is monotonic, so an op that starts when the previous op of its stream ends (or
    later) still does after rounding.

    Examples
    --------
    >>> time_ns(0.0013405952013191599)
    1340595
    """
    return round(t * 1e9)


def us_from_ns(ns: int) -> float:
    """Integer nanoseconds as the microseconds a trace holds: the nearest double to
    ``ns / 1000``, moved up one unit in the last place where that double times 1000 falls
    below ``ns``, so that importers which round (Perfetto: ``llround(us * 1000)``) and those
    which truncate (older Perfetto, ``static_cast<int64_t>``) both read ``ns`` back.

    Examples
    --------
    >>> us_from_ns(1340595)
    1340.595
    >>> all(int(us_from_ns(n) * 1000) == n for n in range(1, 100_000, 7))
    True
    """
    x = ns / 1000
    if x * 1000 < ns:
        x = math.nextafter(x, math.inf)
    return x


def rank_list(ranks: Sequence[int], limit: int = ARG_RANKS) -> str:
    """Ranks as ranges, at most ``limit`` items before "...".

    Examples
    --------
    >>> rank_list((0, 1, 2, 3, 4, 5, 6, 7))
    '0-7'
    >>> rank_list((0, 8, 16, 24, 32, 40, 48, 56, 64, 72), limit=4)
    '0, 8, 16, 24, ... (10 ranks)'
    """
    items: list[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        items.append(f"{ranks[i]}-{ranks[j]}" if j > i else str(ranks[i]))
        i = j + 1
    if len(items) > limit:
        return ", ".join(items[:limit]) + f", ... ({len(ranks)} ranks)"
    return ", ".join(items)


def _stream_order(ops: Iterable[Op]) -> list[str]:
    """A class's streams, compute first, the others in the order the program first uses them."""
    first: dict[str, int] = {}
    for op in ops:
        first.setdefault(op.stream, op.index if op.index >= 0 else len(first))
    return sorted(first, key=lambda s: (s != "compute", first[s], s))


def _group_args(op: Op) -> dict[str, Any]:
    """Who takes part: group size and the first ranks (collectives), or transfer pairs."""
    args: dict[str, Any] = {}
    groups = op.all_groups
    if groups:
        args["group_size"] = len(groups[0])
        args["ranks"] = rank_list(groups[0])
        if len(groups) > 1:
            args["groups"] = len(groups)
    if op.pairs:
        shown = ", ".join(f"{s}->{d}" for s, d in op.pairs[:ARG_RANKS])
        more = f", ... ({len(op.pairs)} pairs)" if len(op.pairs) > ARG_RANKS else ""
        args["pairs"] = shown + more
    return args


def op_args(r: OpRecord, rec: Recorder) -> dict[str, Any]:
    """What a trace shows about one op when it is selected."""
    op = r.op
    args: dict[str, Any] = {"category": op.category, "phase": op.phase, "kind": op.kind,
                            "step": r.step}
    if op.nbytes:
        args["bytes"] = op.nbytes
    if op.host_transfer is not None:
        args["transfer"] = op.host_transfer
    args.update(_group_args(op))
    choice = rec.collective_choices.get(op.key) if op.key else None
    if choice is not None:
        args["algorithm"] = choice.algorithm
        args["protocol"] = choice.protocol
        args["predicted_us"] = choice.predicted_s * 1e6
    if op.layer is not None:
        args["layer"] = op.layer
    if op.micro_batch is not None:
        args["micro_batch"] = op.micro_batch
    if op.kernels != 1:
        args["kernels"] = op.kernels
    if op.hw_flops:
        args["flops"] = op.hw_flops
    args["ready_us"] = r.ready * 1e6
    if op.kind in COMM_KINDS:
        # Time between reaching the head of its stream and every member having arrived.
        args["wait_for_peers_us"] = (r.start - r.ready) * 1e6
    return args


# --------------------------------------------------------------------------- Perfetto trace
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
        for i, stream in enumerate(_stream_order(ops)):
            tid[(c, stream)] = i + 1
            events.append({"ph": "M", "name": "thread_name", "pid": pid[c], "tid": i + 1,
                           "args": {"name": stream}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": pid[c],
                           "tid": i + 1, "args": {"sort_index": i}})

    slices: list[dict[str, Any]] = []
    for r in rec.ops:
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
        for t, cur in track.series:
            events.append({"ph": "C", "name": "memory (GiB)", "pid": pid[c], "ts": t * 1e6,
                           "args": {k: cur.get(k, 0.0) / GIB for k in MEMORY_CATEGORIES}})
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


# --------------------------------------------------------------------------- HTA traces
# Holistic Trace Analysis (github.com/pytorch/HolisticTraceAnalysis, v0.5.0) reads a folder of
# PyTorch profiler traces, one per rank (hta/common/trace_file.py, create_rank_to_trace_dict:
# every *.json file, its rank from the first `"rank": N` in the text, so distributedInfo comes
# first). Its parser (hta/common/trace_parser.py) keeps events with "dur" and "cat", pulls
# "stream", "correlation", "device" out of "args" (hta/configs/default_event_args.py), treats
# any event with a stream other than -1 as GPU work, and, for float timestamps, rounds each
# event's start up and end down to whole microseconds (round_down_time_stamps). Kernels are
# classified by name alone (hta/utils/utils.py, get_kernel_type): "^nccl.*Kernel" is
# communication, "^Memcpy|^Memset|^dma" memory, anything else not containing "Memcpy" or
# "Sync" computation.

# CUDA compute capability per GPU generation (NVIDIA CUDA C++ Programming Guide, "Compute
# Capabilities": V100 7.0, A100 8.0, H100/H200 9.0, B200 10.0).
COMPUTE_CAPABILITY = {"volta": (7, 0), "ampere": (8, 0), "hopper": (9, 0),
                      "blackwell": (10, 0)}

# NCCL's element type names in kernel names (NCCL src/device/generate.py, all_tys) for the
# training precisions of sim.scenario: the type of the tensors between kernels (fp8 training
# keeps bf16 tensors around its fp8 GEMMs). Frameworks that reduce gradients in fp32 (FSDP2's
# default reduce_dtype, Megatron's grad_reduce_in_fp32) run "f32" kernels: pass dtype="f32".
NCCL_TYPES = {"bf16": "bf16", "fp16": "f16", "fp32": "f32", "fp8": "bf16"}

# Stream ids: CUPTI reports PyTorch's default (legacy) stream as 7 in profiler traces; side
# streams get ids of their own. Only distinctness matters to HTA.
DEFAULT_STREAM_ID = 7
SIDE_STREAM_ID0 = 20

# First correlation id of a trace (CUPTI's ids are a process-wide counter, large in any real
# trace). Small ids break HTA 0.5.0 under pandas >= 3: its parser downcasts the correlation
# column to int8 when every id fits, then writes row indices into a column of that dtype
# (hta/common/trace.py, transform_correlation_to_index), which pandas 3 refuses.
CORRELATION_BASE = 1 << 20

# NCCL >= 2.19 specialises one device kernel per (collective, reduction type) and runs every
# algorithm and protocol through it, so profilers show the same kernel name whatever NCCL
# chose: NCCL src/device/generate.py, best_kernel (AllGather and Broadcast: RING_LL; reductions:
# Sum_<type>, TREE_LL only for the tree algorithm, RING_LL otherwise; SendRecv for send/recv,
# through which NCCL also runs all-to-all). The argument list is the 2.19-2.21 signature.
_NCCL_ARGS = "(ncclDevComm*, unsigned long, ncclWork*)"


def nccl_kernel_name(op: Op, algorithm: str | None, dtype: str = "bf16") -> str:
    """The name a profiler gives the NCCL kernel that runs ``op``.

    Examples
    --------
    >>> nccl_kernel_name(Op("ar", "collective", "comm", "comm", collective="all_reduce"),
    ...                  "nvls")
    'ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevComm*, unsigned long, ncclWork*)'
    >>> nccl_kernel_name(Op("ag", "collective", "ag", "comm", collective="all_gather"), "ring")
    'ncclDevKernel_AllGather_RING_LL(ncclDevComm*, unsigned long, ncclWork*)'
    """
    coll = op.collective if op.kind == "collective" else None
    if coll in ("all_reduce", "reduce_scatter"):
        name = "AllReduce" if coll == "all_reduce" else "ReduceScatter"
        algo = "TREE" if (algorithm or "").lower() == "tree" else "RING"
        return f"ncclDevKernel_{name}_Sum_{dtype}_{algo}_LL{_NCCL_ARGS}"
    if coll == "all_gather":
        return f"ncclDevKernel_AllGather_RING_LL{_NCCL_ARGS}"
    if coll == "broadcast":
        return f"ncclDevKernel_Broadcast_RING_LL{_NCCL_ARGS}"
    return f"ncclDevKernel_SendRecv{_NCCL_ARGS}"


def _compute_kernel_name(name: str) -> str:
    """An op's name as a compute kernel's, kept clear of the patterns HTA reads as other
    kernel types (a name with "Sync" or "Memcpy" in it would not count as computation)."""
    if name.startswith(("nccl", "Memset", "dma")):
        name = "op " + name
    return name.replace("Memcpy", "memcpy").replace("Sync", "sync")


def _memcpy_name(op: Op) -> str:
    # The names CUPTI gives copies, as PyTorch profiler traces show them.
    if op.host_transfer == "h2d":
        return "Memcpy HtoD (Pinned -> Device)"
    if op.host_transfer == "d2h":
        return "Memcpy DtoH (Device -> Pinned)"
    return "Memcpy DtoD (Device -> Device)"


def _on_gpu(op: Op) -> bool:
    """Ops a GPU profiler sees as kernels: everything but the host's own work (stream "cpu":
    CPU optimizer steps), its waits on the GPU (stream "host": synchronize calls) and host <->
    NVMe transfers."""
    return op.stream not in ("cpu", "host") and op.host_transfer not in ("nvme_read",
                                                                          "nvme_write")


def hta_kernel_span(r: OpRecord) -> tuple[int, int]:
    """Integer-nanosecond (start, end) of the kernel that stands for an op in the HTA traces.

    A kernel starts when its stream reaches it: an NCCL kernel then waits inside for its
    peers, so a profiler's collective spans from ``ready`` (not from when every member has
    arrived) to its end. Compute and copy ops start when ready."""
    return time_ns(r.ready), time_ns(r.end)


def hta_traces(rec: Recorder, program: Program, *, gpus_per_node: int = 8,
               gpu: GpuSpec | None = None, dtype: str = "bf16", all_ranks: bool = False,
               scenario: str = "") -> Iterator[tuple[int, dict[str, Any]]]:
    """Per-rank traces in the PyTorch profiler layout Holistic Trace Analysis reads, one at a
    time (with ``all_ranks`` a large job has many).

    Parameters
    ----------
    rec, program : the run's recorder and program
    gpus_per_node : GPUs per node: a rank's device index is ``rank % gpus_per_node``
    gpu : the GPU model, for ``deviceProperties`` (empty list without it)
    dtype : NCCL element type in reduction kernel names (``NCCL_TYPES[precision]``); the
        program does not record each collective's element type
    all_ranks : one trace per member rank of every class; by default one per class, for its
        first member (the members of a class run identical ops at identical times)
    scenario : scenario name, written as ``traceName``

    Yields
    ------
    tuple
        (rank, trace document): ``distributedInfo`` (rank, world_size = all GPUs, backend
        nccl), ``deviceProperties``, ``traceEvents``: per op on a GPU stream one kernel
        (``cat`` "kernel", or "gpu_memcpy" for copies; ``pid`` the device, ``tid`` and
        ``args.stream`` the stream id, ``args.correlation``) and its ``cudaLaunchKernel`` /
        ``cudaMemcpyAsync`` runtime event on the host thread with the same correlation, one
        ``ProfilerStep#<step>`` annotation per step, CPU ops (CPU optimizer steps, NVMe
        transfers) on host threads.
    """
    by_class = records_by_class(rec.ops)
    steps = _step_spans(rec.ops)
    launches = _launch_times(rec.ops)
    for cls in program.classes:
        for rank in cls.members if all_ranks else cls.members[:1]:
            yield rank, _hta_rank_trace(rank, cls, by_class.get(cls.id, []), launches, steps,
                                        rec, program.n_ranks, gpus_per_node, gpu, dtype,
                                        scenario)


def _step_spans(records: Sequence[OpRecord]) -> dict[int, tuple[int, int]]:
    """Integer-nanosecond span of each step's ProfilerStep annotation: from its first op's
    ready time (down to a whole microsecond) to the next step's start (the last step: its last
    op's end, up to a whole microsecond). Whole microseconds survive HTA's rounding of starts
    up and ends down, so every launch of a step stays inside its annotation."""
    lo: dict[int, int] = {}
    hi: dict[int, int] = {}
    for r in records:
        lo[r.step] = min(lo.get(r.step, time_ns(r.ready)), time_ns(r.ready))
        hi[r.step] = max(hi.get(r.step, time_ns(r.end)), time_ns(r.end))
    order = sorted(lo)
    spans: dict[int, tuple[int, int]] = {}
    for i, step in enumerate(order):
        start = lo[step] // 1000 * 1000
        end = (lo[order[i + 1]] // 1000 * 1000 if i + 1 < len(order)
               else -(-hi[step] // 1000) * 1000)
        spans[step] = (start, max(start, end))
    return spans


def _launch_times(records: Sequence[OpRecord]) -> dict[int, int]:
    """When the host launched each op, by ``id(record)``, in integer nanoseconds.

    The recorder keeps no issue time, but the engine starts an op at ``ready = max(end of the
    previous op of its stream, end of its dependencies, host issue time)``. Where ``ready``
    is later than both, the host issued it exactly then, and HTA's idle-time breakdown
    rightly calls the gap a host wait. Otherwise it was issued no later than ``ready``; it is
    placed at the previous op's end (down to a whole microsecond, so that HTA's rounding
    keeps it there), which HTA reads as "not waiting for the host"."""
    end_ns = {(id(r.op), r.step): time_ns(r.end) for r in records}
    last_end: dict[tuple[int, str, int], int] = {}
    out: dict[int, int] = {}
    for r in records:   # in completion order: program order within a stream
        ready = time_ns(r.ready)
        prev = last_end.get((r.cls, r.op.stream, r.step))
        deps = [end_ns[k] for d in r.op.deps if (k := (id(d), r.step)) in end_ns]
        explained = max([x for x in (prev, *deps) if x is not None], default=None)
        if prev is None or explained is None or ready > explained:
            out[id(r)] = ready
        else:
            out[id(r)] = min(ready, prev // 1000 * 1000)
        last_end[(r.cls, r.op.stream, r.step)] = time_ns(r.end)
    return out


def _hta_rank_trace(rank: int, cls: RankClass, records: list[OpRecord],
                    launches: dict[int, int], steps: dict[int, tuple[int, int]],
                    rec: Recorder, world_size: int, gpus_per_node: int, gpu: GpuSpec | None,
                    dtype: str, scenario: str) -> dict[str, Any]:
    device = rank % gpus_per_node
    # Any process id distinct from the device ids (Kineto writes the OS process id).
    host_pid = 100_000 + rank
    gpu_streams = [s for s in _stream_order(o for ops in cls.streams.values() for o in ops)
                   if any(_on_gpu(o) for o in cls.streams[s])]
    stream_id = {s: DEFAULT_STREAM_ID if s == "compute" else SIDE_STREAM_ID0 + i
                 for i, s in enumerate(gpu_streams)}
    host_streams = sorted({r.op.stream for r in records if not _on_gpu(r.op)})
    host_tid = {s: 2 + i for i, s in enumerate(host_streams)}

    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": device, "tid": 0,
         "args": {"name": f"GPU {device} (rank {rank})"}},
        {"ph": "M", "name": "process_name", "pid": host_pid, "tid": 0,
         "args": {"name": f"rank {rank} host"}},
        {"ph": "M", "name": "thread_name", "pid": host_pid, "tid": 1,
         "args": {"name": "main thread"}},
    ]
    for s, sid in stream_id.items():
        events.append({"ph": "M", "name": "thread_name", "pid": device, "tid": sid,
                       "args": {"name": f"stream {sid} ({s})"}})
    for s, t in host_tid.items():
        events.append({"ph": "M", "name": "thread_name", "pid": host_pid, "tid": t,
                       "args": {"name": s}})
    for step, (a, b) in sorted(steps.items()):
        events.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step}",
                       "pid": host_pid, "tid": 1, "ts": us_from_ns(a), "dur": us_from_ns(b - a),
                       "args": {}})
    correlation = CORRELATION_BASE
    for r in records:
        op = r.op
        a, b = hta_kernel_span(r)
        if not _on_gpu(op):
            start = time_ns(r.start)
            events.append({"ph": "X", "cat": "cpu_op", "name": op.name, "pid": host_pid,
                           "tid": host_tid[op.stream], "ts": us_from_ns(start),
                           "dur": us_from_ns(max(0, b - start)),
                           "args": {"fabricsim_category": op.category}})
            continue
        if b <= a:
            continue  # no GPU time: a profiler records no kernel
        correlation += 1
        kargs: dict[str, Any] = {"device": device, "stream": stream_id[op.stream],
                                 "correlation": correlation, "External id": correlation}
        if op.kind == "copy":
            cat, name, launch = "gpu_memcpy", _memcpy_name(op), "cudaMemcpyAsync"
            kargs["bytes"] = int(op.nbytes)
            kargs["memory bandwidth (GB/s)"] = op.nbytes / ((b - a) * 1e-9) / 1e9
        elif op.kind == "compute":
            cat, name, launch = "kernel", _compute_kernel_name(op.name), "cudaLaunchKernel"
        else:
            choice = rec.collective_choices.get(op.key)
            cat, launch = "kernel", "cudaLaunchKernel"
            name = nccl_kernel_name(op, choice.algorithm if choice else None, dtype)
            if op.nbytes:
                kargs["bytes"] = int(op.nbytes)
            if choice is not None:
                kargs["algorithm"] = choice.algorithm
                kargs["protocol"] = choice.protocol
            kargs.update(_group_args(op))
        kargs["fabricsim_op"] = op.name
        events.append({"ph": "X", "cat": "cuda_runtime", "name": launch, "pid": host_pid,
                       "tid": 1, "ts": us_from_ns(launches[id(r)]), "dur": 0.0,
                       "args": {"correlation": correlation, "External id": correlation}})
        events.append({"ph": "X", "cat": cat, "name": name, "pid": device,
                       "tid": stream_id[op.stream], "ts": us_from_ns(a), "dur": us_from_ns(b - a),
                       "args": kargs})

    props: list[dict[str, Any]] = []
    if gpu is not None:
        major, minor = COMPUTE_CAPABILITY.get(gpu.arch, (0, 0))
        props.append({"id": device, "name": gpu.name,
                      "totalGlobalMem": int(gpu.memory_gib * GIB),
                      "computeMajor": major, "computeMinor": minor,
                      "numSms": gpu.sm_count})
    return {"distributedInfo": {"rank": rank, "world_size": world_size, "backend": "nccl"},
            "schemaVersion": 1,
            "deviceProperties": props,
            "traceName": " ".join(x for x in ("fabricsim", scenario, f"rank {rank}") if x),
            "displayTimeUnit": "ms",
            "traceEvents": events}


def write_hta_traces(folder: Path, rec: Recorder, program: Program, *, gpus_per_node: int = 8,
                     gpu: GpuSpec | None = None, dtype: str = "bf16", all_ranks: bool = False,
                     scenario: str = "") -> list[Path]:
    """Write :func:`hta_traces` as ``folder/rank<N>.json``, one file per rank; returns the
    paths. Open with ``hta.trace_analysis.TraceAnalysis(trace_dir=str(folder))``."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for rank, doc in hta_traces(rec, program, gpus_per_node=gpus_per_node, gpu=gpu,
                                dtype=dtype, all_ranks=all_ranks, scenario=scenario):
        path = folder / f"rank{rank}.json"
        # HTA finds a file's rank with the regex '"rank":\s+(\d+)': keep json's ": ".
        path.write_text(json.dumps(doc))
        paths.append(path)
    return paths
