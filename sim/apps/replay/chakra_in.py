"""A Program from MLCommons Chakra execution traces (``.et``), read with mlc-chakra's own reader.

The files are read with mlc-chakra's ``protolib.openFileRd`` / ``decodeMessage`` and its
generated ``et_def_pb2`` (``GlobalMetadata`` first, then one ``Node`` per message:
mlcommons/chakra ``src/third_party/utils/protolib.py``, ``schema/protobuf/et_def.proto``), as
``fabricsim export-chakra`` (:mod:`sim.outputs.export.chakra`) and ASTRA-sim's feeder use them.
One ``.et`` per rank; each rank becomes one rank class of one member:

* ``COMP_NODE``: a compute op of ``duration_micros`` (a ``host`` op on the CPU stream when
  ``is_cpu_op`` and the node names the ``cpu`` stream; a ``copy`` when it has ``tensor_size``);
  ``num_ops`` becomes its FLOPs (the engine's matrix share of the op).
* ``COMM_COLL_NODE``: a collective of ``comm_type`` over the group ``pg_name`` names in
  ``comm_groups.json``; its size back from ``comm_size`` (the rank's input buffer, see
  :func:`sim.outputs.export.chakra.comm_size`: an all-gather's shard times the group).
  Collectives on one communicator run in the same order on every member (NCCL's rule), so the
  ``k``-th collective on group ``g`` of every member is one collective (its key).
* ``COMM_SEND_NODE`` / ``COMM_RECV_NODE``: a point-to-point transfer; every node of one
  ``comm_tag`` (in every file) is one rendezvous of all its (source, destination) pairs, as
  NCCL's grouped ``ncclSend``/``ncclRecv`` run (both ends posted).
* ``data_deps`` are the op's dependencies; ``ctrl_deps`` the previous op of its stream. The
  stream is the node's ``fabricsim_stream`` attribute when the file has one; otherwise a
  node continues its ``ctrl_deps`` predecessor's stream, or opens a new one.

What a trace does not hold: the host's issue times (``cpu_s``: recovered from the recorded
starts, :class:`_HostClock`), memory (allocations), uneven
all-to-all splits (each becomes an even all-to-all of its rank's send buffer) and the ops'
FLOPs beyond ``num_ops``.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sim.program.ir import (
    CPU_STREAM,
    HOST_WAIT_STREAM,
    CollectiveOp,
    Op,
    OpKind,
    Program,
    RankClass,
)

# et_def.proto, enum NodeType and enum CollectiveCommType (the exporter's numbers).
COMP_NODE, COMM_SEND_NODE, COMM_RECV_NODE, COMM_COLL_NODE = 4, 5, 6, 7
COLLECTIVES: dict[int, CollectiveOp] = {0: "all_reduce", 2: "all_gather", 5: "broadcast",
                                        6: "all_to_all", 7: "reduce_scatter"}
COMM_GROUPS_FILE = "comm_groups.json"


class TraceError(ValueError):
    """A trace that cannot be replayed (one line naming the file and what is wrong)."""


@dataclass
class ChakraTrace:
    """The ranks' nodes as read, and what their metadata says."""

    ranks: dict[int, list[Any]]
    """Each rank's ``et_def_pb2.Node`` messages, in file order."""
    meta: dict[int, dict[str, Any]]
    groups: dict[str, tuple[int, ...]]
    world: int
    scenario: str = ""
    files: list[Path] = field(default_factory=list)


def _attrs(items: Any) -> dict[str, Any]:
    return {a.name: getattr(a, a.WhichOneof("value")) for a in items if a.WhichOneof("value")}


def trace_files(path: Path) -> list[Path]:
    """The ``.et`` files of ``path`` (a file, or a folder's ``*.et``), in rank-name order."""
    if path.is_dir():
        files = sorted(path.glob("*.et"), key=lambda p: (len(p.name), p.name))
        if not files:
            raise TraceError(f"{path}: no .et files")
        return files
    return [path]


def read_chakra(path: Path) -> ChakraTrace:
    """Read every rank's ``.et`` (mlc-chakra's reader) and ``comm_groups.json`` beside them."""
    try:
        from chakra.schema.protobuf import et_def_pb2 as pb
        from chakra.src.third_party.utils.protolib import decodeMessage, openFileRd
    except Exception as exc:   # absent, or a protobuf runtime older than its generated code
        raise TraceError(f"{path}: reading Chakra traces needs mlc-chakra "
                         f"(pip install 'fabricsim[chakra]'): {exc}") from None
    files = trace_files(path)
    ranks: dict[int, list[Any]] = {}
    metas: dict[int, dict[str, Any]] = {}
    for i, f in enumerate(files):
        handle = openFileRd(str(f))
        try:
            meta = pb.GlobalMetadata()
            if not decodeMessage(handle, meta):
                raise TraceError(f"{f}: no GlobalMetadata message (not a Chakra trace)")
            m = _attrs(meta.attr)
            nodes = []
            node = pb.Node()
            while decodeMessage(handle, node):
                nodes.append(node)
                node = pb.Node()
        except TraceError:
            raise
        except Exception as exc:   # protobuf's DecodeError, a truncated varint
            raise TraceError(f"{f}: not a Chakra execution trace ({exc})") from None
        finally:
            handle.close()
        rank = int(m.get("rank", i))
        if rank in ranks:
            raise TraceError(f"{f}: rank {rank} appears in two files")
        ranks[rank], metas[rank] = nodes, m
    world = max(int(m.get("world_size", 0)) for m in metas.values())
    world = max(world, max(ranks) + 1)
    missing = sorted(set(range(world)) - set(ranks))
    if missing:
        raise TraceError(f"{path}: world_size {world} but no file for rank(s) {missing[:4]} "
                         "(export with --all-ranks: one file per rank)")
    gfile = (path if path.is_dir() else path.parent) / COMM_GROUPS_FILE
    groups: dict[str, tuple[int, ...]] = {}
    if gfile.exists():
        try:
            groups = {str(k): tuple(int(r) for r in v)
                      for k, v in json.loads(gfile.read_text()).items()}
        except (ValueError, TypeError, AttributeError) as exc:
            raise TraceError(f"{gfile}: not a {{id: [ranks]}} mapping ({exc})") from None
    scen = {str(m.get("scenario", "")) for m in metas.values()}
    return ChakraTrace(ranks, metas, groups, world, scen.pop() if len(scen) == 1 else "",
                       files)


def chakra_program(trace: ChakraTrace, compute_scale: float = 1.0) -> Program:
    """The Program of ``trace``: one rank class per rank (see the module docstring).

    ``compute_scale`` multiplies every compute and copy duration (another GPU:
    :func:`sim.apps.replay.gpu_scale`)."""
    program = Program([], trace.world, 0.0, 0.0, 0.0, meta={"replay": "chakra"})
    p2p: dict[int, set[tuple[int, int]]] = {}
    for nodes in trace.ranks.values():
        for n in nodes:
            if n.type in (COMM_SEND_NODE, COMM_RECV_NODE):
                a = _attrs(n.attr)
                p2p.setdefault(int(a.get("comm_tag", 0)), set()).add(
                    (int(a["comm_src"]), int(a["comm_dst"])))
    pairs = {t: tuple(sorted(v)) for t, v in p2p.items()}
    # the step's start: the earliest recorded start of any rank
    t0 = min((n.start_time_micros for nodes in trace.ranks.values() for n in nodes),
             default=0)
    for rank in sorted(trace.ranks):
        cls = RankClass(rank, (rank,), label=f"rank {rank}")
        program.classes.append(cls)
        _rank_ops(program, cls, trace, rank, pairs, compute_scale, t0)
    program.hw_flops_per_step = sum(op.hw_flops for op in program.ops)
    program.validate()
    return program


class _HostClock:
    """The host's issue times back from the nodes' recorded starts (``Op.cpu_s``).

    An op that started later than its stream's previous op and its dependencies ended was
    waiting for the host (the engine starts an op at the latest of those three): it was
    issued at its start. Any other op was issued no later; it gets no CPU time of its own.
    Each op's ``cpu_s`` is its issue time after the previous op's (or after the end of the
    host wait before it), as :func:`sim.engine.host_clock.issue_time` adds them up again.
    Collectives and transfers are left out: their recorded start is the last member's
    arrival, not this rank's."""

    def __init__(self, t0: int) -> None:
        self.issued = self.sync_end = t0
        self.t0 = t0
        self.end: dict[int, int] = {}

    def issue(self, op: Op, start: int, dur: int, prev: Op | None) -> None:
        ends = [self.end.get(id(d), self.t0) for d in op.deps]
        if prev is not None:
            ends.append(self.end.get(id(prev), self.t0))
        ready = max(ends, default=self.t0)
        floor = max(self.issued, self.sync_end)
        if op.kind not in ("collective", "recv", "send") and start > ready:
            op.cpu_s = max(0, start - floor) * 1e-6
            self.issued = max(floor, start)
        else:
            self.issued = floor
        self.end[id(op)] = start + dur
        if op.host_sync:
            self.sync_end = start + dur


def _rank_ops(program: Program, cls: RankClass, trace: ChakraTrace, rank: int,
              pairs: dict[int, tuple[tuple[int, int], ...]], scale: float, t0: int) -> None:
    op_of: dict[int, Op] = {}
    tail: dict[str, Op] = {}          # the last op of each stream
    on_group: Counter[str] = Counter()
    p2p_op: dict[int, Op] = {}       # this rank's op of each tag (its send and receive)
    where = trace.files[0].parent if trace.files else Path("?")
    host = _HostClock(t0)
    for n in trace.ranks[rank]:
        a = _attrs(n.attr)
        if n.type in (COMM_SEND_NODE, COMM_RECV_NODE):
            tag = int(a.get("comm_tag", 0))
            if tag in p2p_op:
                op_of[n.id] = p2p_op[tag]
                continue
        deps = [op_of[d] for d in list(n.data_deps) + list(n.ctrl_deps) if d in op_of]
        stream = str(a.get("fabricsim_stream", ""))
        if not stream:
            prev = [op_of[d] for d in n.ctrl_deps if d in op_of]
            stream = next((p.stream for p in prev if tail.get(p.stream) is p), "")
            if not stream:
                stream = CPU_STREAM if a.get("is_cpu_op") else f"stream{len(tail)}"
        op = _node_op(n, a, rank, trace, pairs, on_group, scale, where)
        op.stream = stream
        if stream == CPU_STREAM:
            op.kind = "host"
        elif op.kind == "host":
            op.kind = "compute"
        op.host_sync = stream == HOST_WAIT_STREAM
        # the stream's order is kept by the stream itself; other ctrl deps are events
        op.deps = [d for d in dict.fromkeys(deps) if d is not tail.get(stream)]
        host.issue(op, n.start_time_micros, n.duration_micros, tail.get(stream))
        program.add(cls, op)
        tail[stream] = op
        op_of[n.id] = op
        if op.kind == "recv":
            p2p_op[int(a.get("comm_tag", 0))] = op


def _node_op(n: Any, a: dict[str, Any], rank: int, trace: ChakraTrace,
             pairs: dict[int, tuple[tuple[int, int], ...]], on_group: Counter[str],
             scale: float, where: Path) -> Op:
    name = n.name or f"node {n.id}"
    if n.type == COMM_COLL_NODE:
        coll = COLLECTIVES.get(int(a.get("comm_type", -1)))
        if coll is None:
            raise TraceError(f"{where}: rank {rank} node {n.id}: comm_type "
                             f"{a.get('comm_type')} is not a collective fabricsim runs")
        pg = str(a.get("pg_name", ""))
        group = trace.groups.get(pg) if pg not in ("", "0") else tuple(range(trace.world))
        if group is None:
            raise TraceError(f"{where}: rank {rank} node {n.id}: pg_name {pg!r} is not in "
                             f"{COMM_GROUPS_FILE}")
        size = float(a.get("comm_size", 0))
        # comm_size is the rank's input buffer; Op.nbytes counts the gathered output.
        nbytes = size * len(group) if coll == "all_gather" else size
        key = f"coll:{pg}:{on_group[pg]}"
        on_group[pg] += 1
        return Op(name, "collective", "", "comm", collective=coll, group=group,
                  nbytes=nbytes, key=key, category=coll)
    if n.type in (COMM_SEND_NODE, COMM_RECV_NODE):
        tag = int(a.get("comm_tag", 0))
        return Op(name, "recv", "", "comm", pairs=pairs[tag], nbytes=float(a["comm_size"]),
                  key=f"p2p:{tag}", category="send_recv")
    if n.type != COMP_NODE:
        raise TraceError(f"{where}: rank {rank} node {n.id}: node type {n.type} is not "
                         "replayed (compute, collective, send and receive nodes are)")
    flops = float(a.get("num_ops", 0))
    kind: OpKind = "host" if a.get("is_cpu_op") else "copy" if "tensor_size" in a else "compute"
    dur = n.duration_micros * 1e-6 * (1.0 if kind == "host" else scale)
    return Op(name, kind, "", "fwd", duration=dur, hw_flops=flops, flops=flops,
              nbytes=float(a.get("tensor_size", 0)),
              category="copy" if kind == "copy" else "compute")
