"""The three phases of a run: build (program and fabric), run (engine), collect (summary).

This is what the command line, notebooks and sweeps call.

Examples
--------
>>> from sim.scenario import load_scenario
>>> result = simulate(load_scenario("llama3.2-1b-1xh200"))
>>> result.summary["gpus"], result.summary["oom"]
(1, False)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from sim import catalog
from sim.analysis.checkpoint_figures import checkpoint_figures
from sim.analysis.collect import JobFacts, collect_summary
from sim.analysis.cost import resolve_pricing
from sim.analysis.memory_overheads import overheads
from sim.analysis.metrics import step_spans
from sim.analysis.summary import StepSpread, Summary
from sim.config.faults import check_faults
from sim.engine.checkpointing import checkpoint_setup, crossing_bytes
from sim.engine.core import Engine, EngineObserver, paused_gc
from sim.engine.jitter import StepJitter
from sim.engine.recorder import Recorder
from sim.engine.splice import run_spliced
from sim.fabric.collectives.runner import NcclSettings
from sim.fabric.topology import TRANSPORT_LATENCY_US, Fabric, FabricSpec, build_fabric
from sim.fabric.topology.link_faults import apply_link_faults
from sim.fabric.topology.routing import ROUTING_BY_TRANSPORT
from sim.frameworks import JobContext, build_program, framework
from sim.hardware.host import HostSpec
from sim.program.ir import Program
from sim.program.split import split_slow
from sim.scenario import Scenario, ScenarioError


@dataclass
class RunResult:
    """Everything a run produced: the summary and the raw material behind it."""

    scenario: Scenario
    summary: Summary
    """The summary object (CONTRACT.md); a plain dict at run time, typed for mypy."""
    program: Program
    recorder: Recorder
    fabric: Fabric
    context: JobContext


def fabric_spec(s: Scenario) -> FabricSpec:
    """The fabric builder's input from the scenario's cluster fields and GPU catalogue."""
    c = s.cluster
    gpu = catalog.gpu(c.gpu)
    nic_lat, switch_lat = TRANSPORT_LATENCY_US[c.nic_transport]
    host = HostSpec.from_scenario(s)
    return FabricSpec(
        nodes=c.nodes,
        gpus_per_node=c.gpus_per_node,
        nvlink_gbytes_per_s=c.nvlink_gbytes_per_s or gpu.nvlink_gbytes_per_s,
        pcie_gbytes_per_s=c.pcie_gbytes_per_s or gpu.pcie_gbytes_per_s,
        nics_per_node=c.nics_per_node,
        nic_gbps=c.nic_gbps,
        azs=c.azs,
        az_placement=c.az_placement,
        az_link_gbps=c.az_link_gbps,
        az_latency_ms=c.az_latency_ms,
        regions=c.regions,
        region_link_gbps=c.region_link_gbps,
        region_latency_ms=c.region_latency_ms,
        nodes_per_leaf=c.nodes_per_leaf,
        oversubscription=c.oversubscription,
        rail_optimized=c.rail_optimized,
        pcie_switches_per_node=c.pcie_switches_per_node or 0,
        gdr=s.nccl.gdr,
        nic_latency_us=c.nic_latency_us if c.nic_latency_us is not None else nic_lat,
        switch_latency_us=c.switch_latency_us if c.switch_latency_us is not None
        else switch_lat,
        ecmp_seed=s.seed,
        nvme_read_gbytes_per_s=host.nvme_read_gbytes_per_s,
        nvme_write_gbytes_per_s=host.nvme_write_gbytes_per_s,
        cpu_vendor=c.cpu_vendor,
        c2c_gbytes_per_s=host.c2c_gbytes_per_s,
        gpus_per_host=host.gpus_per_host,
        sharp=c.sharp,
        routing=c.routing or ROUTING_BY_TRANSPORT[c.nic_transport],
    )


def apply_faults(s: Scenario, program: Program, fabric: Fabric) -> None:
    """The scenario's ``faults:`` on the built program and fabric: the slow GPUs split out of
    their rank classes, one new class per (class, factor) (:func:`sim.program.split.split_slow`),
    slow and failed NIC links on the fabric (:mod:`sim.fabric.topology.link_faults`). No
    block, or an empty one: nothing changes."""
    f = s.faults
    if f is None or f.empty:
        return
    factors = f.gpu_factors(s.cluster.gpus_per_node)
    if factors:
        split_slow(program, factors)
        program.validate()
    apply_link_faults(fabric, [(x.node, x.nic, x.factor) for x in f.slow_links],
                      [(x.node, x.nic) for x in f.failed_links], f.seed)


def nccl_settings(s: Scenario) -> NcclSettings:
    n = s.nccl
    return NcclSettings(algo=n.algo, proto=n.proto, buffsize=n.buffsize, cross_nic=n.cross_nic,
                        collnet_enable=n.collnet_enable, pxn=n.pxn)


def simulate(scenario: Scenario, steps: int = 1, origin: str = "<scenario>",
             progress: Callable[[int, int], None] | None = None,
             keep_link_series: bool = False) -> RunResult:
    """Build, run and summarise ``steps`` training steps of ``scenario``.

    ``keep_link_series`` also records every busy link's rate over time (for ``links.png``;
    it costs memory on large fabrics). ``progress(done, total)`` is called as ops finish,
    counted over all steps (``total`` = ops per step x steps)."""
    wall0 = time.perf_counter()
    with paused_gc():   # build, run and collect without the cyclic collector
        # build (prices first: a bad pricing.instance is refused before anything runs)
        resolve_pricing(scenario, origin=origin)
        check_faults(scenario.faults, scenario.cluster.nodes, scenario.cluster.gpus_per_node,
                     scenario.cluster.nics_per_node, origin)
        ctx = JobContext.from_scenario(scenario, origin)
        program = build_program(ctx)
        return run_program(ctx, program, steps, progress=progress,
                           keep_link_series=keep_link_series, wall0=wall0,
                           shorter=lambda m: _with_micro_batches(ctx, m, origin))


def _with_micro_batches(ctx: JobContext, micro_batches: int, origin: str) -> Program | None:
    """The program of ``ctx``'s job with ``micro_batches`` micro-batches a step (its global
    batch made that much smaller), for the exact advance of :mod:`sim.engine.splice`; None
    where there is no such job (no micro-batch left, or its builder refuses it: the run is
    then simulated whole, never failed for it)."""
    s = ctx.scenario
    if micro_batches <= 0:
        return None
    batch = ctx.global_batch // ctx.micro_batches * micro_batches
    short = s.model_copy(update={"training": s.training.model_copy(
        update={"global_batch_size": batch})})
    try:
        # Its ops must be the long job's: the weight casts stay shared as the long step
        # shares them (Megatron's FP8 casts, once a step; JobContext.cast_micro_batches).
        return build_program(replace(JobContext.from_scenario(short, origin),
                                     cast_micro_batches=ctx.micro_batches))
    except ScenarioError:
        return None


def run_program(ctx: JobContext, program: Program, steps: int = 1,
                progress: Callable[[int, int], None] | None = None,
                keep_link_series: bool = False, wall0: float | None = None,
                engine_class: type[Engine] | None = None,
                shorter: Callable[[int], Program | None] | None = None,
                steady_splice: bool = True, host_factor: float | None = None) -> RunResult:
    """Run a built ``program`` for ``steps`` steps on the fabric of ``ctx``'s scenario (its
    cluster, NCCL settings and faults) and summarise it: the second and third phases of
    :func:`simulate`, for programs built elsewhere too (a replayed trace,
    :mod:`sim.apps.replay`). ``engine_class``: an :class:`Engine` subclass that overrides a
    hook (its ``compute_duration``); None: this module's ``Engine``, looked up at the call
    (tools/profile_step.py substitutes a counting subclass there). ``shorter``: builds the
    same job with a given number of micro-batches; with it (and ``steady_splice``) one step
    without faults, jitter or checkpoints runs as a shorter one with its steady period played
    again, to the same bits (:func:`sim.engine.splice.run_spliced`). ``host_factor``: what
    the engine's host clock multiplies every op's ``cpu_s`` by; None: the scenario's host's
    (:attr:`sim.hardware.host.HostSpec.cpu_op_factor`)."""
    wall0 = time.perf_counter() if wall0 is None else wall0
    engine_class = Engine if engine_class is None else engine_class
    scenario = ctx.scenario
    with paused_gc():
        spec = fabric_spec(scenario)
        saves = checkpoint_setup(scenario.run, spec, ctx.origin)
        fabric = build_fabric(spec) if saves is None else saves.fabric
        apply_faults(scenario, program, fabric)
        if saves is not None:   # on the classes as they run (stragglers split out)
            saves.prepare(program, ctx.model.total_params,
                          scenario.dp * scenario.parallelism.cp, framework(
                              scenario.framework.name).async_checkpoint_stages_write_share)
        extra = {c.id: overheads(program, c, ctx.gpu.arch, scenario.cluster.gpus_per_node)
                 for c in program.classes}
        # The caching allocator's cudaMalloc fails when the GPU is full: the context and NCCL's
        # buffers are there before it. The default is the framework's launcher's (its registry
        # entry: torchtitan's run_train.sh turns expandable segments on).
        expandable = scenario.allocator.expandable_segments
        if expandable is None:
            expandable = framework(scenario.framework.name).expandable_segments
        recorder = Recorder(keep_link_series=keep_link_series, allocator_capacity={
            k: ctx.gpu.usable_memory_bytes - o.outside_allocator for k, o in extra.items()},
            expandable_segments=expandable)
        recorder.overheads = extra
        for c in program.classes:
            recorder.workspace(c.id, extra[c.id].cublas_workspace)
        if host_factor is None:
            host_factor = HostSpec.from_scenario(scenario).cpu_op_factor

        per_step = len(program.ops)

        def make_engine(observer: EngineObserver) -> Engine:
            engine = engine_class(fabric, ctx.gpu.arch, observer, nccl_settings(scenario),
                                  scenario.cluster.nic_transport, ctx.gpu.sm_count,
                                  gpu=ctx.gpu)
            engine.host_cpu_factor = host_factor
            if progress is not None:   # a spliced run's shorter one counts towards it too
                report = progress
                engine.progress = lambda done: report(min(done, per_step * steps),
                                                      per_step * steps)
            return engine

        engine = make_engine(recorder)
        jitter = scenario.faults.jitter if scenario.faults is not None else None
        if jitter is not None and jitter.sigma > 0:   # sigma 0: the run without the key
            engine.jitter = StepJitter(jitter.sigma, jitter.seed)
        # run
        total = 0.0
        if saves is not None:
            engine.storage = saves.storage
        spliced = None
        if (shorter is not None and steady_splice and steps == 1 and saves is None
                and (scenario.faults is None or scenario.faults.empty)):
            spliced = run_spliced(program, shorter, make_engine, recorder, keep_link_series)
        if spliced is not None:
            total = spliced.duration_s
            class_bytes, events = spliced.class_bytes, spliced.ops + spliced.solves
        else:
            for i in range(steps):
                total += engine.run_step(program if saves is None
                                         else saves.program_for(i, program))
            if saves is not None:   # the last asynchronous write, to its end
                engine.drain_background()
            class_bytes = engine.net.class_bytes
            events = engine.events_processed + engine.net.solves
        if progress is not None:
            progress(per_step * steps, per_step * steps)
        # collect
        summary = summarise(ctx, program, recorder, class_bytes, events, total, steps,
                            time.perf_counter() - wall0)
        if engine.jitter is not None:
            summary["step_times"] = step_spread(recorder)
        if saves is not None:
            summary["checkpoint"] = checkpoint_figures(
                recorder, saves.saves_after, saves.bytes_total, saves.asynchronous,
                saves.storage.kind, *crossing_bytes(saves, program))
    return RunResult(scenario, summary, program, recorder, fabric, ctx)


def step_spread(rec: Recorder) -> StepSpread:
    """Percentiles of the recorded steps' durations (``faults.jitter``: the tail is the
    steps a slow draw stretched)."""
    t = np.array([b - a for a, b in step_spans(rec.ops)])
    p = np.percentile(t, [50, 90, 99])
    return {"steps": len(t), "min_s": float(t.min()), "p50_s": float(p[0]),
            "p90_s": float(p[1]), "p99_s": float(p[2]), "max_s": float(t.max())}


def summarise(ctx: JobContext, program: Program, rec: Recorder, class_bytes: np.ndarray,
              events: int, total: float, steps: int, wall_s: float) -> Summary:
    """The run's summary object (:func:`sim.analysis.collect.collect_summary`), with what only
    the framework layer knows gathered here: ``class_bytes`` the network's bytes per link
    class, ``events`` its ops finished and rate solves."""
    return collect_summary(ctx.scenario, ctx.gpu, job_facts(ctx, program), program, rec,
                           class_bytes, events, total, steps, wall_s)


def job_facts(ctx: JobContext, program: Program) -> JobFacts:
    """What the summary needs from the framework layer about the job ``program`` runs."""
    s = ctx.scenario
    states = sum(v for k, v in program.classes[0].initial_memory.items()
                 if k in ("parameters", "optimizer", "gradients"))
    # Gradients some frameworks allocate during the step only (DDP's fp32 .grad): they are
    # model state too.
    transient = framework(s.framework.name).step_gradient_bytes_per_param
    if transient and "gradients" not in program.classes[0].initial_memory:
        states += transient * ctx.model.total_params
    clock = program.meta.get("sm_clock_mhz")
    return JobFacts(attention_backend=ctx.compute.attention_backend,
                    sm_clock_mhz=float(clock) if isinstance(clock, (int, float)) else None,
                    model_params=ctx.model.total_params,
                    active_params=ctx.model.active_params, micro_batches=ctx.micro_batches,
                    flops_per_token=ctx.model.model_flops_per_token(ctx.seq),
                    model_state_bytes=states)
