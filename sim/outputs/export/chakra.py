"""MLCommons Chakra execution traces of a simulated step, as ASTRA-sim reads them.

One ``.et`` file per rank (by default per rank class, for its first member: the members of a
class run identical ops at identical times) named ``workload.<rank>.et``, so that ASTRA-sim's
``--workload-configuration=DIR/workload`` finds ``DIR/workload.<npu_id>.et``
(astra-sim/workload/Workload.cc, ``Workload::Workload``), plus ``comm_groups.json`` for its
``--comm-group-configuration``: ``{"<id>": [ranks...]}`` (``Workload::initialize_comm_groups``
reads each key with ``stoi``). Ids start at 1: ASTRA-sim reads a ``pg_name`` of "" or "0" as
the default group of every rank (``Workload::extract_comm_group``).

File layout (mlcommons/chakra, ``src/third_party/utils/protolib.py``, ``encodeMessage``): each
message is its length as a varint, then the message; a ``GlobalMetadata`` first, then one
``Node`` per message (``schema/protobuf/et_def.proto``). Each op of the rank's class becomes:

* ``compute`` / ``copy`` / ``host`` (and the host's waits): a ``COMP_NODE`` with
  ``duration_micros`` (the recorder's simulated duration, whole microseconds: the feeder's
  ``runtime``, which ASTRA-sim's replay multiplies by 1000 into nanoseconds,
  ``Workload::issue_replay``) and ``is_cpu_op`` for work of the host;
* a collective: a ``COMM_COLL_NODE`` with ``comm_type`` (``CollectiveCommType``),
  ``comm_size`` and ``pg_name`` (the id of the rank's group in ``comm_groups.json``);
* a send/recv: a ``COMM_SEND_NODE`` for each transfer the rank sends and a ``COMM_RECV_NODE``
  for each it receives, with ``comm_src``, ``comm_dst``, ``comm_tag`` (the same on both sides:
  one tag per transfer key) and ``comm_size``. A ``send`` posted by its sources alone whose
  receiver's ops wait on it gets a ``COMM_RECV_NODE`` in the receiver's file.

``data_deps`` are the op's dependencies (CUDA events between streams), ``ctrl_deps`` the
previous op of its stream. ASTRA-sim's feeder (astra-sim/chakra, ``src/feeder_v3/common.h``:
``RESOLVE_DATA_DEPS`` and ``RESOLVE_CTRL_DEPS`` are both true) waits for both; the older
mlcommons/chakra ``src/feeder/et_feeder.cpp`` reads only ``data_deps``. Attribute types are
those the feeders read (``src/feeder/et_feeder_node.cpp``): ``is_cpu_op`` bool_val,
``num_ops`` / ``comm_type`` / ``comm_size`` int64_val, ``comm_src`` / ``comm_dst`` /
``comm_tag`` int32_val, ``tensor_size`` uint64_val, ``pg_name`` string_val.

``comm_size`` is the bytes of the rank's input buffer, as Chakra's PyTorch converter counts it
(``src/converter/pytorch_node.py``, ``comm_size``: the input tensors' bytes) and as ASTRA-sim
reads it (``Ring.cc``: an all-gather ends with ``data_size * nodes``, a reduce-scatter with
``data_size / nodes``): the all-reduce buffer, the all-gather's shard (``Op.nbytes`` / group
size: ``Op.nbytes`` counts the gathered output as nccl-tests does), the reduce-scatter's
input, the broadcast buffer, the all-to-all's send buffer (its row of ``Op.peer_bytes``).

The messages are built with mlc-chakra's generated ``et_def_pb2`` and written with its
``protolib`` when it is installed (``pip install 'fabricsim[chakra]'``); otherwise with the
small proto3 wire encoder below, which writes the same bytes (tests/integration/
test_chakra_export.py compares them).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from sim.engine.recorder import OpRecord, Recorder
from sim.program.ir import HOST_WAIT_STREAM, Op, Program, RankClass

FILE_PREFIX = "workload"
"""``DIR/workload.<rank>.et``: ASTRA-sim's ``--workload-configuration=DIR/workload``."""
COMM_GROUPS_FILE = "comm_groups.json"
SCHEMA_VERSION = "1.0.0"
"""``GlobalMetadata.version``, as mlc-chakra 1.0's generator writes it
(src/generator/generator.py)."""

# et_def.proto, enum NodeType and enum CollectiveCommType.
COMP_NODE, COMM_SEND_NODE, COMM_RECV_NODE, COMM_COLL_NODE = 4, 5, 6, 7
COMM_TYPES = {"all_reduce": 0, "all_gather": 2, "broadcast": 5, "all_to_all": 6,
              "reduce_scatter": 7}

AttrKind = Literal["bool_val", "int32_val", "int64_val", "uint64_val", "string_val"]
# AttributeProto's oneof fields by number (et_def.proto) and their wire types (0 varint,
# 2 length-delimited).
_ATTR_FIELDS: dict[str, tuple[int, int]] = {
    "int32_val": (7, 0), "int64_val": (9, 0), "uint64_val": (13, 0), "bool_val": (27, 0),
    "string_val": (29, 2)}


@dataclass
class ChakraNode:
    """One ``Node`` of et_def.proto, as plain data (either writer encodes it)."""

    id: int
    name: str
    type: int
    duration_micros: int
    start_time_micros: int
    data_deps: list[int] = field(default_factory=list)
    ctrl_deps: list[int] = field(default_factory=list)
    attrs: list[tuple[str, AttrKind, Any]] = field(default_factory=list)


def comm_groups(program: Program) -> dict[tuple[int, ...], int]:
    """Every group of every collective, numbered from 1 in program order (ASTRA-sim reads
    ``pg_name`` "0" or "" as all ranks, so 0 is never used).

    Examples
    --------
    >>> from sim.program.ir import Op, RankClass
    >>> p = Program([RankClass(0, (0, 1, 2, 3))], 4, 0.0, 0.0, 0.0)
    >>> c = p.classes[0]
    >>> _ = p.add(c, Op("ar", "collective", "tp", "comm", collective="all_reduce",
    ...                 groups=((0, 1), (2, 3)), key="ar"))
    >>> comm_groups(p)
    {(0, 1): 1, (2, 3): 2}
    """
    ids: dict[tuple[int, ...], int] = {}
    seen: set[int] = set()
    for op in program.ops:
        if op.kind != "collective" or id(op.all_groups) in seen:
            continue
        if op.groups:
            seen.add(id(op.groups))   # builders share one tuple across micro-batches
        for g in op.all_groups:
            ids.setdefault(tuple(g), len(ids) + 1)
    return ids


def comm_size(op: Op, rank: int, group: Sequence[int]) -> int:
    """Bytes of ``rank``'s input buffer for collective ``op`` (see the module docstring).

    Examples
    --------
    >>> ag = Op("ag", "collective", "dp", "comm", collective="all_gather", nbytes=4096.0)
    >>> comm_size(ag, 1, (0, 1, 2, 3))
    1024
    >>> a2a = Op("a2a", "collective", "ep", "comm", collective="all_to_all", nbytes=30.0,
    ...          peer_bytes=((1.0, 2.0), (3.0, 24.0)))
    >>> comm_size(a2a, 7, (6, 7))      # rank 7's row: what it sends, its own chunk included
    27
    """
    if op.collective == "all_gather":
        return round(op.nbytes / max(1, len(group)))
    if op.collective == "all_to_all" and op.peer_bytes:
        return round(sum(op.peer_bytes[list(group).index(rank)]))
    return round(op.nbytes)


def micros(seconds: float) -> int:
    """Simulated seconds as the whole microseconds Chakra's ``*_micros`` fields hold.

    Examples
    --------
    >>> micros(0.0013405952), micros(4e-7)
    (1341, 0)
    """
    return max(0, round(seconds * 1e6))


def step_records(rec: Recorder, step: int | None = None) -> dict[int, OpRecord]:
    """Each op's record of one step (the last recorded by default), by ``id(op)``."""
    if not rec.ops:
        return {}
    want = max(r.step for r in rec.ops) if step is None else step
    return {id(r.op): r for r in rec.ops if r.step == want}


class _GroupIndex:
    """Which group of a collective a rank is in, kept per group tuple (shared by builders
    across micro-batches: a 16,384-rank job has thousands of groups, walked once)."""

    def __init__(self) -> None:
        self._by: dict[int, tuple[object, dict[int, tuple[int, ...]]]] = {}

    def group(self, op: Op, rank: int) -> tuple[int, ...]:
        groups = op.all_groups
        hit = self._by.get(id(groups))
        if hit is None or hit[0] is not groups:
            hit = (groups, {r: tuple(g) for g in groups for r in g})
            self._by[id(groups)] = hit
        got = hit[1].get(rank)
        if got is None:
            raise ValueError(f"collective {op.name!r}: rank {rank} is in none of its groups")
        return got


def rank_nodes(program: Program, cls: RankClass, rank: int, records: dict[int, OpRecord],
               groups: dict[tuple[int, ...], int], tags: dict[str, int],
               index: _GroupIndex | None = None) -> tuple[list[ChakraNode], int]:
    """The Chakra nodes of ``rank`` (a member of ``cls``), in program order.

    Returns the nodes and how many dependencies could not be kept (a dependency on another
    class's op that is not a transfer to this rank: a per-rank trace cannot name it).
    """
    index = index or _GroupIndex()
    ops = sorted((o for s in cls.streams.values() for o in s), key=lambda o: o.index)
    mine = {id(o) for o in ops}
    nodes_of: dict[int, list[int]] = {}
    last_on_stream: dict[str, Op] = {}
    extra = len(program.ops)      # ids of the nodes beyond one per op
    out: list[ChakraNode] = []
    dropped = 0
    for op in ops:
        data: list[int] = []
        for d in dict.fromkeys(op.deps):
            if id(d) in mine:
                data += nodes_of[id(d)]
                continue
            if id(d) not in nodes_of:
                recvs = _remote_recvs(d, rank, records, tags, extra)
                extra += len(recvs)
                out += recvs
                nodes_of[id(d)] = [n.id for n in recvs]
            if not nodes_of[id(d)]:
                dropped += 1
            data += nodes_of[id(d)]
        prev = last_on_stream.get(op.stream)
        ctrl = list(nodes_of[id(prev)]) if prev is not None else []
        last_on_stream[op.stream] = op
        made = _op_nodes(op, rank, records.get(id(op)), groups, tags, index, extra)
        extra += len(made) - 1
        for n in made:
            n.data_deps = list(dict.fromkeys(data))
            n.ctrl_deps = ctrl
        nodes_of[id(op)] = [n.id for n in made]
        out += made
    return out, dropped


def _times(r: OpRecord | None) -> tuple[int, int]:
    # (start, duration) in whole microseconds; an op without a record (not run) takes 0.
    if r is None:
        return 0, 0
    start = micros(r.start)
    return start, max(0, micros(r.end) - start)


def _op_nodes(op: Op, rank: int, r: OpRecord | None, groups: dict[tuple[int, ...], int],
              tags: dict[str, int], index: _GroupIndex, extra: int) -> list[ChakraNode]:
    start, dur = _times(r)
    stream: tuple[str, AttrKind, Any] = ("fabricsim_stream", "string_val", op.stream)
    if op.kind == "collective":
        group = index.group(op, rank)
        return [ChakraNode(op.index, op.name, COMM_COLL_NODE, dur, start, attrs=[
            ("is_cpu_op", "bool_val", False),
            ("comm_type", "int64_val", COMM_TYPES[op.collective or "all_reduce"]),
            ("comm_size", "int64_val", comm_size(op, rank, group)),
            ("pg_name", "string_val", str(groups[group])), stream])]
    if op.kind in ("send", "recv"):
        made: list[ChakraNode] = []
        for s, d in op.pairs:
            if rank not in (s, d):
                continue
            kind = COMM_SEND_NODE if s == rank else COMM_RECV_NODE
            made.append(ChakraNode(op.index if not made else extra + len(made) - 1,
                                   op.name, kind, dur, start,
                                   attrs=_p2p_attrs(op, s, d, tags) + [stream]))
        if made:
            return made
    attrs: list[tuple[str, AttrKind, Any]] = [
        ("is_cpu_op", "bool_val", op.kind == "host" or op.stream == HOST_WAIT_STREAM)]
    if op.hw_flops:
        attrs.append(("num_ops", "int64_val", round(op.hw_flops)))
    if op.kind == "copy" and op.nbytes:
        attrs.append(("tensor_size", "uint64_val", round(op.nbytes)))
    return [ChakraNode(op.index, op.name, COMP_NODE, dur, start, attrs=attrs + [stream])]


def _p2p_attrs(op: Op, src: int, dst: int, tags: dict[str, int]
               ) -> list[tuple[str, AttrKind, Any]]:
    return [("is_cpu_op", "bool_val", False), ("comm_src", "int32_val", src),
            ("comm_dst", "int32_val", dst), ("comm_tag", "int32_val", tags[_tag_key(op)]),
            ("comm_size", "int64_val", round(op.nbytes))]


def _remote_recvs(d: Op, rank: int, records: dict[int, OpRecord], tags: dict[str, int],
                  first_id: int) -> list[ChakraNode]:
    """Receives standing for another class's ``send`` that this rank's ops wait on."""
    if d.kind != "send":
        return []
    start, dur = _times(records.get(id(d)))
    return [ChakraNode(first_id + i, f"recv of {d.name}", COMM_RECV_NODE, dur, start,
                       attrs=_p2p_attrs(d, s, t, tags))
            for i, (s, t) in enumerate(p for p in d.pairs if p[1] == rank)]


def _tag_key(op: Op) -> str:
    return op.key or f"#{op.index}"


def p2p_tags(program: Program) -> dict[str, int]:
    """One ``comm_tag`` per transfer key (both ends of a transfer carry the op's key), in
    program order from 1."""
    tags: dict[str, int] = {}
    for op in program.ops:
        if op.kind in ("send", "recv"):
            tags.setdefault(_tag_key(op), len(tags) + 1)
    return tags


# ---------------------------------------------------------------- encoding
def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1            # negative int32/int64: ten bytes, two's complement
    out = bytearray()
    while n > 0x7F:
        out.append(0x80 | (n & 0x7F))
        n >>= 7
    out.append(n)
    return bytes(out)


def _key(number: int, wire: int) -> bytes:
    return _varint(number << 3 | wire)


def _len_field(number: int, payload: bytes) -> bytes:
    return _key(number, 2) + _varint(len(payload)) + payload


def _attr_bytes(name: str, kind: str, value: Any) -> bytes:
    number, wire = _ATTR_FIELDS[kind]
    # A oneof member is written even when zero (it has presence in proto3).
    body = (_len_field(number, str(value).encode()) if wire == 2
            else _key(number, 0) + _varint(int(value)))
    return _len_field(1, name.encode()) + body


def _packed(number: int, values: Iterable[int]) -> bytes:
    payload = b"".join(_varint(v) for v in values)
    return _len_field(number, payload) if payload else b""


def encode_node(n: ChakraNode) -> bytes:
    """A ``Node`` in proto3 wire format: fields in number order, zero scalars left out,
    repeated integers packed (the Protocol Buffers encoding guide, "Packed Repeated
    Fields"), as ``SerializeToString`` writes it."""
    parts = [_key(1, 0) + _varint(n.id) if n.id else b"",
             _len_field(2, n.name.encode()) if n.name else b"",
             _key(3, 0) + _varint(n.type) if n.type else b"",
             _packed(4, n.ctrl_deps), _packed(5, n.data_deps),
             _key(6, 0) + _varint(n.start_time_micros) if n.start_time_micros else b"",
             _key(7, 0) + _varint(n.duration_micros) if n.duration_micros else b""]
    parts += [_len_field(10, _attr_bytes(*a)) for a in n.attrs]
    return b"".join(parts)


def encode_metadata(attrs: Sequence[tuple[str, AttrKind, Any]]) -> bytes:
    """A ``GlobalMetadata``: ``version`` and its attributes."""
    return _len_field(1, SCHEMA_VERSION.encode()) + b"".join(
        _len_field(2, _attr_bytes(*a)) for a in attrs)


def _framed(message: bytes) -> bytes:
    # protolib.encodeMessage: the length as a varint, then the message.
    return _varint(len(message)) + message


def chakra_available() -> bool:
    """Whether mlc-chakra (its generated ``et_def_pb2``) can be imported."""
    try:
        import chakra.schema.protobuf.et_def_pb2  # noqa: F401
    except Exception:   # absent, or a protobuf runtime older than its generated code
        return False
    return True


def _with_chakra(meta: Sequence[tuple[str, AttrKind, Any]], nodes: Iterable[ChakraNode],
                 f: Any) -> None:
    from chakra.schema.protobuf import et_def_pb2 as pb
    from chakra.src.third_party.utils.protolib import encodeMessage

    def attrs(items: Iterable[tuple[str, AttrKind, Any]]) -> list[Any]:
        return [pb.AttributeProto(name=name, **{kind: value}) for name, kind, value in items]

    encodeMessage(f, pb.GlobalMetadata(version=SCHEMA_VERSION, attr=attrs(meta)))
    for n in nodes:
        encodeMessage(f, pb.Node(id=n.id, name=n.name, type=n.type, ctrl_deps=n.ctrl_deps,
                                 data_deps=n.data_deps, start_time_micros=n.start_time_micros,
                                 duration_micros=n.duration_micros, attr=attrs(n.attrs)))


def write_et(path: Path, meta: Sequence[tuple[str, AttrKind, Any]],
             nodes: Sequence[ChakraNode],
             writer: Literal["auto", "chakra", "builtin"] = "auto") -> None:
    """Write one ``.et`` file: the metadata message first, then the nodes.

    ``writer``: "chakra" uses mlc-chakra's ``et_def_pb2`` and ``protolib.encodeMessage``,
    "builtin" this module's encoder, "auto" the first when it is installed."""
    with path.open("wb") as f:
        if writer == "chakra" or (writer == "auto" and chakra_available()):
            _with_chakra(meta, nodes, f)
            return
        f.write(_framed(encode_metadata(meta)))
        for n in nodes:
            f.write(_framed(encode_node(n)))


def write_chakra(folder: Path, rec: Recorder, program: Program, *, all_ranks: bool = False,
                 scenario: str = "", step: int | None = None,
                 writer: Literal["auto", "chakra", "builtin"] = "auto") -> list[Path]:
    """Write ``folder/workload.<rank>.et`` for each rank class's first member (``all_ranks``:
    every rank) and ``folder/comm_groups.json``; returns the ``.et`` paths.

    Parameters
    ----------
    rec, program : the run's recorder and program (durations are of step ``step``, by
        default the last one recorded)
    all_ranks : one file per rank, as ASTRA-sim needs to run the job (it opens one file per
        NPU); by default one per rank class
    scenario : written in each file's metadata
    writer : see :func:`write_et`

    ``workload.*.et`` files already in ``folder`` are removed first: ASTRA-sim would read a
    stale rank's file of an earlier export beside the new ones.
    """
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob(f"{FILE_PREFIX}.*.et"):
        old.unlink()
    groups = comm_groups(program)
    tags = p2p_tags(program)
    records = step_records(rec, step)
    index = _GroupIndex()
    paths = []
    for cls in program.classes:
        for rank in cls.members if all_ranks else cls.members[:1]:
            nodes, dropped = rank_nodes(program, cls, rank, records, groups, tags, index)
            meta: list[tuple[str, AttrKind, Any]] = [
                ("schema", "string_val", "fabricsim"), ("scenario", "string_val", scenario),
                ("rank", "uint64_val", rank), ("world_size", "uint64_val", program.n_ranks),
                ("rank_class", "uint64_val", cls.id),
                ("ranks_in_class", "uint64_val", len(cls.members)),
                ("dropped_deps", "uint64_val", dropped)]
            path = folder / f"{FILE_PREFIX}.{rank}.et"
            write_et(path, meta, nodes, writer)
            paths.append(path)
    (folder / COMM_GROUPS_FILE).write_text(json.dumps(
        {str(i): list(g) for g, i in groups.items()}, indent=1))
    return paths
