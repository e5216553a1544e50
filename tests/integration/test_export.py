"""Trace exports (sim/outputs/export/__init__.py): the Perfetto trace's tracks, names, arguments and
counters
against the recorder and the summary, and the per-rank traces read by Holistic Trace Analysis
(HTA, github.com/pytorch/HolisticTraceAnalysis) against the recorder's own numbers."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
from conftest import make_scenario

from sim.api import RunResult, simulate
from sim.engine.recorder import OpRecord, Recorder
from sim.fabric.topology import LINK_KINDS
from sim.outputs import export
from sim.program.ir import MEMORY_CATEGORIES, Op
from sim.scenario import load_scenario

# Three small jobs with different shapes: DDP on one node (one rank class, one comm stream),
# FSDP2 on 2 nodes x 2 GPUs (NVLink, PCIe and network traffic, two comm streams), Megatron
# TP2 x PP2 x DP2 (two rank classes, TP collectives on the compute stream, pipeline sends, a
# tied-embedding all-reduce between the first and last stage that waits for its peers).
FSDP2_2NODE = {
    "name": "tiny-fsdp2-2node",
    "model": {"layers": 2, "hidden": 512, "heads": 8, "kv_heads": 2, "ffn_hidden": 1536,
              "vocab": 32000},
    "cluster": {"gpu": "h100-sxm", "nodes": 2, "gpus_per_node": 2, "nics_per_node": 2},
    "framework": {"name": "fsdp2"},
    "training": {"seq_len": 1024, "micro_batch_size": 1},
}
MEGATRON_PP = {
    "name": "tiny-megatron-tp2pp2dp2",
    "model": {"layers": 4, "hidden": 1024, "heads": 16, "ffn_hidden": 4096, "vocab": 32000,
              "mlp": "gelu", "tied_embeddings": True},
    "cluster": {"gpu": "h100-sxm", "nodes": 1, "gpus_per_node": 8},
    "framework": {"name": "megatron"},
    "parallelism": {"tp": 2, "pp": 2, "dp": 2},
    "training": {"seq_len": 1024, "micro_batch_size": 1, "global_batch_size": 8},
}
NAMES = ("ddp", "fsdp2", "megatron")
# HTA 0.5.0 passes inplace=True to pandas 3, which warns on every call.
pytestmark = pytest.mark.filterwarnings("ignore:The inplace keyword")
COMM = ("collective", "send", "recv")
US = 1e-6


@pytest.fixture(scope="module")
def runs() -> dict[str, RunResult]:
    return {"ddp": simulate(load_scenario("llama3.2-1b-ddp-8xh100")),
            "fsdp2": simulate(make_scenario(FSDP2_2NODE)),
            "megatron": simulate(make_scenario(MEGATRON_PP))}


@pytest.fixture(scope="module")
def traces(runs) -> dict[str, dict[str, Any]]:
    # What a viewer reads: the document after a JSON round trip.
    return {k: json.loads(json.dumps(export.chrome_trace(
        r.recorder, program=r.program, scenario=r.summary["scenario"])))
        for k, r in runs.items()}


def slices(trace: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X"]


def metadata(trace: dict[str, Any], name: str) -> dict[tuple[int, int], Any]:
    return {(e["pid"], e.get("tid", 0)): e["args"] for e in trace["traceEvents"]
            if e["ph"] == "M" and e["name"] == name}


# --------------------------------------------------------------------------- Perfetto trace
@pytest.mark.parametrize("name", NAMES)
def test_every_track_nests_or_is_disjoint(traces, runs, name) -> None:
    trace = traces[name]
    assert export.overlapping_slices(trace) == []
    assert len(slices(trace)) == len(runs[name].recorder.ops)   # one slice per op
    assert trace["otherData"]["scenario"] == runs[name].summary["scenario"]


def test_rounding_cannot_make_touching_ops_overlap() -> None:
    # Ops of one stream back to back at times float64 cannot hold as microseconds exactly
    # (thirds of a microsecond), with zero-length ops between them: in plain float
    # microseconds ts + dur of one op can exceed the next ts; on integer nanoseconds it cannot.
    rec = Recorder()
    t = [k / 3 * US for k in range(3000)]
    for k in range(len(t) - 1):
        end = t[k] if k % 5 == 0 else t[k + 1]   # every fifth op takes no time
        rec.ops.append(OpRecord(0, Op(f"op{k}", "compute", "compute", "fwd"), t[k], t[k], end,
                                0))
    naive = [(r.start * 1e6, (r.end - r.start) * 1e6) for r in rec.ops]
    assert any(a + d > b for (a, d), (b, _) in zip(naive, naive[1:], strict=False))
    trace = json.loads(json.dumps(export.chrome_trace(rec)))
    assert export.overlapping_slices(trace) == []
    got = [(round(e["ts"] * 1000), round(e["dur"] * 1000)) for e in slices(trace)]
    assert all(a + d <= b for (a, d), (b, _) in zip(got, got[1:], strict=False))


def test_the_checker_finds_a_partial_overlap() -> None:
    track = [{"ph": "X", "pid": 1, "tid": 2, "ts": 0.0, "dur": 5.0},
             {"ph": "X", "pid": 1, "tid": 2, "ts": 1.0, "dur": 2.0},     # nested
             {"ph": "X", "pid": 1, "tid": 2, "ts": 5.0, "dur": 1.0},     # touches
             {"ph": "X", "pid": 1, "tid": 3, "ts": 0.5, "dur": 9.0}]     # another track
    assert export.overlapping_slices({"traceEvents": track}) == []
    bad = track + [{"ph": "X", "pid": 1, "tid": 2, "ts": 2.5, "dur": 1.0}]  # 2.5-3.5 vs 1-3
    found = export.overlapping_slices(bad)
    assert [(k, o["ts"], i["ts"]) for k, o, i in found] == [((1, 2), 1.0, 2.5)]


@pytest.mark.parametrize("name", NAMES)
def test_processes_and_threads_are_named(traces, runs, name) -> None:
    trace, program = traces[name], runs[name].program
    procs = metadata(trace, "process_name")
    sort = metadata(trace, "process_sort_index")
    threads = metadata(trace, "thread_name")
    thread_sort = metadata(trace, "thread_sort_index")
    pids = {e["pid"] for e in slices(trace)}
    assert len(pids) == len(program.classes)
    labels = {args["name"] for (pid, _), args in procs.items() if pid in pids}
    for c in program.classes:
        assert f"{c.label} [ranks {export.rank_list(c.members)}]" in labels
    for e in slices(trace):
        assert (e["pid"], 0) in procs and (e["pid"], 0) in sort
        assert (e["pid"], e["tid"]) in threads and (e["pid"], e["tid"]) in thread_sort
    for key, args in threads.items():
        if args["name"] == "compute":
            assert thread_sort[key]["sort_index"] == 0   # compute first
    # Every stream of every class is a thread of its process.
    for c in program.classes:
        pid = next(p for (p, _), a in procs.items() if a["name"].startswith(c.label + " ["))
        assert {a["name"] for (p, _), a in threads.items() if p == pid} == set(c.streams)


@pytest.mark.parametrize("name", NAMES)
def test_counters_per_link_class_and_memory_category(traces, runs, name) -> None:
    trace, rec = traces[name], runs[name].recorder
    counters = [e for e in trace["traceEvents"] if e["ph"] == "C"]
    links = [e for e in counters if e["name"].endswith(" GB/s")]
    assert {e["name"] for e in links} == {f"{k} GB/s" for k in LINK_KINDS}
    assert all(list(e["args"]) == ["GB/s"] for e in links)
    fabric = {e["pid"] for e in links}
    assert len(fabric) == 1 and "fabric" in metadata(trace, "process_name")[
        (fabric.pop(), 0)]["name"]
    memory = [e for e in counters if e["name"] == "memory (GiB)"]
    assert all(list(e["args"]) == list(MEMORY_CATEGORIES) for e in memory)
    pids = {e["pid"] for e in slices(trace)}
    assert {e["pid"] for e in memory} == pids   # one memory track per rank-class process
    # The largest total of the samples is the recorder's largest series total, in GiB.
    for pid, (_, track) in zip(sorted(pids), sorted(rec.memory.items()), strict=True):
        top = max(sum(e["args"].values()) for e in memory if e["pid"] == pid)
        assert top * 2**30 == pytest.approx(max(sum(c.values()) for _, c in track.series),
                                            rel=1e-12)


@pytest.mark.parametrize("name", NAMES)
def test_link_counters_integrate_to_the_summary_bytes(traces, runs, name) -> None:
    # The counters are piecewise constant from one sample to the next: their integral over
    # the run is the bytes the network counted on each link class (summary["bytes"], one
    # step). Traffic ends, so each counter's last sample is zero.
    summary = runs[name].summary
    total = sum(summary["bytes"].values())
    assert total > 0
    for kind in LINK_KINDS:
        samples = [(e["ts"], e["args"]["GB/s"]) for e in traces[name]["traceEvents"]
                   if e["ph"] == "C" and e["name"] == f"{kind} GB/s"]
        assert samples[-1][1] == pytest.approx(0.0, abs=1e-9)
        integral = sum(v * 1e9 * (t1 - t0) * US
                       for (t0, v), (t1, _) in zip(samples, samples[1:], strict=False))
        # Relative 1e-6 of the run's traffic: float64 summation of a few hundred terms.
        assert integral == pytest.approx(summary["bytes"][kind], rel=1e-6, abs=1e-6 * total)
    if name == "fsdp2":
        assert summary["bytes"]["network"] > 0 and summary["bytes"]["pcie"] > 0


@pytest.mark.parametrize("name", NAMES)
def test_op_arguments(traces, runs, name) -> None:
    rec = runs[name].recorder
    xs = slices(traces[name])
    with_choice = 0
    for e, r in zip(xs, rec.ops, strict=True):
        op, args = r.op, e["args"]
        assert e["name"] == op.name
        assert args["category"] == op.category and args["phase"] == op.phase
        if op.nbytes:
            assert args["bytes"] == op.nbytes
        else:
            assert "bytes" not in args
        assert args.get("layer") == op.layer and args.get("micro_batch") == op.micro_batch
        assert args["ready_us"] == pytest.approx(r.ready * 1e6, rel=1e-12)
        # Slices run from start to end, to the nanosecond.
        assert e["ts"] == pytest.approx(r.start * 1e6, abs=5e-4)
        assert e["ts"] + e["dur"] == pytest.approx(r.end * 1e6, abs=1e-3)
        if op.kind in COMM:
            choice = rec.collective_choices[op.key]   # NCCL chose for every one of them
            assert (args["algorithm"], args["protocol"]) == (choice.algorithm, choice.protocol)
            assert args["predicted_us"] == pytest.approx(choice.predicted_s * 1e6)
            assert args["wait_for_peers_us"] == pytest.approx((r.start - r.ready) * 1e6)
            with_choice += 1
        if op.kind == "collective":
            assert args["group_size"] == len(op.all_groups[0])
            assert args["ranks"] == export.rank_list(op.all_groups[0])
    assert with_choice == sum(r.op.kind in COMM for r in rec.ops) > 0
    if name == "megatron":
        # The tied-embedding all-reduce spans both stages: one of them waits for the other.
        waits = [e["args"]["wait_for_peers_us"] for e in xs
                 if e["args"].get("wait_for_peers_us", 0) > 0]
        assert waits


# --------------------------------------------------------------------------- HTA traces
NCCL_KERNEL = re.compile(r"^nccl.*Kernel")   # hta/utils/utils.py, is_comm_kernel


def write_hta(run: RunResult, folder: Path, all_ranks: bool = False) -> list[Path]:
    return export.write_hta_traces(
        folder, run.recorder, run.program, gpus_per_node=run.scenario.cluster.gpus_per_node,
        gpu=run.context.gpu, dtype=export.NCCL_TYPES[run.scenario.training.precision],
        all_ranks=all_ranks, scenario=run.summary["scenario"])


@pytest.mark.parametrize("name", NAMES)
def test_hta_files_one_per_rank_class(runs, name, tmp_path) -> None:
    run = runs[name]
    gpn = run.scenario.cluster.gpus_per_node
    paths = write_hta(run, tmp_path)
    docs = [json.loads(p.read_text()) for p in paths]
    assert sorted(d["distributedInfo"]["rank"] for d in docs) == sorted(
        c.members[0] for c in run.program.classes)
    for p, d in zip(paths, docs, strict=True):
        info = d["distributedInfo"]
        assert info == {"rank": info["rank"], "world_size": run.summary["gpus"],
                        "backend": "nccl"}
        assert p.read_text().startswith('{"distributedInfo": {"rank": ')  # HTA's regex
        assert d["deviceProperties"][0]["numSms"] == run.context.gpu.sm_count
        events = d["traceEvents"]
        kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy")]
        launches = {e["args"]["correlation"]: e for e in events
                    if e.get("cat") == "cuda_runtime"}
        assert len(launches) == len(kernels) > 0
        for k in kernels:
            assert k["pid"] == info["rank"] % gpn == k["args"]["device"]
            assert k["tid"] == k["args"]["stream"] > 0
            assert launches[k["args"]["correlation"]]["ts"] <= k["ts"]
        cls = next(c for c in run.program.classes if c.members[0] == info["rank"])
        ops = [r.op for r in run.recorder.ops if r.cls == cls.id]
        comm = [k for k in kernels if NCCL_KERNEL.match(k["name"])]
        assert len(comm) == sum(op.kind in COMM for op in ops)
        # Waits with no GPU time (stream-event waits, synchronize) launch no kernel.
        timed = [r.op for r in run.recorder.ops if r.cls == cls.id and r.end > r.ready]
        assert len(kernels) - len(comm) == sum(op.kind in ("compute", "copy")
                                               and op.stream != "host" for op in timed)
        assert all(k["args"]["bytes"] == int(k_op.nbytes) for k, k_op in zip(
            comm, [op for op in ops if op.kind in COMM], strict=True))
        assert [e["name"] for e in events if e.get("cat") == "user_annotation"] == [
            "ProfilerStep#0"]


def test_hta_all_ranks_writes_every_rank(runs, tmp_path) -> None:
    run = runs["megatron"]
    docs = [json.loads(p.read_text()) for p in write_hta(run, tmp_path, all_ranks=True)]
    assert sorted(d["distributedInfo"]["rank"] for d in docs) == list(range(8))
    assert {d["distributedInfo"]["world_size"] for d in docs} == {8}


def test_nccl_kernel_names_follow_nccl() -> None:
    # NCCL src/device/generate.py, best_kernel: one kernel per collective and type; the tree
    # algorithm has its own reduction kernel, everything else runs in the RING_LL one.
    def op(coll: str | None, kind: str = "collective") -> Op:
        return Op("x", kind, "comm", "comm", collective=coll)  # type: ignore[arg-type]

    sig = "(ncclDevComm*, unsigned long, ncclWork*)"
    assert export.nccl_kernel_name(op("reduce_scatter"), "nvls", "f32") == \
        "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL" + sig
    assert export.nccl_kernel_name(op("all_reduce"), "tree") == \
        "ncclDevKernel_AllReduce_Sum_bf16_TREE_LL" + sig
    assert export.nccl_kernel_name(op("all_to_all"), "ring") == "ncclDevKernel_SendRecv" + sig
    assert export.nccl_kernel_name(op(None, "send"), "p2p") == "ncclDevKernel_SendRecv" + sig


def hta_overlap(records: list[OpRecord], rounded: bool = True) -> float:
    """HTA's communication/computation overlap of one rank, from the recorder.

    hta/analyzers/communication_analysis.py, get_comm_comp_overlap_value: GPU kernels named
    "^nccl.*Kernel" are communication, the rest of the kernels computation (copies are
    "memory" kernels, in neither); each set is merged into disjoint intervals
    (hta/utils/utils.py, merge_kernel_intervals); the ratio is the time both sets run over the
    merged communication time. A profiler's NCCL kernel starts when its stream reaches it
    (``ready``) and waits inside for its peers. ``rounded``: the times HTA works on, our
    nanoseconds as microseconds rounded start up and end down to whole microseconds
    (hta/common/trace_parser.py, round_down_time_stamps).
    """
    comm: list[tuple[float, float]] = []
    comp: list[tuple[float, float]] = []
    for r in records:
        op = r.op
        if op.kind == "copy" or op.stream == "cpu":
            continue
        a, b = round(r.ready * 1e9), round(r.end * 1e9)
        if b <= a:
            continue
        if rounded:
            ts, dur = export.us_from_ns(a), export.us_from_ns(b - a)   # as the file holds them
            span = (math.ceil(ts), math.floor(ts + dur))
        else:
            span = (r.ready / US, r.end / US)
        (comm if op.kind in COMM else comp).append(span)

    def merge(spans: list[tuple[float, float]]) -> list[list[float]]:
        groups: list[list[float]] = []
        reach = -math.inf
        for s, e in sorted(spans, key=lambda x: x[0]):
            if s > reach:
                groups.append([s, e])
            else:
                groups[-1][1] = max(groups[-1][1], e)
            reach = max(reach, e)
        return groups

    mcomm, mcomp = merge(comm), merge(comp)
    marks = sorted([(s, 1) for s, _ in mcomm] + [(e, -1) for _, e in mcomm]
                   + [(s, 2) for s, _ in mcomp] + [(e, -2) for _, e in mcomp])
    both, running = 0.0, 0
    for (t0, step), (t1, _) in zip(marks, marks[1:], strict=False):
        running += step
        if running == 3:
            both += t1 - t0
    return both / sum(e - s for s, e in mcomm)


def hta_analysis(folder: Path) -> Any:
    # HolisticTraceAnalysis from the test extras; no fallback: these tests need it.
    from hta.trace_analysis import TraceAnalysis

    return TraceAnalysis(trace_dir=str(folder))


def comm_comp_overlap(analysis: Any) -> dict[int, float]:
    df = analysis.get_comm_comp_overlap(visualize=False)
    return {int(r): float(p) for r, p in zip(df["rank"], df["comp_comm_overlap_pctg"],
                                              strict=True)}


@pytest.mark.parametrize("name", NAMES)
def test_hta_overlap_matches_ours(runs, name, tmp_path) -> None:
    run = runs[name]
    write_hta(run, tmp_path)
    got = comm_comp_overlap(hta_analysis(tmp_path))
    assert sorted(got) == sorted(c.members[0] for c in run.program.classes)
    for c in run.program.classes:
        records = [r for r in run.recorder.ops if r.cls == c.id]
        # HTA prints a percentage rounded to two decimals.
        assert got[c.members[0]] == pytest.approx(100 * hta_overlap(records), abs=0.005 + 1e-9)
        # Against the unrounded times: HTA moves each kernel's start and end by less than a
        # microsecond, so overlap and communication time each change by at most 2 us a kernel.
        n_comm = sum(r.op.kind in COMM for r in records)
        n_comp = sum(r.op.kind == "compute" for r in records)
        comm_s = sum(r.end - r.ready for r in records if r.op.kind in COMM)
        bound = (2 * US * (n_comm + n_comp) + 2 * US * n_comm) / (comm_s - 2 * US * n_comm)
        exact = hta_overlap(records, rounded=False)
        assert got[c.members[0]] / 100 == pytest.approx(exact, abs=bound + 0.00005)
    if name == "ddp":
        # One rank class: collectives start when ready, there are no copies, so HTA's
        # definition is the summary's (time communication runs beside compute / comm time).
        assert hta_overlap(run.recorder.ops, rounded=False) == pytest.approx(
            run.summary["overlap_fraction"], rel=1e-9)


def test_hta_drops_the_last_profiler_step(tmp_path) -> None:
    # Two steps: HTA keeps only kernels launched inside a ProfilerStep before the last one
    # (hta/common/trace.py, _filter_irrelevant_gpu_kernels), found through each kernel's
    # correlation with its launch. Its overlap is then step 0's.
    run = simulate(load_scenario("llama3.2-1b-ddp-8xh100"), steps=2)
    write_hta(run, tmp_path)
    doc = json.loads((tmp_path / "rank0.json").read_text())
    steps = [e for e in doc["traceEvents"] if e.get("cat") == "user_annotation"]
    assert [e["name"] for e in steps] == ["ProfilerStep#0", "ProfilerStep#1"]
    assert steps[0]["ts"] + steps[0]["dur"] <= steps[1]["ts"]
    analysis = hta_analysis(tmp_path)
    assert analysis.t.get_iterations() == [0]
    first = [r for r in run.recorder.ops if r.step == 0]
    kept = analysis.t.get_trace(0)
    assert int(kept["stream"].gt(0).sum()) == len(first) < len(run.recorder.ops)
    assert comm_comp_overlap(analysis)[0] == pytest.approx(100 * hta_overlap(first),
                                                           abs=0.005 + 1e-9)
