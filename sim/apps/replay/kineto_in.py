"""A Program from a PyTorch profiler (Kineto) trace, read with Holistic Trace Analysis' parser.

The JSON is parsed by HTA's ``hta.common.trace_parser.parse_trace_dataframe`` (one row per
event, names through its symbol table; the args PyTorch records for NCCL kernels become its
``collective_name``, ``in_msg_nelems``, ``out_msg_nelems``, ``msg_dtype``,
``process_group_ranks`` columns). One profiled step is rebuilt (the ``ProfilerStep#N``
annotation, by default the last one but one: the last may be cut short by the profiler's
stop); its GPU work is what the host launched inside it (a kernel, memcpy or memset is tied to
its ``cudaLaunchKernel`` / ``cudaMemcpyAsync`` by ``correlation``):

* every kernel keeps its measured duration on its own stream, in launch order;
* an NCCL kernel whose args name the collective becomes that collective of the recorded
  group, its size as nccl-tests counts it (``Op.nbytes``: the all-reduce and reduce-scatter
  input, the all-gather output, ``nelems`` x the dtype's bytes). NCCL kernels without those
  args (PyTorch before 2.1) keep their measured duration as compute;
* ``cudaStreamWaitEvent``: the next op launched after it waits for the latest op launched
  before it on every other stream (c10d's ``syncStream`` makes the NCCL stream wait on the
  current stream, ``work.wait()`` the current stream on the NCCL stream; older traces do not
  record which stream's event it is, so every other stream is waited on);
* the host: each op is issued at its launch's time (``Op.cpu_s`` = the time since the
  previous launch); ``cudaDeviceSynchronize`` / ``cudaStreamSynchronize`` /
  ``cudaEventSynchronize`` become a host wait on the latest op of every stream, the time
  after it counted from its return; the step ends no sooner than the annotation's end (the
  host's work after its last launch).

A single trace of a ``world_size`` job stands for every rank (one rank class of all of
them: a data-parallel job's ranks run the same kernels); several traces, one class each.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sim.apps.replay.chakra_in import TraceError
from sim.program.ir import CPU_STREAM, HOST_WAIT_STREAM, CollectiveOp, Op, Program, RankClass

COLLECTIVES: dict[str, CollectiveOp] = {
    "allreduce": "all_reduce", "all_reduce": "all_reduce",
    "allgather": "all_gather", "all_gather": "all_gather",
    "_allgather_base": "all_gather", "all_gather_into_tensor": "all_gather",
    "allgather_into_tensor_coalesced": "all_gather",
    "reduce_scatter": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced":
    "reduce_scatter", "broadcast": "broadcast", "all_to_all": "all_to_all",
    "alltoall": "all_to_all", "alltoall_base": "all_to_all"}
"""c10d's collective names as ProcessGroupNCCL records them (``Collective name``) -> ours."""
DTYPE_BYTES = {"Float": 4, "Half": 2, "BFloat16": 2, "Double": 8, "Long": 8, "Int": 4,
               "Short": 2, "Char": 1, "Byte": 1, "Bool": 1, "Float8_e4m3fn": 1,
               "Float8_e5m2": 1}
"""Bytes per element of c10's ScalarType names (c10/core/ScalarType.h), as ``dtype`` names
them."""
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
SYNCS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize")
GPU_NAMES = (("A100", 50, "a100-40gb"), ("A100", 1000, "a100-80gb"), ("H100", 1000, "h100-sxm"),
             ("H200", 1000, "h200"), ("H800", 1000, "h800"), ("GB200", 1000, "gb200"),
             ("B200", 1000, "b200"), ("GB300", 1000, "gb300"), ("B300", 1000, "b300"),
             ("V100", 1000, "v100-32gb"))
"""(name part, memory GiB at most, catalogue key): the GPU ``deviceProperties`` names, the
Grace parts before the HGX ones whose names they contain ("NVIDIA GB300" holds "B300")."""


@dataclass
class KinetoTrace:
    """One rank's profiled step as read."""

    path: Path
    rank: int
    world: int
    gpu: str | None
    """The catalogue GPU ``deviceProperties`` names (None: not one we know)."""
    step_s: float
    """The step's measured duration (its ``ProfilerStep#N``, or the launches' span)."""
    step_name: str
    events: Any
    """HTA's data frame of the step's events, names decoded."""


def _gpu_key(meta: dict[str, Any]) -> str | None:
    props = meta.get("deviceProperties") or [{}]
    name = str(props[0].get("name", ""))
    gib = float(props[0].get("totalGlobalMem", 0)) / 2**30
    return next((key for part, most, key in GPU_NAMES if part in name and gib <= most), None)


def read_kineto(path: Path, step: str | None = None) -> KinetoTrace:
    """Parse ``path`` with HTA and cut out one step (``step``: its ``ProfilerStep#N`` name)."""
    from hta.common.trace_parser import parse_trace_dataframe
    from hta.configs.parser_config import ParserBackend, ParserConfig

    cfg = ParserConfig(args=ParserConfig.ARGS_COMPLETE + ParserConfig.ARGS_COMMUNICATION
                       + ParserConfig.ARGS_SYNC)
    cfg.parser_backend = ParserBackend.JSON
    quiet = logging.getLogger("hta").level
    logging.getLogger("hta").setLevel(logging.ERROR)
    try:
        meta, df, sym = parse_trace_dataframe(str(path), cfg)
    except Exception as exc:   # HTA's parser meets the malformed document first: any error
        # it raises is the file's (JSONDecodeError, KeyError on a missing field, ...)
        raise TraceError(f"{path}: not a PyTorch profiler trace ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
    finally:
        logging.getLogger("hta").setLevel(quiet)
    if df is None or df.empty or "cat" not in df:
        raise TraceError(f"{path}: no events (not a PyTorch profiler trace)")
    names = sym.sym_table
    df = df.assign(name=[names[i] for i in df["name"]], cat=[names[i] for i in df["cat"]])
    dist = meta.get("distributedInfo") or {}
    steps = df[df["name"].str.startswith("ProfilerStep#")].sort_values("ts")
    if step is not None:
        steps = steps[steps["name"] == step]
        if steps.empty:
            raise TraceError(f"{path}: no {step} in the trace")
    if len(steps):
        s = steps.iloc[-2] if len(steps) > 1 and step is None else steps.iloc[-1]
        t0, t1, label = float(s["ts"]), float(s["ts"] + s["dur"]), str(s["name"])
    else:
        host = df[df["cat"] == "cuda_runtime"]
        if host.empty:
            raise TraceError(f"{path}: no CUDA launches (a CPU-only trace)")
        t0, t1, label = float(host["ts"].min()), float(host["end"].max()), "whole trace"
    host = df[(df["cat"] == "cuda_runtime") & (df["ts"] >= t0) & (df["ts"] < t1)]
    gpu = df[df["cat"].isin(GPU_CATS) & df["correlation"].isin(host["correlation"])]
    if gpu.empty:
        raise TraceError(f"{path}: no GPU kernels launched in {label}")
    rec = df[df["name"] == "cudaEventRecord"]
    records = dict(zip(rec["correlation"].astype(int), rec["ts"].astype(float), strict=True))
    events = {"host": host.sort_values("ts"), "gpu": gpu, "t0": t0, "t1": t1,
              "records": records}
    return KinetoTrace(path, int(dist.get("rank", 0)), int(dist.get("world_size", 1)),
                       _gpu_key(meta), (t1 - t0) * 1e-6, label, events)


def _ranks(text: Any) -> tuple[int, ...]:
    if isinstance(text, (list, tuple)):
        return tuple(int(r) for r in text)
    try:
        return tuple(int(r) for r in json.loads(str(text)))
    except (ValueError, TypeError):
        return ()


def _gpu_op(row: Any, world: int, on_group: dict[str, int], scale: float) -> Op:
    name, dur = str(row["name"]), float(row["dur"]) * 1e-6
    coll = COLLECTIVES.get(str(row.get("collective_name", "")))
    if row["cat"] == "kernel" and name.startswith("nccl") and coll is not None:
        group = _ranks(row.get("process_group_ranks")) or tuple(range(world))
        size = DTYPE_BYTES.get(str(row.get("msg_dtype", "")), 4)
        elems = row["out_msg_nelems"] if coll == "all_gather" else row["in_msg_nelems"]
        pg = str(row.get("process_group_name", "")) or "0"
        k = on_group.get(pg, 0)
        on_group[pg] = k + 1
        return Op(name, "collective", "", "comm", collective=coll, group=group,
                  nbytes=float(elems) * size, key=f"coll:{pg}:{k}", category=coll)
    if row["cat"] == "gpu_memcpy":
        return Op(name, "copy", "", "fwd", duration=dur * scale, category="copy")
    return Op(name, "compute", "", "fwd", duration=dur * scale, category="compute")


def kineto_program(traces: list[KinetoTrace], scale: float = 1.0) -> Program:
    """The Program of one or several ranks' traces (see the module docstring)."""
    world = max(max(t.world for t in traces), len(traces))
    ranks = sorted(t.rank for t in traces)
    if len(traces) > 1 and ranks != list(range(world)):
        raise TraceError(f"{traces[0].path.parent}: traces of ranks {ranks[:8]} of a "
                         f"{world}-rank job: replay one rank (it stands for all) or all")
    program = Program([], world, 0.0, 0.0, 0.0, meta={"replay": "kineto"})
    for i, t in enumerate(sorted(traces, key=lambda t: t.rank)):
        members = tuple(range(world)) if len(traces) == 1 else (t.rank,)
        cls = RankClass(i, members, label=f"rank {t.rank}" if len(traces) > 1 else
                        f"rank {t.rank} (for all {world})")
        program.classes.append(cls)
        _class_ops(program, cls, t, world, scale)
    program.validate()
    return program


def _class_ops(program: Program, cls: RankClass, t: KinetoTrace, world: int,
               scale: float) -> None:
    ev = t.events
    by_corr = {int(r["correlation"]): r for _, r in ev["gpu"].iterrows()}
    last: dict[str, Op] = {}         # latest op launched on each stream
    launched: dict[str, list[tuple[float, Op]]] = {}   # (launch time, op) per stream
    on_group: dict[str, int] = {}
    host_free = ev["t0"]             # when the host finished its previous call
    waits: list[Op] = []
    for _, call in ev["host"].iterrows():
        name = str(call["name"])
        if name == "cudaStreamWaitEvent":
            waits.extend(_waited(call, ev["records"], launched, last))
            continue
        if name in SYNCS and last:
            op = Op(name, "compute", HOST_WAIT_STREAM, "fwd", host_sync=True, kernels=0,
                    cpu_s=max(0.0, (call["ts"] - host_free) * 1e-6),
                    deps=list(last.values()))
            program.add(cls, op)
            host_free = call["end"]
            continue
        row = by_corr.get(int(call["correlation"]))
        if row is None:
            continue
        op = _gpu_op(row, world, on_group, scale)
        op.stream = f"stream {int(row['stream'])}"
        op.cpu_s = max(0.0, (call["ts"] - host_free) * 1e-6)
        host_free = call["ts"]
        op.deps = [d for d in dict.fromkeys(waits) if d.stream != op.stream]
        waits = []
        program.add(cls, op)
        last[op.stream] = op
        launched.setdefault(op.stream, []).append((float(call["ts"]), op))
    # the host's work after its last launch, to the step's end
    program.add(cls, Op("host to step end", "host", CPU_STREAM, "fwd",
                        cpu_s=max(0.0, (ev["t1"] - host_free) * 1e-6)))


def _waited(call: Any, records: dict[int, float], launched: dict[str, list[tuple[float, Op]]],
            last: dict[str, Op]) -> list[Op]:
    """The ops a ``cudaStreamWaitEvent`` makes the next launch wait for. With the args
    PyTorch 2.1+ records (``wait_on_stream``: the stream the event was recorded on,
    ``wait_on_cuda_event_record_corr_id``: its ``cudaEventRecord``), the last op launched on
    that stream before the record, as HTA's critical-path analysis reads them
    (``hta/analyzers/critical_path_analysis.py``, ``_get_cuda_event_record_df``); without
    them, the latest op of every stream."""
    stream = int(call.get("wait_on_stream", -1))
    record = records.get(int(call.get("wait_on_cuda_event_record_corr_id", -1)))
    if stream < 0 or record is None:
        return list(last.values())
    before = [op for ts, op in launched.get(f"stream {stream}", []) if ts <= record]
    return before[-1:]
