"""Several jobs on one fabric (sim/apps/multijob.py, sim/program/merge.py,
sim/config/multijob.py), checked against max-min fairness's closed forms.

The job: a 4-block Llama-shaped model under PyTorch DDP on 2 nodes of 1 GPU, every gradient in
one bucket (``bucket_mb`` above the model's 0.44 GB of bf16 gradients), so its one all-reduce
runs after backward with no compute beside it: a change in that all-reduce's time is a change
in the step time, one for one.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from sim.apps.multijob import run_jobs, simulate_multijob
from sim.cli.commands import app
from sim.config.base import ScenarioError
from sim.config.multijob import load_multijob
from sim.engine.time_grid import QUANTUM_S
from sim.program.merge import rank_map

TINY = {"name": "tiny-4l", "layers": 4, "hidden": 1024, "heads": 16, "kv_heads": 4,
        "ffn_hidden": 2816, "vocab": 32000}
DDP_ONE_BUCKET = {
    "name": "ddp-one-bucket", "model": TINY, "cluster": {"nodes": 2},
    "framework": {"name": "ddp", "bucket_mb": 1000},
    "training": {"seq_len": 1024, "micro_batch_size": 1, "global_batch_size": 2,
                 "precision": "bf16"},
}
FSDP = {
    "name": "fsdp-tiny", "model": TINY, "cluster": {"nodes": 2},
    "framework": {"name": "fsdp2"},
    "training": {"seq_len": 1024, "micro_batch_size": 1, "global_batch_size": 4,
                 "precision": "bf16"},
}
# 4 servers of 1 GPU and one 400 Gb/s NIC (DGX H100's NIC), 2 per leaf, leaves 4:1
# oversubscribed: each leaf's uplink carries 2 x 400 / 4 = 200 Gb/s (25 GB/s).
OVERSUBSCRIBED = {"topology": "dgx-h100", "nodes": 4, "gpus_per_node": 1, "nics_per_node": 1,
                  "nodes_per_leaf": 2, "oversubscription": 4}


def write(folder: Path, name: str, data: dict) -> Path:
    path = folder / name
    path.write_text(yaml.safe_dump(data))
    return path


def test_rank_map_moves_ranks_onto_nodes():
    # Job node i is cluster node nodes[i]; its GPUs keep their local index.
    assert rank_map([2, 0], 4) == [8, 9, 10, 11, 0, 1, 2, 3]


def test_placement_policies(tmp_path):
    # 8 nodes, 2 per leaf (leaf groups {0,1}, {2,3}, {4,5}, {6,7}); node 2 is taken first.
    jobs = [{"scenario": FSDP, "name": "x", "nodes": [2]},
            {"scenario": FSDP, "name": "p", "placement": "packed"},
            {"scenario": FSDP, "name": "s", "placement": "spread"}]
    path = write(tmp_path, "jobs.yaml", {"cluster": {"topology": "dgx-h100", "nodes": 8,
                                                     "gpus_per_node": 2, "nodes_per_leaf": 2},
                                         "jobs": [dict(jobs[0], scenario=dict(
                                             FSDP, cluster={"nodes": 1}))] + jobs[1:]})
    mj = load_multijob(str(path))
    nodes = {j.name: j.nodes for j in mj.jobs}
    # packed: the first two consecutive free nodes; spread: one per leaf group in turn,
    # over the free nodes (3 is alone in its group now, 6 and 7 share one).
    assert nodes == {"x": (2,), "p": (0, 1), "s": (3, 4)}
    # The job's scenario runs on the shared cluster, on its own node count.
    assert mj.jobs[1].scenario.cluster.nodes == 2
    assert mj.jobs[1].scenario.cluster.nodes_per_leaf == 2


def test_placement_in_a_zone(tmp_path):
    # 2 zones: zone 0 holds nodes 0, 2, 4, 6 and zone 1 nodes 1, 3, 5, 7; leaf groups of 2
    # nodes per zone (zone 0: {0, 2}, {4, 6}).
    one = dict(FSDP, cluster={"nodes": 1})
    cluster = {"topology": "dgx-h100", "nodes": 8, "gpus_per_node": 2, "nodes_per_leaf": 2,
               "azs": 2}
    path = write(tmp_path, "jobs.yaml", {"cluster": cluster, "jobs": [
        {"scenario": one, "name": "x", "nodes": [4]},
        {"scenario": FSDP, "name": "p", "placement": "packed", "zone": 1},
        {"scenario": FSDP, "name": "s", "placement": "spread", "zone": 0}]})
    nodes = {j.name: j.nodes for j in load_multijob(str(path)).jobs}
    # packed: zone 1's first two nodes; spread: one per zone-0 leaf group ({0, 2}, {6}).
    assert nodes == {"x": (4,), "p": (1, 3), "s": (0, 6)}
    # Zone 0's free nodes 0, 2, 6 hold no 3 next to each other (4 is taken).
    bad = write(tmp_path, "bad.yaml", {"cluster": cluster, "jobs": [
        {"scenario": one, "name": "x", "nodes": [4]},
        {"scenario": dict(FSDP, cluster={"nodes": 3}), "name": "p", "placement": "packed",
         "zone": 0}]})
    with pytest.raises(ScenarioError, match=r"jobs\[1\]\.placement: no 3 consecutive.* in zone 0"):
        load_multijob(str(bad))


def test_disjoint_jobs_run_as_alone(tmp_path):
    """Two FSDP jobs, each under its own leaf (no link in common; the second 0.5 ms later),
    each with the step time it has alone. Their flows are in separate max-min components, so
    every rate is the same as alone; what may differ is rounding: a flow's remaining bytes are
    advanced at every event of either job (more, shorter steps of ``remaining -= rate x dt``)
    and the late job's times are taken from its start. So equal within 1e-12 relative (about
    4,500 ulps), not to the last bit (measured: 0 and 2.2e-16)."""
    path = write(tmp_path, "jobs.yaml", {
        "cluster": {"topology": "dgx-h100", "nodes": 4, "gpus_per_node": 2,
                    "nics_per_node": 2, "nodes_per_leaf": 2},
        "jobs": [{"scenario": FSDP, "name": "a", "placement": "packed"},
                 {"scenario": FSDP, "name": "b", "placement": "packed", "start_s": 5e-4}]})
    out = simulate_multijob(load_multijob(str(path)))
    assert [j["nodes"] for j in out["jobs"]] == [[0, 1], [2, 3]]
    assert out["links"]["links_shared_by_jobs"] == 0
    for j in out["jobs"]:
        assert j["summary"]["step_time_s"] == pytest.approx(j["alone"]["step_time_s"],
                                                            rel=1e-12, abs=0)
        assert j["summary"]["comm_time_s"] > 0
    a, b = (j["summary"] for j in out["jobs"])
    # Same bytes on each link class (integrals of rates: equal to rounding).
    assert a["bytes"] == pytest.approx(b["bytes"], rel=1e-12)


def test_jobs_sharing_an_uplink_slow_down_as_max_min_says(tmp_path):
    """Jobs a (nodes 0, 2) and b (nodes 1, 3) each run a 2-rank ring all-reduce of the
    gradients, S bytes, across the two leaves. A ring of n ranks sends 2(n-1)/n x S = S bytes
    from each rank to the next (NCCL's ring all-reduce: reduce-scatter then all-gather), here
    node 0 -> node 2 over leaf 0's uplink and back over leaf 1's. Alone, the uplink (C: 25 GB/s
    at NCCL's network efficiency, the flow network's capacity of that link) is the narrowest
    link on the ring (the NICs carry twice that), so the transfer takes S / C. Shared, both
    jobs' flows cross each uplink in each direction, both wanting more than half: max-min
    gives each C / 2, and the transfer takes 2S / C. The all-reduce has nothing beside it,
    so each step is S / C longer than alone, to the rounding of the solver."""
    job = write(tmp_path, "ddp.yaml", DDP_ONE_BUCKET)
    path = write(tmp_path, "jobs.yaml", {
        "cluster": OVERSUBSCRIBED,
        "jobs": [{"scenario": job.name, "name": "a", "nodes": [0, 2]},
                 {"scenario": job.name, "name": "b", "nodes": [1, 3]}]})
    mj = load_multijob(str(path))
    shared = run_jobs(mj, mj.jobs)
    alone = run_jobs(mj, mj.jobs[:1])
    fab = shared.fabric
    up = [i for i, (u, v) in enumerate(fab.endpoints) if u[0] == "leaf" and v[0] == "spine"]
    cap = shared.engine.net.capacity[up]
    assert len(set(cap.tolist())) == 1
    c = float(cap[0])
    assert fab.capacity[up[0]] == pytest.approx(2 * 400e9 / 8 / 4)   # the uplink's line rate
    ars = [r for r in alone.recorder.ops if r.op.kind == "collective"]
    assert len(ars) == 1 and ars[0].op.collective == "all_reduce"
    s_bytes = ars[0].op.nbytes
    assert alone.recorder.collective_choices["a:" + ars[0].op.key.split(":", 1)[1]] \
        .algorithm == "ring"
    out = simulate_multijob(mj)
    for j in out["jobs"]:
        extra = j["summary"]["step_time_s"] - j["alone"]["step_time_s"]
        assert extra == pytest.approx(s_bytes / c, rel=1e-9)
        assert j["slowdown"] > 1.5
    # Both uplinks' directions carry both jobs; the NIC cables one each.
    busiest = out["links"]["busiest"]
    assert {r["link"] for r in busiest[:4]} == {"leaf-0-0 -> spine-0-0", "spine-0-0 -> leaf-0-0",
                                                "leaf-0-1 -> spine-0-0", "spine-0-0 -> leaf-0-1"}
    assert all(set(r["by_job"]) == {"a", "b"} for r in busiest[:4])


def test_shared_bytes_are_the_jobs_sum(tmp_path):
    """Conservation: the bytes the shared run puts on each link class are the sum of the
    jobs' own (their alone runs', which the per-job summaries report)."""
    job = write(tmp_path, "ddp.yaml", DDP_ONE_BUCKET)
    path = write(tmp_path, "jobs.yaml", {
        "cluster": OVERSUBSCRIBED,
        "jobs": [{"scenario": job.name, "name": "a", "nodes": [0, 2]},
                 {"scenario": str(job), "name": "b", "placement": "spread", "start_s": 1e-3}]})
    mj = load_multijob(str(path))
    shared = run_jobs(mj, mj.jobs)
    alone = [run_jobs(mj, (j,)) for j in mj.jobs]
    total = sum(r.engine.net.class_bytes for r in alone)
    np.testing.assert_allclose(shared.engine.net.class_bytes, total, rtol=1e-9)
    np.testing.assert_allclose(shared.engine.net.link_bytes,
                               sum(r.engine.net.link_bytes for r in alone), rtol=1e-9, atol=1)


def test_start_offset_delays_the_job(tmp_path):
    """A job alone that starts at start_s runs its step as at 0, start_s later."""
    job = write(tmp_path, "ddp.yaml", DDP_ONE_BUCKET)
    path = write(tmp_path, "jobs.yaml", {
        "cluster": OVERSUBSCRIBED,
        "jobs": [{"scenario": job.name, "name": "late", "nodes": [0, 2], "start_s": 0.25}]})
    mj = load_multijob(str(path))
    run = run_jobs(mj, mj.jobs)
    first = min(r.start for r in run.recorder.ops if r.op.name != "job-start-wait")
    assert first >= 0.25
    out = simulate_multijob(mj)
    j = out["jobs"][0]
    assert j["summary"]["step_time_s"] == pytest.approx(run.makespan_s - 0.25, rel=1e-12)
    assert j["summary"]["compute_time_s"] < j["summary"]["step_time_s"]


def test_cli_json(tmp_path):
    job = write(tmp_path, "ddp.yaml", DDP_ONE_BUCKET)
    path = write(tmp_path, "jobs.yaml", {
        "cluster": OVERSUBSCRIBED,
        "jobs": [{"scenario": job.name, "name": "a", "placement": "packed"},
                 {"scenario": job.name, "name": "b", "placement": "packed"}]})
    result = CliRunner().invoke(app, ["run", str(path), "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert [j["name"] for j in out["jobs"]] == ["a", "b"]
    for j in out["jobs"]:
        assert {"name", "summary", "alone"} <= set(j)
        assert j["alone"]["step_time_s"] > 0
        assert j["summary"]["gpus"] == 2
    assert "busiest" in out["links"]
    text = CliRunner().invoke(app, ["run", str(path), "--out", str(tmp_path / "out")],
                              catch_exceptions=False)
    assert text.exit_code == 0 and "slowdown" in text.stdout
    assert json.loads((tmp_path / "out" / "multijob.json").read_text())["jobs"][1]["name"] == "b"
    trace = json.loads((tmp_path / "out" / "trace.json").read_text())
    names = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    assert any(n.startswith("a/") for n in names) and any(n.startswith("b/") for n in names)
    assert (tmp_path / "out" / "timeline.png").stat().st_size > 0


@pytest.mark.parametrize("jobs, key", [
    ([{"scenario": "J", "name": "a", "nodes": [0, 1]},
      {"scenario": "J", "name": "b", "nodes": [1, 2]}], "jobs[1].nodes: node 1 also in jobs[0]"),
    ([{"scenario": "J", "name": "a", "nodes": [0, 1]},
      {"scenario": "J", "name": "b", "placement": "packed"},
      {"scenario": "J", "name": "c", "placement": "packed"}],
     "jobs: need 6 nodes, cluster.nodes is 4"),
    ([{"scenario": "J", "name": "a", "nodes": [3, 4]}], "jobs[0].nodes: node 4 is not in"),
    ([{"scenario": "no-such-scenario", "name": "a"}], "jobs[0].scenario: no scenario"),
    ([{"scenario": "J", "name": "a", "where": 1}], "jobs[0].where: unknown key"),
    ([{"scenario": "J", "name": "a"}, {"scenario": "J", "name": "a"}],
     "jobs[1].name: 'a' names two jobs"),
    ([{"scenario": "J", "name": "a", "placement": "spread", "zone": 1}],
     "jobs[0].zone: 1 is not a zone of the cluster"),
    ([{"name": "a", "nodes": [0, 1]}], "jobs[0]: give scenario or traffic"),
    # Found by fuzzing: an absurd start was an internal OverflowError.
    ([{"scenario": "J", "name": "a", "nodes": [0, 1], "start_s": 1e300}],
     "jobs[0].start_s: Input should be less than or equal to 1000000000"),
])
def test_bad_files_exit_2_naming_file_and_key(tmp_path, jobs, key):
    job = write(tmp_path, "ddp.yaml", DDP_ONE_BUCKET)
    for j in jobs:
        if j.get("scenario") == "J":
            j["scenario"] = job.name
    path = write(tmp_path, "jobs.yaml", {"cluster": OVERSUBSCRIBED, "jobs": jobs})
    result = CliRunner().invoke(app, ["run", str(path), "--json"])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert str(path) in lines[0] and key in lines[0], lines[0]
    assert "Traceback" not in result.output


def test_bad_job_scenario_key_names_the_job(tmp_path):
    bad = dict(DDP_ONE_BUCKET, training={**DDP_ONE_BUCKET["training"], "seq_lenn": 1})
    path = write(tmp_path, "jobs.yaml", {"cluster": OVERSUBSCRIBED,
                                         "jobs": [{"scenario": bad, "name": "a"}]})
    result = CliRunner().invoke(app, ["run", str(path)])
    assert result.exit_code == 2
    line = result.stderr.strip()
    assert "jobs[0].scenario" in line and "training.seq_lenn: unknown key" in line


def test_shipped_example_runs():
    """The README's example: "solo" under its own leaf runs as alone; "a" and "b", spread
    over the same two leaves, share their 2:1 uplinks and are slower."""
    example = Path(__file__).resolve().parents[2] / "scenarios" / "multi-job" / \
        "two-jobs-leaf-spine.yaml"
    out = simulate_multijob(load_multijob(str(example)))
    jobs = {j["name"]: j for j in out["jobs"]}
    assert [jobs[n]["nodes"] for n in ("solo", "a", "b")] == [[4, 5], [0, 2], [1, 3]]
    solo = jobs["solo"]
    assert solo["summary"]["step_time_s"] == pytest.approx(solo["alone"]["step_time_s"],
                                                           rel=1e-12)
    for n in ("a", "b"):
        assert jobs[n]["summary"]["step_time_s"] > jobs[n]["alone"]["step_time_s"]


MEGATRON_TP4 = {
    "name": "megatron-tp4", "model": TINY, "cluster": {"nodes": 2},
    "framework": {"name": "megatron"}, "parallelism": {"tp": 4},
    "training": {"seq_len": 1024, "micro_batch_size": 1, "global_batch_size": 8,
                 "precision": "bf16"},
}


@pytest.mark.parametrize("job", [FSDP, MEGATRON_TP4], ids=["fsdp2", "megatron-tp4"])
def test_one_job_on_its_own_cluster_is_fabricsim_run(tmp_path, job):
    """The multi-job path with one job filling its own cluster (2 nodes of 4 H100), for 2
    steps, gives what ``simulate`` gives for 2 steps: the merge only renames; step barriers do
    what the engine does between steps; Megatron's 4 data-parallel pairs across the nodes (one
    per rail), which ``simulate`` folds into one pair's flows and the multi-job run does not,
    run on disjoint links as the folded one stands for them. Measured equal to the last bit;
    1e-12 relative allowed for the unfolded groups' separate rate updates."""
    from sim.api import simulate

    cluster = {"topology": "dgx-h100", "nodes": 2, "gpus_per_node": 4, "nics_per_node": 4}
    job = {**job, "training": {**job["training"], "global_batch_size": 8}}
    path = write(tmp_path, "jobs.yaml", {"cluster": cluster, "jobs": [
        {"scenario": job, "name": "only", "nodes": [0, 1], "steps": 2}]})
    mj = load_multijob(str(path))
    out = simulate_multijob(mj)["jobs"][0]["summary"]
    ref = simulate(mj.jobs[0].scenario, steps=2).summary
    for key in ("step_time_s", "exposed_comm_s", "compute_time_s", "comm_time_s",
                "peak_memory_gib"):
        assert out[key] == pytest.approx(ref[key], rel=1e-12), key
    assert out["bytes"] == pytest.approx(ref["bytes"], rel=1e-12)


def test_background_traffic_shares_the_uplink_as_max_min_says(tmp_path):
    """Two background-traffic jobs, node 0 -> node 2 and node 1 -> node 3, B = 1 GB each,
    both across leaf 0's uplink (C = the flow network's capacity of that link, the narrowest
    on the path alone). Alone a transfer takes L + B / C; together max-min gives each C / 2,
    so each takes B / C longer. The periodic one repeats every period_s: its last transfer
    ends (count - 1) x period_s + one transfer after its start (the transfer is shorter than
    the period, so none waits for the previous)."""
    b = 1.0e9
    # A multi-job file needs a training job: this one sits under its own leaf (nodes 4, 5).
    path = write(tmp_path, "jobs.yaml", {"cluster": {**OVERSUBSCRIBED, "nodes": 6}, "jobs": [
        {"traffic": {"bytes": b, "period_s": 0.1, "direction": "chain"}, "name": "x",
         "nodes": [0, 2]},
        {"traffic": {"bytes": b, "period_s": 0.1, "count": 3, "direction": "chain"},
         "name": "y", "nodes": [1, 3]},
        {"scenario": DDP_ONE_BUCKET, "name": "train", "nodes": [4, 5]}]})
    mj = load_multijob(str(path))
    shared = run_jobs(mj, mj.jobs)
    up = [i for i, (u, v) in enumerate(shared.fabric.endpoints)
          if u == ("leaf", 0, 0) and v[0] == "spine"]
    c = float(shared.engine.net.capacity[up[0]])
    out = {j["name"]: j for j in simulate_multijob(mj)["jobs"]}
    x, y = out["x"], out["y"]
    first_y = [r.end - r.start for r in shared.recorder.ops
               if r.op.kind == "send" and r.op.key.startswith("y:") and r.op.key.endswith("/0")]
    assert x["summary"]["mean_transfer_s"] - x["alone"]["mean_transfer_s"] == \
        pytest.approx(b / c, rel=1e-9)
    assert first_y[0] - y["alone"]["mean_transfer_s"] == pytest.approx(b / c, rel=1e-9)
    # y alone: 2 periods, then one transfer.
    # Three delays (two periods, the transfer's latency) round up to the time grid.
    assert y["alone"]["step_time_s"] == pytest.approx(0.2 + y["alone"]["mean_transfer_s"],
                                                      rel=1e-12, abs=3 * QUANTUM_S)
    assert y["summary"]["transfers"] == 3
    assert x["summary"]["bytes"]["network"] == pytest.approx(4 * b)   # 4 network hops
    # The training job under its own leaf is untouched.
    assert out["train"]["summary"]["step_time_s"] == pytest.approx(
        out["train"]["alone"]["step_time_s"], rel=1e-12)
