"""Per-rank traces in the PyTorch profiler (Kineto) layout Holistic Trace Analysis reads.

Part of :mod:`sim.outputs.export` (which re-exports every public name here): one JSON file per rank,
so that ``hta.trace_analysis.TraceAnalysis(trace_dir=...)`` runs on a simulated job exactly as
on a measured one (``get_comm_comp_overlap``, ``get_temporal_breakdown``, ...). Times go
through :func:`sim.outputs.export.common.time_ns` and :func:`~sim.outputs.export.common.us_from_ns`,
as the
Perfetto trace's do.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from sim.analysis.metrics import records_by_class
from sim.catalog import GpuSpec
from sim.engine.recorder import OpRecord, Recorder
from sim.outputs.export.common import GIB, group_args, stream_order, time_ns, us_from_ns
from sim.program.ir import HOST_WAIT_STREAM, Op, Program, RankClass

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
# keeps bf16 tensors around its fp8 GEMMs). A collective names its own type (Op.dtype, set
# by the framework builder from the tensor it moves); this is only the fallback for an op
# whose builder left it None.
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
    >>> nccl_kernel_name(Op("rs", "collective", "rs", "comm", collective="reduce_scatter",
    ...                     dtype="f32"), "ring")
    'ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)'
    >>> nccl_kernel_name(Op("ag", "collective", "ag", "comm", collective="all_gather"), "ring")
    'ncclDevKernel_AllGather_RING_LL(ncclDevComm*, unsigned long, ncclWork*)'
    """
    coll = op.collective if op.kind == "collective" else None
    if coll in ("all_reduce", "reduce_scatter"):
        name = "AllReduce" if coll == "all_reduce" else "ReduceScatter"
        algo = "TREE" if (algorithm or "").lower() == "tree" else "RING"
        return f"ncclDevKernel_{name}_Sum_{op.dtype or dtype}_{algo}_LL{_NCCL_ARGS}"
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
    if op.host_transfer == "gpu_storage_write":   # a synchronous checkpoint's tensor.cpu()
        return "Memcpy DtoH (Device -> Pageable)"
    return "Memcpy DtoD (Device -> Device)"


def _on_gpu(op: Op) -> bool:
    """Ops a GPU profiler sees as kernels: everything but the host's own work (kind ``host``:
    CPU optimizer steps), its waits on the GPU (:data:`HOST_WAIT_STREAM`: synchronize calls)
    and transfers from host memory to NVMe or checkpoint storage."""
    return (op.kind != "host" and op.stream != HOST_WAIT_STREAM
            and op.host_transfer not in ("nvme_read", "nvme_write", "storage_write"))


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
    dtype : NCCL element type in reduction kernel names of ops whose builder left
        ``Op.dtype`` None (``NCCL_TYPES[precision]``)
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
    # The program's ops, and those only some steps ran (a checkpoint save's).
    ops = [o for ops in cls.streams.values() for o in ops]
    ops += [r.op for r in records if r.op.stream not in cls.streams]
    gpu_streams = [s for s in stream_order(ops)
                   if any(_on_gpu(o) for o in ops if o.stream == s)]
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
            kargs.update(group_args(op))
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
