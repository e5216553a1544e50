"""``fabricsim replay`` (sim/apps/replay): a trace rebuilt into a Program and run on a fabric.

Truth: a Chakra export of a simulated step (sim/outputs/export/chakra.py, read back here with
mlc-chakra's reader) replayed on the same cluster is the same step: the exported compute
durations are the original run's, its collectives are simulated again on the same fabric. What
the trace cannot carry (the host's issue times, ``Op.cpu_s``) is the one gap, checked by
running the original program with its issue times zeroed. On a slower fabric the compute stays
as measured and only the collectives change.
"""

from __future__ import annotations

import gzip
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from sim.api import run_program, simulate
from sim.apps.replay import TraceError, check_size, gpu_scale, replay
from sim.cli import app
from sim.engine.time_grid import QUANTUM_S
from sim.frameworks import JobContext, build_program
from sim.outputs.export.chakra import chakra_available, write_chakra
from sim.scenario import load_scenario

ROOT = Path(__file__).resolve().parents[2]
DDP = "llama3.2-1b-ddp-8xh100"

needs_chakra = pytest.mark.skipif(not chakra_available(), reason="mlc-chakra not installed")

# Megatron TP 2 x PP 2 x DP 2 on one DGX H100 (as tests/integration/test_chakra_export.py):
# collectives on tensor- and data-parallel groups and pipeline transfers between stages.
MEGATRON_PP = {
    "name": "replay-megatron-tp2pp2", "model": "llama3.2-1b",
    "cluster": {"topology": "dgx-h100", "nodes": 1},
    "framework": {"name": "megatron", "distributed_optimizer": True},
    "parallelism": {"tp": 2, "pp": 2},
    "training": {"seq_len": 1024, "micro_batch_size": 1, "global_batch_size": 8,
                 "precision": "bf16", "activation_checkpointing": "none"}}


def _export(ref: str, out: Path) -> float:
    """Simulate ``ref``, write its Chakra traces (every rank) to ``out``; its step time."""
    o = simulate(load_scenario(ref))
    write_chakra(out, o.recorder, o.program, all_ranks=True, scenario=ref)
    return float(o.summary["step_time_s"])


@pytest.fixture(scope="module")
def ddp_trace(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float]:
    out = tmp_path_factory.mktemp("ddp")
    return out, _export(DDP, out)


@needs_chakra
def test_chakra_round_trip_same_fabric(ddp_trace: tuple[Path, float]) -> None:
    """DDP on one DGX H100: the replay's step is the simulated step. The gap left is the
    rounding of every duration to whole microseconds (Chakra's ``duration_micros``): ~0.5 us
    over the ~150 kernels on the critical path of a 0.25 s step, so well under 0.1%."""
    out, step = ddp_trace
    r = replay(out)
    assert len(r.program.classes) == 8
    assert abs(r.summary["step_time_s"] / step - 1) < 1e-3
    # every collective came back with its size: the same NVLink bytes
    o = simulate(load_scenario(DDP))
    assert r.summary["bytes"]["nvlink"] == pytest.approx(o.summary["bytes"]["nvlink"],
                                                         rel=1e-6)


@needs_chakra
def test_slower_nvlink_changes_only_the_collectives(ddp_trace: tuple[Path, float]) -> None:
    """NVLink at 100 GB/s instead of the H100's 450: compute time identical (measured
    durations are kept), the step grows by no more than the collectives' time grew, and it
    lands within 5% of simulating the scenario itself on that fabric (the simulation also
    slows the compute beside the longer collectives, which a measured trace already holds
    for its own fabric only)."""
    out, _ = ddp_trace
    base = replay(out).summary
    sets = ["cluster.nvlink_gbytes_per_s=100"]
    slow = replay(out, sets).summary
    assert slow["compute_time_s"] == pytest.approx(base["compute_time_s"], rel=1e-12)
    assert slow["comm_time_s"] > base["comm_time_s"] * 2
    grew = slow["step_time_s"] - base["step_time_s"]
    assert 0 < grew <= slow["comm_time_s"] - base["comm_time_s"] + 1e-9
    sim = simulate(load_scenario(DDP, sets)).summary["step_time_s"]
    assert abs(slow["step_time_s"] / sim - 1) < 0.05


@needs_chakra
def test_other_gpu_scales_compute_by_peak_ratio(ddp_trace: tuple[Path, float]) -> None:
    """On B200s the measured H100 kernels take H100/B200 dense bf16 peak as long."""
    out, _ = ddp_trace
    base = replay(out).summary
    b200_run = replay(out, ["cluster.gpu=b200"])
    b200 = b200_run.summary
    scale = gpu_scale("h100-sxm", "b200")
    assert scale == pytest.approx(989 / 2250, rel=0.01)   # datasheets: 989 and 2,250 TFLOP/s
    # Each kernel's time rounds up to the engine's time grid (under a quantum each).
    kernels = sum(len(ops) for c in b200_run.program.classes for ops in c.streams.values())
    assert b200["compute_time_s"] == pytest.approx(base["compute_time_s"] * scale,
                                                   rel=1e-9, abs=kernels * QUANTUM_S)


@needs_chakra
def test_pipeline_transfers_round_trip(tmp_path: Path) -> None:
    """Megatron TP2 x PP2 x DP2: pipeline sends/receives and TP/DP collectives replay. This
    small step is bound by the host's issue times, which a Chakra trace does not carry: run
    with them zeroed, the original program takes 45.3 ms instead of 59.1. The replay
    recovers them from the recorded starts (an op that started after its stream and its
    dependencies were done waited for the host) and lands within 1% of the original step;
    what is left is the issue time of ops that did not wait (their ``cpu_s`` is spread over
    the next op that did) and the collectives' own (their recorded start is the last
    member's arrival)."""
    scen = tmp_path / "mpp.yaml"
    scen.write_text(yaml.safe_dump(MEGATRON_PP))
    step = _export(str(scen), tmp_path / "et")
    r = replay(tmp_path / "et")
    assert any(op.kind == "recv" for op in r.program.ops)
    assert sum(op.cpu_s for op in r.program.ops) > 0
    ctx = JobContext.from_scenario(load_scenario(str(scen)))
    p = build_program(ctx)
    for op in p.ops:
        op.cpu_s = 0.0
    hostless = run_program(ctx, p).summary["step_time_s"]
    assert hostless < 0.9 * step          # the host matters in this step
    assert abs(r.summary["step_time_s"] / step - 1) < 0.01


@needs_chakra
def test_a_grace_hosts_issue_times_replay_once(tmp_path: Path) -> None:
    """The same host-paced step on a GB200 rack, whose host issues every op at 2.75x the x86
    cost (``HostSpec.cpu_op_factor``): the issue times a replay recovers from the recorded
    starts are that host's seconds already, so the replay engine must not scale them again
    (it did, and landed 2.75x the host's share slow)."""
    gb200 = {**MEGATRON_PP, "name": "replay-megatron-tp2pp2-gb200",
             "cluster": {"topology": "gb200-nvl72", "nodes": 1, "gpus_per_node": 4,
                         "nics_per_node": 4}}
    scen = tmp_path / "gb200.yaml"
    scen.write_text(yaml.safe_dump(gb200))
    step = _export(str(scen), tmp_path / "et")
    r = replay(tmp_path / "et")
    assert sum(op.cpu_s for op in r.program.ops) > 0
    assert abs(r.summary["step_time_s"] / step - 1) < 0.01


@needs_chakra
@pytest.mark.parametrize("gpu, factor", [("b200", 1.0), ("a100-80gb", 1.0 / 1.5)])
def test_issue_times_scale_by_the_target_host_over_the_traced_one(
        ddp_trace: tuple[Path, float], monkeypatch: pytest.MonkeyPatch, gpu: str,
        factor: float) -> None:
    """A DGX H100 trace's issue times are that x86 host's in-job seconds (its fitted 1.5x,
    sim.hardware.host.X86_TRAINING_HOST_FACTOR): on a DGX B200, the same x86 host factor,
    they stand as recorded; on a DGX A100, priced at 1.0, they shrink by 1 / 1.5."""
    import sim.apps.replay as replay_module

    seen: list[float | None] = []

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs.get("host_factor"))
        return run_program(*args, **kwargs)

    monkeypatch.setattr(replay_module, "run_program", recording)
    out, _ = ddp_trace
    replay(out, [f"cluster.gpu={gpu}"])
    assert seen == [pytest.approx(factor, rel=1e-12)]


@needs_chakra
def test_missing_ranks_refused(tmp_path: Path) -> None:
    """One file per rank class (export without --all-ranks) cannot be replayed: one line."""
    o = simulate(load_scenario(DDP))
    write_chakra(tmp_path, o.recorder, o.program, all_ranks=False, scenario=DDP)
    with pytest.raises(TraceError, match="--all-ranks"):
        replay(tmp_path)


def test_size_check_before_reading(tmp_path: Path) -> None:
    """Over the limit: refused by its size (a sparse file: nothing is read or written);
    a gzip whose trailer (ISIZE) says it inflates past the limit: refused too."""
    big = tmp_path / "huge.et"
    with big.open("wb") as f:
        f.truncate(3 * 2**30)
    with pytest.raises(TraceError, match="over the 2 GiB"):
        check_size(big)
    gz = tmp_path / "t.json.gz"
    gz.write_bytes(gzip.compress(b"x" * 5000))
    check_size(gz)                     # 5,000 bytes inflated: fine
    with pytest.raises(TraceError, match="gzip header says"):
        check_size(gz, limit=4000)
    # past 4 GiB the trailer wraps round: a 2 MB gzip that says it inflates to 1,000 bytes
    wrapped = tmp_path / "w.json.gz"
    body = gzip.compress(os.urandom(2**21).hex().encode())
    wrapped.write_bytes(body[:-4] + (1000).to_bytes(4, "little"))
    with pytest.raises(TraceError, match="modulo 4 GiB"):
        check_size(wrapped)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``fabricsim replay ARGS`` in this process (typer's runner: the same code path as the
    command, without a Python start per call); an uncaught exception exits 1, not 2."""
    res = CliRunner().invoke(app, ["replay", *args])
    return subprocess.CompletedProcess(["fabricsim", "replay", *args], res.exit_code,
                                       res.stdout, res.stderr)


def test_cli_bad_traces_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.et"
    bad.write_bytes(b"\x05garbage and more")
    big = tmp_path / "big.et"
    with big.open("wb") as f:
        f.truncate(3 * 2**30)
    for path in (bad, big, tmp_path / "absent"):
        p = _cli(str(path))
        assert p.returncode == 2, p.stderr
        assert len(p.stderr.strip().splitlines()) == 1 and str(path) in p.stderr


@needs_chakra
def test_cli_json(ddp_trace: tuple[Path, float]) -> None:
    import json

    out, step = ddp_trace
    p = _cli(str(out), "--json", "--set", "cluster.nic_gbps=100")
    assert p.returncode == 0, p.stderr
    s = json.loads(p.stdout)
    assert abs(s["step_time_s"] / step - 1) < 1e-3   # one node: no NIC on the path


# ------------------------------------------------------------------ PyTorch profiler traces
KINETO = ROOT / "tests" / "data" / "kineto" / "hta-nccl-a100-rank0.json.gz"


def test_kineto_own_fabric_matches_measured_step() -> None:
    """HTA's sample DDP trace (tests/data/kineto/README.md) on its own hardware (A100 40 GB:
    the AWS p4d topology, the shipped 8 x A100 40 GB NVSwitch server): the replayed
    ProfilerStep#5 lasts its measured 219.73 ms within 5%, and, a check that does not lean on
    the host's time to the step's end, the GPU's last op ends when the trace's last kernel
    did (219.175 ms after the step's start, read from the trace) within 1%. The seven
    collectives come back with the recorded sizes (``In msg nelems`` x the dtype's bytes):
    DDP's buffer broadcasts (53,120 Float and 53 Long elements, read from the trace) and five
    gradient-bucket all-reduces (the first 2,049,000 Float elements)."""
    r = replay(KINETO)
    s = r.summary
    assert s["replay"]["trace_gpu"] == "a100-40gb" and s["replay"]["step"] == "ProfilerStep#5"
    assert abs(s["step_time_s"] / s["replay"]["measured_step_time_s"] - 1) < 0.05
    gpu_end = max(x.end for x in r.recorder.ops if x.op.kind != "host")
    assert abs(gpu_end / 0.219175 - 1) < 0.01
    colls = [op for op in r.program.ops if op.kind == "collective"]
    assert [op.collective for op in colls] == ["broadcast"] * 2 + ["all_reduce"] * 5
    assert [op.nbytes for op in colls[:3]] == [53120 * 4, 53 * 8, 2049000 * 4]
    assert all(op.group == (0, 1) for op in colls)
    assert r.program.classes[0].members == (0, 1)     # rank 0 stands for both ranks


def test_kineto_slow_nvlink_hidden_behind_host() -> None:
    """NVLink 30 x slower: the all-reduces take far longer, yet this step is bound by its
    host (the GPU is busy 50 ms of 220, read from the trace), so the step does not grow by
    more than its collectives did, and here not at all; the compute is unchanged."""
    base = replay(KINETO).summary
    slow = replay(KINETO, ["cluster.nvlink_gbytes_per_s=10"]).summary
    assert slow["comm_time_s"] > 10 * base["comm_time_s"]
    assert slow["compute_time_s"] == pytest.approx(base["compute_time_s"], rel=1e-12)
    grew = slow["step_time_s"] - base["step_time_s"]
    assert -1e-9 <= grew <= slow["comm_time_s"] - base["comm_time_s"]


def test_kineto_malformed_one_line(tmp_path: Path) -> None:
    for i, text in enumerate(('{"traceEvents": [', "[]", '{"traceEvents": 5}', "{}",
                              '{"traceEvents": [{"ph": "X"}]}')):
        bad = tmp_path / f"bad{i}.json"
        bad.write_text(text)
        p = _cli(str(bad))
        assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    big = tmp_path / "big.json.gz"
    big.write_bytes(gzip.compress(b"{}") [:-4] + (2**32 - 1).to_bytes(4, "little"))
    p = _cli(str(big))
    assert p.returncode == 2 and "gzip header says" in p.stderr, p.stderr


def _kineto_doc() -> dict[str, object]:
    """A hand-made 8-rank profiler trace (times in us): a 10 ms kernel on stream 7, an event
    recorded after it that the NCCL stream 20 waits on (PyTorch 2.1+'s ``wait_on_stream`` /
    ``wait_on_cuda_event_record_corr_id`` args), a 1 GiB all-reduce, a 5 ms kernel beside
    it, a ``cudaDeviceSynchronize`` returning at 25 ms, a last 1 ms kernel launched 0.1 ms
    after it; the step's annotation ends at 40 ms."""
    host, base = {"pid": 100, "tid": 1, "ph": "X"}, 10**7

    def launch(ts: float, corr: int, name: str = "cudaLaunchKernel", dur: float = 0.0,
               **args: object) -> dict[str, object]:
        return {**host, "cat": "cuda_runtime", "name": name, "ts": ts, "dur": dur,
                "args": {"correlation": base + corr, "External id": base + corr, **args}}

    def kernel(ts: float, dur: float, corr: int, stream: int, name: str,
               **args: object) -> dict[str, object]:
        return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": ts,
                "dur": dur, "args": {"device": 0, "stream": stream,
                                     "correlation": base + corr, **args}}

    nccl = {"Collective name": "allreduce", "In msg nelems": 2**28, "Out msg nelems": 2**28,
            "Group size": 8, "dtype": "Float", "Process Group Name": "0",
            "Process Group Ranks": "[0, 1, 2, 3, 4, 5, 6, 7]"}
    events = [
        {**host, "cat": "user_annotation", "name": "ProfilerStep#1", "ts": 0.0, "dur": 40000.0,
         "args": {}},
        launch(100.0, 1), kernel(110.0, 10000.0, 1, 7, "gemm_a"),
        launch(200.0, 2, "cudaEventRecord"),
        launch(300.0, 3, "cudaStreamWaitEvent", wait_on_stream=7,
               wait_on_cuda_event_record_corr_id=base + 2),
        launch(400.0, 4), kernel(10110.0, 9000.0, 4, 20,
                                 "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
                                 **nccl),
        launch(500.0, 5), kernel(10110.0, 5000.0, 5, 7, "gemm_b"),
        launch(600.0, 6, "cudaDeviceSynchronize", dur=24400.0),
        launch(25100.0, 7), kernel(25110.0, 1000.0, 7, 7, "gemm_c"),
    ]
    return {"schemaVersion": 1, "distributedInfo": {"rank": 0, "world_size": 8,
                                                    "backend": "nccl"},
            "deviceProperties": [{"id": 0, "name": "NVIDIA H100 80GB HBM3",
                                  "totalGlobalMem": 85520809984}],
            "traceEvents": events}


def test_kineto_waits_and_syncs(tmp_path: Path) -> None:
    """The all-reduce waits for the kernel its event was recorded after (not for the later
    gemm_b), runs beside gemm_b; the host's synchronize waits for both; the last kernel is
    issued 0.1 ms after the synchronize returns (the trace's gap), and the step ends the
    host's measured 14.9 ms after that launch. The synchronize returns when gemm_b or the
    simulated all-reduce ends, sooner than the trace's 25 ms: the host's time is kept, its
    waiting is simulated."""
    import json

    path = tmp_path / "rank0.json"
    path.write_text(json.dumps(_kineto_doc()))
    r = replay(path)
    rec = {x.op.name.split("(")[0]: x for x in r.recorder.ops}
    assert r.summary["replay"]["trace_gpu"] == "h100-sxm"
    ar = rec["ncclDevKernel_AllReduce_Sum_f32_RING_LL"]
    assert ar.op.nbytes == 2**30 and ar.op.group == tuple(range(8))
    assert ar.start == pytest.approx(rec["gemm_a"].end)
    assert rec["gemm_b"].start == pytest.approx(rec["gemm_a"].end)
    sync = rec["cudaDeviceSynchronize"]
    assert sync.end == pytest.approx(max(ar.end, rec["gemm_b"].end))
    assert rec["gemm_c"].start == pytest.approx(sync.end + 100e-6)
    # the host's 14.9 ms after its last launch (25.1 -> 40 ms in the trace) end the step
    assert r.summary["step_time_s"] == pytest.approx(rec["gemm_c"].start + 0.0149)
    assert r.summary["step_time_s"] < 0.040       # the synchronize returned sooner


def test_kineto_one_file_per_rank(tmp_path: Path) -> None:
    """Two ranks' traces in a folder: one rank class each, the all-reduce matched across them
    (the k-th collective of a process group on every member is one collective, NCCL's
    order); rank 1's first kernel 2 ms longer, so the all-reduce waits for it."""
    import json

    ranks = list(range(2))
    for r in ranks:
        doc: dict[str, Any] = _kineto_doc()
        doc["distributedInfo"] = {"rank": r, "world_size": 2, "backend": "nccl"}
        for e in doc["traceEvents"]:
            if "Process Group Ranks" in e.get("args", {}):
                e["args"]["Process Group Ranks"] = "[0, 1]"
            if e["name"] == "gemm_a" and r == 1:
                e["dur"] += 2000.0
        (tmp_path / f"rank{r}.json").write_text(json.dumps(doc))
    res = replay(tmp_path)
    assert [c.members for c in res.program.classes][:2] == [(0,), (1,)]
    recs = [x for x in res.recorder.ops if x.op.kind == "collective"]
    assert len(recs) == 2 and len({x.op.key for x in recs}) == 1
    gemm_a1 = next(x for x in res.recorder.ops if x.op.name == "gemm_a" and x.cls == 1)
    assert all(x.start == pytest.approx(gemm_a1.end) for x in recs)
    # one file of a 2-rank job given twice over is refused
    (tmp_path / "rank1.json").unlink()
    doc = _kineto_doc()
    doc["distributedInfo"] = {"rank": 0, "world_size": 4, "backend": "nccl"}
    (tmp_path / "rank0b.json").write_text(json.dumps(doc))
    with pytest.raises(TraceError, match="replay one rank"):
        replay(tmp_path)


def test_kineto_slower_fabric_grows_by_the_collective(tmp_path: Path) -> None:
    """The hand-made trace with NVLink at 50 GB/s: the all-reduce is on the critical path
    (the synchronize waits for it, gemm_c after), so the step grows by exactly what the
    all-reduce grew; the kernels keep their measured times."""
    import json

    path = tmp_path / "rank0.json"
    path.write_text(json.dumps(_kineto_doc()))

    def run(sets: list[str]) -> tuple[float, float, float]:
        r = replay(path, sets)
        ar = next(x for x in r.recorder.ops if x.op.kind == "collective")
        gemm_b = next(x for x in r.recorder.ops if x.op.name == "gemm_b")
        assert ar.end > gemm_b.end
        return r.summary["step_time_s"], ar.end - ar.start, r.summary["compute_time_s"]

    step, ar, compute = run([])
    slow_step, slow_ar, slow_compute = run(["cluster.nvlink_gbytes_per_s=50"])
    assert slow_ar > 3 * ar
    assert slow_step - step == pytest.approx(slow_ar - ar, rel=1e-9)
    assert slow_compute == pytest.approx(compute, rel=1e-12)
