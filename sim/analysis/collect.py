"""The collect phase of a run: its summary object from the recorded run.

Pure over what the run produced: the recorder, the program, the fabric's bytes per link class
and the engine's counters. What only the framework layer knows (the attention backend chosen,
the bytes of model state each GPU keeps) comes in as :class:`JobFacts`, so analysis never
imports the frameworks (import-linter contract ``apps-through-registry``);
:func:`sim.api.summarise` gathers them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from sim.analysis.claims import judge
from sim.analysis.cost import cost_summary
from sim.analysis.metrics import bytes_by_class, memory_summary, step_times
from sim.analysis.summary import Summary
from sim.catalog import GpuSpec
from sim.engine.recorder import Recorder
from sim.program.ir import Program
from sim.scenario import Scenario


@dataclass(frozen=True)
class JobFacts:
    """What the summary reads from the job beyond the recorded run."""

    attention_backend: str
    """The attention kernels the compute model chose (``flash2``, ``cudnn``, ...)."""
    sm_clock_mhz: float | None
    """The SM clock the step's tensor-core kernels were priced at under
    ``cluster.sm_clock: balanced``; None under ``held`` (the kernel tables' own clocks)."""
    model_params: int
    active_params: int
    """Parameters one token uses (only its top-k routed experts); model_params if dense."""
    micro_batches: int
    """Micro-batches per step on each data-parallel rank."""
    flops_per_token: float
    """Model FLOPs per trained token (6 x parameters + causal attention)."""
    model_state_bytes: float
    """Parameters, gradients and optimizer states each GPU keeps (the claims' bounds)."""


def collect_summary(s: Scenario, gpu: GpuSpec, job: JobFacts, program: Program, rec: Recorder,
                    class_bytes: Iterable[float], events: int, total: float, steps: int,
                    wall_s: float) -> Summary:
    """The summary object (CONTRACT.md) of ``steps`` steps that took ``total`` simulated
    seconds, per step.

    ``class_bytes`` are the bytes carried per link class over the run
    (:attr:`sim.fabric.network.Network.class_bytes`), ``events`` the engine's events plus the
    network's solves, ``wall_s`` the seconds the whole run took."""
    gpus = s.gpus
    times = step_times(rec, program, steps, total)
    step = times.step_time_s
    tokens = program.tokens_per_step
    peak_flops = gpu.peak_flops(s.training.precision)
    mflops = program.model_flops_per_step
    hflops = program.hw_flops_per_step
    mem = memory_summary(rec, program, gpu)
    gbytes = bytes_by_class(class_bytes, steps)
    comm = times.comm_time_s
    summary: Summary = {
        "scenario": s.name,
        "gpus": gpus,
        "step_time_s": step,
        "tokens_per_step": tokens,
        "tokens_per_s": tokens / step,
        "tokens_per_s_per_gpu": tokens / step / gpus,
        "model_flops_per_step": mflops,
        "mfu": mflops / (step * gpus * peak_flops),
        "hfu": hflops / (step * gpus * peak_flops),
        "model_tflops_per_gpu": mflops / step / gpus / 1e12,
        "peak_memory_gib": mem["peak_memory_gib"],
        "peak_reserved_gib": mem["peak_reserved_gib"],
        "peak_nvidia_smi_gib": mem["peak_nvidia_smi_gib"],
        "gpu_memory_gib": mem["gpu_memory_gib"],
        "oom": mem["oom"],
        "compute_time_s": times.compute_time_s,
        "comm_time_s": comm,
        "exposed_comm_s": times.exposed_comm_s,
        "overlap_fraction": (1.0 - times.exposed_comm_s / comm) if comm > 0 else 0.0,
        "bubble_fraction": times.bubble_fraction,
        "bytes": gbytes,
        "cost": cost_summary(s, gpu, step, tokens, gbytes["cross_az"], gbytes["cross_region"]),
        "sim": {"wall_s": wall_s, "events": events, "ranks_simulated": len(program.classes)},
        # Beyond the contract's keys (it only grows): what the numbers rest on.
        "framework": s.framework.name,
        "attention_backend": job.attention_backend,
        "sm_clock_mhz": job.sm_clock_mhz,
        "model_params": job.model_params,
        "active_params": job.active_params,
        "micro_batches": job.micro_batches,
        "host_bound_s": times.host_bound_s,
        "memory_overheads_gib": mem["memory_overheads_gib"],
        "peak_memory_breakdown_gib": mem["peak_memory_breakdown_gib"],
        "memory_by_rank_class": mem["memory_by_rank_class"],
    }
    if s.claims is not None:
        summary["claims"] = judge(s.claims, summary, gpu, s.training.precision,
                                  job.flops_per_token, job.model_state_bytes, scenario=s)
    return summary
