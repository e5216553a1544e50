"""Chakra export (sim/outputs/export/chakra.py, ``fabricsim export-chakra``): the files read back
with MLCommons Chakra's own reader (mlc-chakra's ``protolib.decodeMessage`` and generated
``et_def_pb2``) hold the Program's ops as nodes, the recorder's durations and the
dependencies; every collective names its group in comm_groups.json; every send has its
receive on the other rank.

Without mlc-chakra installed the files are read by ``_wire_decode`` below: a FALLBACK proto3
decoder for this test only, used when Chakra's reader is absent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import fabricsim_in_process

from sim.api import simulate
from sim.outputs.export.chakra import (
    COMM_COLL_NODE,
    COMM_RECV_NODE,
    COMM_SEND_NODE,
    COMP_NODE,
    chakra_available,
    micros,
    write_chakra,
)
from sim.program.ir import Op
from sim.scenario import load_scenario

ROOT = Path(__file__).resolve().parents[2]

# Llama 3.2 1B under Megatron-Core, TP 2 x PP 2 x DP 2 on one DGX H100: tensor-parallel,
# data-parallel (distributed optimizer: reduce-scatter + all-gather) and pipeline transfers
# (rendezvous ``recv`` ops on both stages), two rank classes; ~570 ops.
MEGATRON_PP = {
    "name": "chakra-megatron-tp2pp2", "model": "llama3.2-1b",
    "cluster": {"topology": "dgx-h100", "nodes": 1},
    "framework": {"name": "megatron", "distributed_optimizer": True},
    "parallelism": {"tp": 2, "pp": 2},
    "training": {"seq_len": 1024, "micro_batch_size": 1, "global_batch_size": 8,
                 "precision": "bf16", "activation_checkpointing": "none"}}
# FSDP2 with PP 2: torch.distributed.pipelining's sends are posted by the sender alone and the
# next stage's compute waits on them (kind ``send``), so the receiver's file gets receives.
# Llama 3.2 1B's shape untied: torchtitan refuses weight tying with pipeline parallelism.
FSDP2_PP = {
    "name": "chakra-fsdp2-pp2",
    "model": {"name": "llama3.2-1b-untied", "layers": 16, "hidden": 2048, "heads": 32,
              "kv_heads": 8, "ffn_hidden": 8192, "vocab": 128256, "mlp": "swiglu",
              "tied_embeddings": False},
    "cluster": {"topology": "dgx-h100", "nodes": 1},
    "framework": {"name": "fsdp2"}, "parallelism": {"pp": 2},
    "training": {"seq_len": 1024, "micro_batch_size": 1, "global_batch_size": 8,
                 "precision": "bf16", "activation_checkpointing": "none"}}

# Megatron context parallelism 2 (TP 2, DP 2): each ring step is one ``send`` op in which every
# rank sends to its next and receives from its previous CP peer, so it becomes a send and a
# receive node in each file.
MEGATRON_CP = {
    "name": "chakra-megatron-cp2", "model": "llama3.2-1b",
    "cluster": {"topology": "dgx-h100", "nodes": 1},
    "framework": {"name": "megatron", "distributed_optimizer": True},
    "parallelism": {"tp": 2, "cp": 2},
    "training": {"seq_len": 4096, "micro_batch_size": 1, "global_batch_size": 4,
                 "precision": "bf16", "activation_checkpointing": "none"}}


# ------------------------------------------------------------------ reading the files back
def _read_with_chakra(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    from chakra.schema.protobuf import et_def_pb2 as pb
    from chakra.src.third_party.utils.protolib import decodeMessage, openFileRd

    def attrs(items: Any) -> dict[str, Any]:
        return {a.name: getattr(a, a.WhichOneof("value")) for a in items}

    f = openFileRd(str(path))
    meta = pb.GlobalMetadata()
    assert decodeMessage(f, meta), "no GlobalMetadata first"
    nodes = []
    node = pb.Node()
    while decodeMessage(f, node):
        nodes.append({"id": node.id, "name": node.name, "type": node.type,
                      "ctrl_deps": list(node.ctrl_deps), "data_deps": list(node.data_deps),
                      "start": node.start_time_micros, "dur": node.duration_micros,
                      "attr": attrs(node.attr)})
    f.close()
    return {"version": meta.version, "attr": attrs(meta.attr)}, nodes


def _varint(b: bytes, i: int) -> tuple[int, int]:
    out = shift = 0
    while True:
        c = b[i]
        i += 1
        out |= (c & 0x7F) << shift
        shift += 7
        if not c & 0x80:
            return out, i


def _fields(b: bytes) -> list[tuple[int, int, Any]]:
    """FALLBACK (only without mlc-chakra): (number, wire type, value) of a proto3 message."""
    out: list[tuple[int, int, Any]] = []
    i = 0
    while i < len(b):
        key, i = _varint(b, i)
        num, wire = key >> 3, key & 7
        v: Any
        if wire == 0:
            v, i = _varint(b, i)
        elif wire == 2:
            n, i = _varint(b, i)
            v, i = b[i:i + n], i + n
        else:
            raise AssertionError(f"wire type {wire} not written by the exporter")
        out.append((num, wire, v))
    return out


def _wire_attr(b: bytes) -> tuple[str, Any]:
    name, value = "", None
    for num, _, v in _fields(b):
        if num == 1:
            name = v.decode()
        elif num == 27:
            value = bool(v)
        elif num == 29:
            value = v.decode()
        elif num == 7:          # int32: ten-byte two's complement when negative
            value = v - (1 << 64) if v >= 1 << 63 else v
        else:
            value = v
    return name, value


def _wire_decode(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """FALLBACK reader, only used when mlc-chakra is absent (et_def.proto by hand)."""
    data = path.read_bytes()
    msgs, i = [], 0
    while i < len(data):
        n, i = _varint(data, i)
        msgs.append(data[i:i + n])
        i += n
    meta: dict[str, Any] = {"version": "", "attr": {}}
    for num, _, v in _fields(msgs[0]):
        if num == 1:
            meta["version"] = v.decode()
        else:
            k, x = _wire_attr(v)
            meta["attr"][k] = x
    nodes = []
    for m in msgs[1:]:
        node: dict[str, Any] = {"id": 0, "name": "", "type": 0, "ctrl_deps": [],
                                "data_deps": [], "start": 0, "dur": 0, "attr": {}}
        for num, _, v in _fields(m):
            if num in (4, 5):
                deps: list[int] = []
                j = 0
                while j < len(v):
                    x, j = _varint(v, j)
                    deps.append(x)
                node["ctrl_deps" if num == 4 else "data_deps"] += deps
            elif num == 10:
                k, x = _wire_attr(v)
                node["attr"][k] = x
            else:
                key = {1: "id", 2: "name", 3: "type", 6: "start", 7: "dur"}[num]
                node[key] = v.decode() if num == 2 else v
        nodes.append(node)
    return meta, nodes


READ = _read_with_chakra if chakra_available() else _wire_decode


# ------------------------------------------------------------------ fixtures
def _run(spec: dict[str, Any], tmp: Path) -> Any:
    path = tmp / f"{spec['name']}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return simulate(load_scenario(str(path), []), 1, origin=str(path))


@pytest.fixture(scope="module")
def megatron(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    tmp = tmp_path_factory.mktemp("megatron")
    result = _run(MEGATRON_PP, tmp)
    write_chakra(tmp / "et", result.recorder, result.program, all_ranks=True,
                 scenario="chakra-megatron-tp2pp2")
    return result, tmp / "et"


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    tmp = tmp_path_factory.mktemp("fsdp2")
    result = _run(FSDP2_PP, tmp)
    write_chakra(tmp / "et", result.recorder, result.program, all_ranks=True)
    return result, tmp / "et"


@pytest.fixture(scope="module")
def cp(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    tmp = tmp_path_factory.mktemp("cp")
    result = _run(MEGATRON_CP, tmp)
    write_chakra(tmp / "et", result.recorder, result.program, all_ranks=True)
    return result, tmp / "et"


def _files(folder: Path) -> dict[int, Path]:
    return {int(p.name.split(".")[1]): p for p in folder.glob("workload.*.et")}


# ------------------------------------------------------------------ tests
def test_nodes_durations_and_dependencies_are_the_programs(megatron: tuple[Any, Path]) -> None:
    result, folder = megatron
    program, rec = result.program, result.recorder
    records = {id(r.op): r for r in rec.ops}
    files = _files(folder)
    assert sorted(files) == list(range(program.n_ranks))
    for cls in program.classes:
        ops = sorted((o for s in cls.streams.values() for o in s), key=lambda o: o.index)
        for rank in cls.members:
            meta, nodes = READ(files[rank])
            assert meta["version"] == "1.0.0"
            assert meta["attr"]["rank"] == rank and meta["attr"]["world_size"] == 8
            assert meta["attr"]["dropped_deps"] == 0
            by_id = {n["id"]: n for n in nodes}
            assert len(by_id) == len(nodes), "node ids are unique"
            # Megatron's pipeline transfers are rendezvous ops on both stages: one node each.
            assert len(nodes) == len(ops)
            prev: dict[str, Op] = {}
            for op in ops:
                n = by_id[op.index]
                r = records[id(op)]
                assert n["name"] == op.name
                want = {"compute": COMP_NODE, "copy": COMP_NODE, "host": COMP_NODE,
                        "collective": COMM_COLL_NODE}.get(op.kind)
                if want is None:
                    src = [s for s, _ in op.pairs if s == rank]
                    want = COMM_SEND_NODE if src else COMM_RECV_NODE
                assert n["type"] == want, op.name
                # the recorder's duration, in whole microseconds
                assert n["dur"] == micros(r.end) - micros(r.start), op.name
                assert n["start"] == micros(r.start)
                assert n["attr"]["is_cpu_op"] is (op.kind == "host" or op.stream == "host")
                assert n["data_deps"] == list(dict.fromkeys(d.index for d in op.deps))
                p = prev.get(op.stream)
                assert n["ctrl_deps"] == ([p.index] if p is not None else [])
                prev[op.stream] = op


@pytest.mark.parametrize("job", ["megatron", "fsdp2", "cp"])
def test_every_dependency_ends_before_its_node_starts(job: str,
                                                      request: pytest.FixtureRequest) -> None:
    # Independent of the mapping: in the recorded run a node can start only after every
    # dependency (data or stream order) has ended, so a dependency pointing the wrong way or
    # at the wrong op fails here. Both ends are rounded by the same monotonic micros().
    _, folder = request.getfixturevalue(job)
    checked = 0
    for path in _files(folder).values():
        _, nodes = READ(path)
        by_id = {n["id"]: n for n in nodes}
        for n in nodes:
            for d in n["data_deps"] + n["ctrl_deps"]:
                assert by_id[d]["start"] + by_id[d]["dur"] <= n["start"], (n["name"], d)
                checked += 1
    assert checked > 500


def test_collectives_name_their_group_in_comm_groups(megatron: tuple[Any, Path]) -> None:
    result, folder = megatron
    program = result.program
    groups = json.loads((folder / "comm_groups.json").read_text())
    listed = {tuple(v): int(k) for k, v in groups.items()}
    # ASTRA-sim reads pg_name "0" as the group of all ranks (Workload::extract_comm_group).
    assert min(listed.values()) == 1
    colls = [o for o in program.ops if o.kind == "collective"]
    assert {o.collective for o in colls} >= {"all_reduce", "reduce_scatter", "all_gather"}
    for op in colls:
        for g in op.all_groups:
            assert tuple(g) in listed, op.name
    by_index = {o.index: o for o in program.ops}
    # et_def.proto CollectiveCommType
    enum = {0: "all_reduce", 2: "all_gather", 5: "broadcast", 6: "all_to_all",
            7: "reduce_scatter"}
    if chakra_available():
        from chakra.schema.protobuf import et_def_pb2 as pb
        enum = {pb.CollectiveCommType.Value(k.upper()): k for k in enum.values()}
    seen = 0
    for rank, path in _files(folder).items():
        for n in READ(path)[1]:
            if n["type"] != COMM_COLL_NODE:
                continue
            op = by_index[n["id"]]
            ranks = groups[n["attr"]["pg_name"]]
            assert rank in ranks and any(tuple(ranks) == tuple(g) for g in op.all_groups)
            assert enum[n["attr"]["comm_type"]] == op.collective
            # ASTRA-sim's comm_size is the rank's input (Ring.cc: an all-gather's result is
            # data_size x nodes); Op.nbytes is the all-gather's output, as nccl-tests counts.
            size = op.nbytes / len(ranks) if op.collective == "all_gather" else op.nbytes
            assert n["attr"]["comm_size"] == round(size)
            seen += 1
    assert seen == sum(len(c.members) * sum(o.kind == "collective" for s in c.streams.values()
                                            for o in s) for c in program.classes)


@pytest.mark.parametrize("job", ["megatron", "fsdp2", "cp"])
def test_every_send_has_its_receive(job: str, request: pytest.FixtureRequest) -> None:
    # Conservation: each transfer appears once as a send in its source's file and once as a
    # receive in its destination's, with the same source, destination, tag and size.
    result, folder = request.getfixturevalue(job)
    sends: Counter[tuple[int, int, int, int]] = Counter()
    recvs: Counter[tuple[int, int, int, int]] = Counter()
    for rank, path in _files(folder).items():
        meta, nodes = READ(path)
        assert meta["attr"]["dropped_deps"] == 0
        for n in nodes:
            if n["type"] in (COMM_SEND_NODE, COMM_RECV_NODE):
                a = n["attr"]
                k = (a["comm_src"], a["comm_dst"], a["comm_tag"], a["comm_size"])
                assert rank == (k[0] if n["type"] == COMM_SEND_NODE else k[1])
                (sends if n["type"] == COMM_SEND_NODE else recvs)[k] += 1
    p2p = [o for o in result.program.ops if o.kind in ("send", "recv")]
    assert p2p and sends and sends == recvs
    assert all(c == 1 for c in sends.values())
    # every (source, destination) pair of every transfer, once
    pairs = Counter((s, d) for o in p2p if o.kind == "send" for s, d in o.pairs)
    # Megatron's rendezvous: the sending stage's op is named "send ...", the receiver's "recv ..."
    pairs += Counter((s, d) for o in p2p if o.kind == "recv" and o.name.startswith("send")
                     for s, d in o.pairs)
    assert Counter((s, d) for s, d, _, _ in sends) == pairs


def test_one_file_per_rank_class_by_default(megatron: tuple[Any, Path], tmp_path: Path) -> None:
    result, _ = megatron
    write_chakra(tmp_path, result.recorder, result.program, all_ranks=True)
    paths = write_chakra(tmp_path, result.recorder, result.program)
    # the earlier export's other ranks are gone: ASTRA-sim would mix them in
    assert sorted(tmp_path.glob("workload.*.et")) == sorted(paths)
    assert sorted(paths) == sorted(tmp_path / f"workload.{c.members[0]}.et"
                                   for c in result.program.classes)
    assert (tmp_path / "comm_groups.json").exists()


@pytest.mark.skipif(not chakra_available(), reason="mlc-chakra is not installed "
                    "(pip install 'fabricsim[chakra]')")
def test_builtin_encoder_writes_chakras_bytes(fsdp2: tuple[Any, Path], tmp_path: Path) -> None:
    # The encoder used without mlc-chakra writes what et_def_pb2 + protolib write.
    result, _ = fsdp2
    a = write_chakra(tmp_path / "a", result.recorder, result.program, all_ranks=True,
                     scenario="x", writer="chakra")
    b = write_chakra(tmp_path / "b", result.recorder, result.program, all_ranks=True,
                     scenario="x", writer="builtin")
    assert [p.read_bytes() for p in a] == [p.read_bytes() for p in b]


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "sim.cli", *args], cwd=cwd, env=env,
                          text=True, capture_output=True, timeout=300)


def test_cli_writes_traces_and_refuses_bad_input(tmp_path: Path) -> None:
    done = _cli("export-chakra", "llama3.2-1b-ddp-8xh100", "--out", "et", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "et").iterdir()) == [
        "comm_groups.json", "workload.0.et"]
    _, nodes = READ(tmp_path / "et" / "workload.0.et")
    assert any(n["type"] == COMM_COLL_NODE for n in nodes)
    # The first run and the first refusal as subprocesses (the command's start-up, exit status
    # and streams); the rest in-process through the same entry point (tests/helpers.py).
    done = fabricsim_in_process("export-chakra", "llama3.2-1b-ddp-8xh100", "--out", "all",
                                "--all-ranks", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert len(list((tmp_path / "all").glob("workload.*.et"))) == 8
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nmodel: llama3.2-1b\ncluster: {topology: dgx-h100, nodes: 0}\n")
    for i, args in enumerate((["export-chakra", str(bad), "--out", "x"],
                              ["export-chakra", "no-such-scenario", "--out", "x"],
                              ["export-chakra", "llama3.2-1b-ddp-8xh100"])):   # no --out
        done = _cli(*args, cwd=tmp_path) if i == 0 else fabricsim_in_process(*args, cwd=tmp_path)
        assert done.returncode == 2, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "x").exists()


def _makespan(nodes: list[dict[str, Any]]) -> int:
    """When the last node ends if each starts as soon as its data and control dependencies
    have ended and takes its duration_micros: ASTRA-sim's replay of one rank with nothing
    else in its way (Kahn's order; a cycle would leave nodes unreached)."""
    by_id = {n["id"]: n for n in nodes}
    waiting = {i: len(set(n["data_deps"] + n["ctrl_deps"])) for i, n in by_id.items()}
    children: dict[int, list[int]] = {i: [] for i in by_id}
    for i, n in by_id.items():
        for d in set(n["data_deps"] + n["ctrl_deps"]):
            children[d].append(i)
    ready = [i for i, w in waiting.items() if w == 0]
    begin = dict.fromkeys(by_id, 0)
    end: dict[int, int] = {}
    while ready:
        i = ready.pop()
        end[i] = begin[i] + by_id[i]["dur"]
        for c in children[i]:
            begin[c] = max(begin[c], end[i])
            waiting[c] -= 1
            if waiting[c] == 0:
                ready.append(c)
    assert len(end) == len(nodes), "a dependency cycle"
    return max(end.values())


def test_dependencies_alone_replay_a_single_class_step(tmp_path: Path) -> None:
    # DDP on one DGX H100 is one rank class whose streams wait only on each other: the
    # longest chain of recorded durations through the exported dependencies is the simulated
    # step (a missing dependency shortens it, a spurious one lengthens it). Rounding each op
    # to whole microseconds moves it by at most ~1 us per op on the chain.
    result = simulate(load_scenario("llama3.2-1b-ddp-8xh100", []), 1)
    (path,) = write_chakra(tmp_path, result.recorder, result.program)
    _, nodes = READ(path)
    step_us = result.summary["step_time_s"] * 1e6
    assert abs(_makespan(nodes) - step_us) <= len(nodes) * 0.5 + 1
    assert abs(_makespan(nodes) - step_us) / step_us < 1e-4


def test_host_work_and_copies_of_an_offloaded_step(tmp_path: Path) -> None:
    # ZeRO-3 with CPU offload: CPU Adam steps (kind host) are CPU nodes, PCIe copies are GPU
    # nodes with their bytes; ASTRA-sim refuses a communication node marked as a CPU op
    # (Workload::issue_comm), so none is.
    result = simulate(load_scenario("llama3-70b-deepspeed-zero3-offload-8xh100", []), 1)
    (path,) = write_chakra(tmp_path, result.recorder, result.program)
    _, nodes = READ(path)
    ops = {o.index: o for o in result.program.ops}
    kinds = Counter(ops[n["id"]].kind for n in nodes)
    assert kinds["host"] > 0 and kinds["copy"] > 0
    for n in nodes:
        op = ops[n["id"]]
        assert n["attr"]["is_cpu_op"] is (op.kind == "host" or op.stream == "host")
        if n["type"] != COMP_NODE:
            assert n["attr"]["is_cpu_op"] is False
        if op.kind == "copy":
            assert n["attr"]["tensor_size"] == round(op.nbytes)
    # The host's issue times (Op.cpu_s) are not in the trace: the dependencies alone can only
    # replay the step as fast as or faster than it ran.
    assert _makespan(nodes) <= result.summary["step_time_s"] * 1e6 + 1


def test_same_scenario_same_bytes(megatron: tuple[Any, Path], tmp_path: Path) -> None:
    # Determinism: a second simulation of the scenario exports byte-identical files.
    _, folder = megatron
    again = _run(MEGATRON_PP, tmp_path)
    write_chakra(tmp_path / "et", again.recorder, again.program, all_ranks=True,
                 scenario="chakra-megatron-tp2pp2")
    for name in [p.name for p in _files(folder).values()] + ["comm_groups.json"]:
        assert (tmp_path / "et" / name).read_bytes() == (folder / name).read_bytes(), name
