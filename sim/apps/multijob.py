"""Several jobs on one fabric: a multi-job file (:mod:`sim.config.multijob`) simulated as one
program on one engine, then read back per job.

How (ARCHITECTURE.md's layers, nothing new in the engine):

1. each job's scenario is built into its own program by its framework, as ``fabricsim run``
   builds it (:func:`sim.frameworks.build_program`), on its own node count;
2. :func:`sim.program.merge.merge` moves its ranks onto its nodes, keeps its rank classes and
   collective keys apart and delays it by its ``start_s``;
3. the merged program runs once on the shared cluster's fabric (one max-min flow network: the
   jobs' flows share links as any flows do). Alike collective groups across nodes are not
   folded into one group's flows here (``CollectiveRunner.fold_across_nodes``): another job
   may cross the links of the groups a fold leaves out;
4. each job's summary is :func:`sim.analysis.collect.collect_summary` over the job's own rank
   classes and op records (times taken from its ``start_s``), its step time the end of its
   last op less ``start_s``, over its ``steps``;
5. ``alone.step_time_s``: the job simulated by itself on the same cluster and nodes, the
   same way (steps 1-4 with one job).

Bytes per link class and per link are not attributed to jobs inside the shared run (the flow
network counts bytes per link, not per flow owner). A job's own are taken from its alone run:
its flows' routes and NCCL's algorithm choices do not depend on load, so they are the bytes it
puts on the fabric in the shared run too (the shared run's totals equal their sum; tested).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sim import catalog
from sim.analysis.collect import collect_summary
from sim.analysis.memory_overheads import overheads
from sim.analysis.metrics import bytes_by_class
from sim.api import fabric_spec, job_facts, nccl_settings
from sim.config.multijob import MultiJob, PlacedJob
from sim.engine.core import Engine, paused_gc
from sim.engine.recorder import OpRecord, Recorder
from sim.fabric.topology import LINK_KINDS, Fabric, build_fabric
from sim.frameworks import JobContext, build_program, framework
from sim.hardware.host import HostSpec
from sim.program.ir import Program
from sim.program.merge import JobPart, JobSlice, merge
from sim.program.traffic import traffic_program

TOP_LINKS = 10
"""Links listed in the output's ``links.busiest``."""


@dataclass
class SharedRun:
    """One simulation of some jobs on the shared fabric."""

    slices: list[JobSlice]
    contexts: list[JobContext | None]
    """Each job's framework context (None for background traffic)."""
    recorder: Recorder
    engine: Engine
    fabric: Fabric
    makespan_s: float
    wall_s: float


def _traffic(j: PlacedJob, gpn: int) -> Program:
    t = j.traffic
    assert t is not None
    return traffic_program(len(j.nodes), gpn, t.bytes, t.period_s, t.count, t.direction)


def run_jobs(mj: MultiJob, jobs: tuple[PlacedJob, ...]) -> SharedRun:
    """Build ``jobs`` (of ``mj``), merge them and run them once on ``mj``'s cluster."""
    wall0 = time.perf_counter()
    gpn = mj.cluster.gpus_per_node
    with paused_gc():
        contexts = [JobContext.from_scenario(j.scenario, j.origin)
                    if j.scenario is not None else None for j in jobs]
        parts = [JobPart(j.name, build_program(ctx), j.nodes, j.start_s,
                         [build_program(ctx) for _ in range(j.steps - 1)])
                 if ctx is not None else JobPart(j.name, _traffic(j, gpn), j.nodes, j.start_s)
                 for j, ctx in zip(jobs, contexts, strict=True)]
        program, slices = merge(parts, mj.cluster.nodes * gpn, gpn)
        # The shared fabric: the file's first training job's scenario (its nccl settings,
        # seed and allocator) on the whole cluster, for the shared run and every alone run.
        lead = mj.lead
        fabric = build_fabric(fabric_spec(lead))
        # The engine's one spec (its interference uses the matrix rate) is the part in a job the
        # size of the cluster: each job's own compute model paces it by its own slowest chip
        # (sim/hardware/power.py), so a job filling the cluster is priced as `fabricsim run`.
        gpu = catalog.gpu(mj.cluster.gpu, mj.cluster.gpu_power_w, mj.cluster.nodes * gpn)
        extra = {c.id: overheads(sl.program, c, gpu.arch, gpn)
                 for sl in slices if sl.program is not None for c in sl.classes}
        expandable = lead.allocator.expandable_segments
        if expandable is None:
            expandable = framework(lead.framework.name).expandable_segments
        recorder = Recorder(keep_memory_series=False, allocator_capacity={
            k: gpu.usable_memory_bytes - o.outside_allocator for k, o in extra.items()},
            expandable_segments=expandable)
        recorder.overheads = extra
        for k, o in extra.items():
            recorder.workspace(k, o.cublas_workspace)
        engine = Engine(fabric, gpu.arch, recorder, nccl_settings(lead),
                        mj.cluster.nic_transport, gpu.sm_count, gpu=gpu)
        engine.collectives.fold_across_nodes = False
        # The lead scenario's host: x86 DGX (Hopper, Blackwell) 1.5, Grace 2.75.
        engine.host_cpu_factor = HostSpec.from_scenario(lead).cpu_op_factor
        makespan = engine.run_step(program)
    return SharedRun(slices, contexts, recorder, engine, fabric, makespan,
                     time.perf_counter() - wall0)


def _job_recorder(run: SharedRun, sl: JobSlice) -> Recorder:
    """The shared run's recorder seen by one job: its classes' op records (start waits left
    out, times from its ``start_s``), memory tracks and overheads."""
    ids = {c.id for c in sl.classes}
    waits = {id(w) for w in sl.waits}
    rec = Recorder(keep_memory_series=False)
    s = sl.start_s
    rec.ops = [OpRecord(r.cls, r.op, r.ready - s, r.start - s, r.end - s, r.step)
               for r in run.recorder.ops if r.cls in ids and id(r.op) not in waits]
    rec.memory = {k: v for k, v in run.recorder.memory.items() if k in ids}
    rec.overheads = {k: v for k, v in run.recorder.overheads.items() if k in ids}
    rec.collective_choices = {k: v for k, v in run.recorder.collective_choices.items()
                              if k.startswith(f"{sl.name}:")}
    return rec


def job_summaries(run: SharedRun, class_bytes: dict[str, np.ndarray]) -> dict[str, Any]:
    """Each job's summary object (CONTRACT.md) from a run, by job name; ``class_bytes`` are
    each job's bytes per link class (:data:`LINK_KINDS` order)."""
    out: dict[str, Any] = {}
    for sl, ctx in zip(run.slices, run.contexts, strict=True):
        assert sl.program is not None
        rec = _job_recorder(run, sl)
        total = max((r.end for r in rec.ops), default=0.0)
        if ctx is None:
            out[sl.name] = traffic_summary(rec, total, class_bytes[sl.name])
            continue
        out[sl.name] = collect_summary(
            ctx.scenario, ctx.gpu, job_facts(ctx, sl.program), sl.program, rec,
            class_bytes[sl.name], len(rec.ops), total, sl.steps, run.wall_s)
    return out


def traffic_summary(rec: Recorder, total: float, class_bytes: np.ndarray) -> dict[str, Any]:
    """A background-traffic job's summary: its transfers' times (each from its start, all
    peers arrived, to its last byte) and bytes. ``step_time_s``: from the job's start to its
    last transfer's end."""
    took = [r.end - r.start for r in rec.ops if r.op.kind == "send"]
    return {"kind": "traffic", "step_time_s": total, "transfers": len(took),
            "mean_transfer_s": sum(took) / len(took) if took else 0.0,
            "max_transfer_s": max(took, default=0.0),
            "bytes": bytes_by_class(class_bytes, 1)}


def _link_name(fabric: Fabric, i: int) -> str:
    u, v = fabric.endpoints[i]
    return f"{'-'.join(map(str, u))} -> {'-'.join(map(str, v))}"


def links_report(shared: SharedRun, alone: dict[str, SharedRun]) -> dict[str, Any]:
    """The busiest links of the shared run: bytes, mean utilisation over the shared run's
    makespan, and each job's bytes on them (from its alone run, see the module's note)."""
    net = shared.engine.net
    fab = shared.fabric
    busy = np.flatnonzero(net.link_bytes > 0)
    cap = fab.capacity[busy]
    util = net.link_bytes[busy] / (cap * shared.makespan_s) if shared.makespan_s > 0 else cap * 0
    order = busy[np.lexsort((busy, -util))][:TOP_LINKS]
    per_job = {name: r.engine.net.link_bytes for name, r in alone.items()}
    rows = []
    for i in order.tolist():
        rows.append({
            "link": _link_name(fab, i),
            "kind": LINK_KINDS[int(fab.kind[i])],
            "capacity_gbps": float(fab.capacity[i]) * 8e-9,
            "bytes": float(net.link_bytes[i]),
            "utilisation": float(net.link_bytes[i] / (fab.capacity[i] * shared.makespan_s)),
            "by_job": {n: float(b[i]) for n, b in per_job.items() if b[i] > 0},
        })
    shared_links = [i for i in busy.tolist() if sum(b[i] > 0 for b in per_job.values()) > 1]
    return {
        "makespan_s": shared.makespan_s,
        "busiest": rows,
        "links_shared_by_jobs": len(shared_links),
        "note": "utilisation = bytes / (capacity x makespan); by_job from each job's alone "
                "run (same routes); folded intra-node groups count one group's NVLink ports",
    }


def simulate_multijob(mj: MultiJob) -> dict[str, Any]:
    """The multi-job output object: ``{name, jobs: [{name, nodes, start_s, summary,
    alone: {step_time_s, ...}, slowdown}], links: {...}}``."""
    return run_multijob(mj)[0]


def write_outputs(out: Path, result: dict[str, Any], shared: SharedRun) -> None:
    """``--out`` of a multi-job run: ``multijob.json`` (the output object), ``timeline.png``
    (the shared run's Gantt chart, its rows labelled by job: ``a/...``) and ``trace.json``
    (the Perfetto trace of the shared run, one process per job's rank class)."""
    from sim.outputs import export, plot

    out.mkdir(parents=True, exist_ok=True)
    (out / "multijob.json").write_text(json.dumps(result, indent=2))
    labels = {c.id: c.label for sl in shared.slices for c in sl.classes}
    plot.timeline(out / "timeline.png", shared.recorder, result["name"], labels,
                  max_rank_classes=max(16, len(labels)))
    export.write_trace(out / "trace.json", shared.recorder, labels, scenario=result["name"])


def run_multijob(mj: MultiJob) -> tuple[dict[str, Any], SharedRun]:
    """:func:`simulate_multijob`'s output and the shared run behind it."""
    alone = {j.name: run_jobs(mj, (j,)) for j in mj.jobs}
    # One job: its alone run is the shared run.
    shared = run_jobs(mj, mj.jobs) if len(mj.jobs) > 1 else alone[mj.jobs[0].name]
    own_bytes = {n: r.engine.net.class_bytes.copy() for n, r in alone.items()}
    summaries = job_summaries(shared, own_bytes)
    alone_summaries = {n: job_summaries(r, own_bytes)[n] for n, r in alone.items()}
    jobs = []
    for j in mj.jobs:
        s = summaries[j.name]
        a = alone_summaries[j.name]
        jobs.append({
            "name": j.name, "nodes": list(j.nodes), "start_s": j.start_s, "steps": j.steps,
            "summary": s,
            "alone": ({"step_time_s": a["step_time_s"], "exposed_comm_s": a["exposed_comm_s"],
                       "comm_time_s": a["comm_time_s"]} if j.traffic is None else
                      {"step_time_s": a["step_time_s"], "mean_transfer_s": a["mean_transfer_s"]}),
            "slowdown": _slowdown(s, a),
        })
    total = bytes_by_class(shared.engine.net.class_bytes, 1)
    return {"name": mj.name, "gpus": mj.cluster.nodes * mj.cluster.gpus_per_node,
            "jobs": jobs, "links": {**links_report(shared, alone), "bytes": total},
            "sim": {"wall_s": shared.wall_s + sum(r.wall_s for r in alone.values()),
                    "events": shared.engine.events_processed + shared.engine.net.solves}
            }, shared


def _slowdown(shared: dict[str, Any], alone: dict[str, Any]) -> float:
    """Step time shared over alone (for traffic: mean transfer time, the periods apart)."""
    key = "mean_transfer_s" if shared.get("kind") == "traffic" else "step_time_s"
    return shared[key] / alone[key] if alone[key] > 0 else 1.0


def render_text(out: dict[str, Any]) -> str:
    """The multi-job output as a short table for the terminal."""
    lines = [f"{out['name']}: {len(out['jobs'])} jobs on {out['gpus']} GPUs",
             f"{'job':<16}{'nodes':>16}{'start s':>9}{'step s alone':>14}{'shared':>11}"
             f"{'slowdown':>10}{'exposed comm s':>16}"]
    for j in out["jobs"]:
        nodes = ",".join(map(str, j["nodes"]))
        if len(nodes) > 15:
            nodes = nodes[:12] + "..."
        s = j["summary"]
        exposed = (f"{s['exposed_comm_s']:>16.4f}" if "exposed_comm_s" in s
                   else f"{'(traffic)':>16}")
        lines.append(f"{j['name']:<16}{nodes:>16}{j['start_s']:>9.3g}"
                     f"{j['alone']['step_time_s']:>14.4f}{s['step_time_s']:>11.4f}"
                     f"{j['slowdown']:>9.3f}x{exposed}")
    lk = out["links"]
    lines.append(f"busiest links (mean utilisation over {lk['makespan_s']:.4f} s; "
                 f"{lk['links_shared_by_jobs']} links carry more than one job):")
    for row in lk["busiest"][:5]:
        jobs = ", ".join(f"{n} {b / 1e9:.2f} GB" for n, b in row["by_job"].items())
        lines.append(f"  {row['link']:<34}{row['kind']:>9}{row['utilisation']:>7.1%}  {jobs}")
    return "\n".join(lines)
