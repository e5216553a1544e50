"""``fabricsim replay TRACE``: a profiled (or exported) step rebuilt as a Program and run on a
scenario's fabric.

A trace is a folder (or file) of MLCommons Chakra ``.et`` files (:mod:`.chakra_in`). The
scenario whose fabric runs it is the one the trace's metadata names (``fabricsim
export-chakra`` writes it), with ``--set`` applied (``--set cluster.nic_gbps=400``); the
trace's ranks must fit its cluster.

Compute kernels keep their measured durations: a profiler measures a kernel beside the
collectives that ran with it, so the slowdown they caused is already in the number and is not
applied again (:class:`ReplayEngine`). On another GPU (``--set cluster.gpu=...``) each compute
duration is scaled by :func:`gpu_scale`. The host issue times a replay recovers from the
recorded starts are the traced host's own seconds, so the engine scales them by the target
host's per-op factor over the traced one's (1 on the same host; a DGX H100 or B200 trace
run on a Grace host 2.75 / 1.5, a DGX A100 trace 2.75), not by the target's alone.
Collectives and transfers are simulated afresh on the fabric: that is what a replay on
another fabric changes.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

from sim import catalog
from sim.api import RunResult, run_program
from sim.apps.replay.chakra_in import TraceError, chakra_program, read_chakra, trace_files
from sim.apps.replay.kineto_in import kineto_program, read_kineto
from sim.engine.core import Engine
from sim.frameworks import JobContext
from sim.hardware.host import host_cpu_op_factor
from sim.program.ir import Op, Program, RankClass
from sim.scenario import (
    Scenario,
    ScenarioError,
    load_scenario,
    parse_set,
    scenario_from_dict,
    set_dotted,
)

__all__ = ["MAX_TRACE_BYTES", "ReplayEngine", "TraceError", "check_size", "gpu_scale",
           "replay"]

MAX_TRACE_BYTES = 2 * 2**30
"""Largest trace file read (its uncompressed size for a gzipped one): 2 GiB. A Kineto trace
of one step of a large job is tens to hundreds of MB per rank; what is over this is more
than one step or a mistake, and would take this machine's memory several times over once
parsed."""


class ReplayEngine(Engine):
    """The engine with measured compute times kept as they are (see the module docstring)."""

    def compute_duration(self, cls: RankClass, op: Op) -> float:
        if op.kind == "compute":
            return op.duration * cls.compute_factor
        return op.duration


def check_size(path: Path, limit: int = MAX_TRACE_BYTES) -> None:
    """Refuse, before reading it, a trace file over ``limit`` bytes; a gzipped one by the
    uncompressed size its trailer records (RFC 1952 section 2.3.1: ISIZE, the input's size
    modulo 2^32, the last four bytes, little-endian). A file that inflated past 4 GiB wraps
    round; when it then reads smaller than the compressed file itself (impossible for a
    real trace over a MiB: JSON compresses several times over), it is refused too."""
    size = path.stat().st_size
    if size > limit:
        raise TraceError(f"{path}: {size / 2**30:.1f} GiB is over the {limit / 2**30:g} GiB "
                         "a trace may be (one profiled step)")
    if path.suffix == ".gz" and size >= 18:
        with path.open("rb") as f:
            if f.read(2) != b"\x1f\x8b":
                raise TraceError(f"{path}: not a gzip file")
            f.seek(-4, os.SEEK_END)
            (isize,) = struct.unpack("<I", f.read(4))
        if isize > limit or (size > 2**20 and isize < size):
            raise TraceError(f"{path}: its gzip header says {isize / 2**30:.1f} GiB "
                             f"uncompressed (modulo 4 GiB), over the {limit / 2**30:g} GiB "
                             "a trace may be")


def gpu_scale(trace_gpu: str, target_gpu: str, precision: str = "bf16") -> float:
    """Factor on measured compute durations when the target GPU differs from the trace's:
    the ratio of the two parts' dense peak matrix FLOP/s at the training precision
    (:meth:`sim.catalog.GpuSpec.peak_flops`, the datasheets' numbers). A trace's kernel
    carries no FLOP or byte count that would let its memory-bound part scale by HBM bandwidth
    instead, so every kernel scales as a GEMM does: an upper bound of the gain for
    memory-bound kernels (H100 -> B200 is 2.25x in FLOPs, 2.4x in HBM bandwidth).

    Examples
    --------
    >>> round(gpu_scale("a100-80gb", "h100-sxm"), 3)    # 312 / 989.4 TFLOP/s bf16
    0.315
    """
    if trace_gpu == target_gpu:
        return 1.0
    return catalog.gpu(trace_gpu).peak_flops(precision) / catalog.gpu(target_gpu).peak_flops(
        precision)


TOPOLOGY_BY_GPU = {"a100-40gb": "aws-p4d", "a100-80gb": "dgx-a100", "h100-sxm": "dgx-h100",
                   "h800": "dgx-h100", "h200": "hgx-h200", "b200": "dgx-b200",
                   "gb200": "dgx-b200", "b300": "dgx-b300", "gb300": "dgx-b300"}
"""The shipped topology closest to a trace's GPU when the trace names no scenario (its
``deviceProperties``): the 8-GPU NVSwitch server of that part (A100 40 GB: AWS p4d, the
one shipped with it; H800: an H100 server, with H800's 400 GB/s NVLink from the catalogue;
GB200 / GB300: the HGX server of the same generation, 8-GPU nodes as the trace's layout is
assumed to be, with the Grace part's own catalogue entry)."""


def _own_scenario(name: str, gpu: str | None, world: int, sets: list[str]) -> Scenario:
    """A scenario for a trace that names none: the topology of its GPU, enough 8-GPU nodes
    for its ranks, and a DDP job whose model is a placeholder (a kernel trace names no
    model: the summary's model-derived numbers are left out, see :func:`replay`)."""
    data: dict[str, Any] = {
        "name": f"replay-{name}", "model": "llama3.2-1b",
        "cluster": {"topology": TOPOLOGY_BY_GPU.get(gpu or "", "dgx-h100"),
                    "nodes": max(1, -(-world // 8))},
        "framework": {"name": "ddp"},
        "training": {"seq_len": 1024, "micro_batch_size": 1,
                     "precision": "bf16"}}
    if gpu is not None:
        data["cluster"]["gpu"] = gpu
    for item in sets:
        set_dotted(data, *parse_set(item))
    c = data["cluster"]
    gpus = int(c.get("nodes", 1)) * int(c.get("gpus_per_node", 8))
    data["training"]["global_batch_size"] = gpus      # one sample per GPU: a placeholder
    for item in sets:
        set_dotted(data, *parse_set(item))
    return scenario_from_dict(data, f"replay of {name}")


def _kineto_files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.name.endswith((".json", ".json.gz")))
        if not files:
            raise TraceError(f"{path}: no .et, .json or .json.gz traces")
        return files
    return [path]


def replay(trace: str | Path, sets: list[str] | None = None, scenario: str | None = None,
           step: str | None = None) -> RunResult:
    """Rebuild the step of ``trace`` (Chakra ``.et`` files or PyTorch profiler JSON) and run
    it on ``scenario``'s fabric (by default the one the trace's metadata names, or for a
    profiler trace the shipped topology of its GPU), with ``sets`` applied; the run's result
    and summary. ``step``: the ``ProfilerStep#N`` of a profiler trace to replay."""
    path = Path(trace)
    if not path.exists():
        raise TraceError(f"{path}: no such trace")
    sets = sets or []
    et = path.suffix == ".et" or (path.is_dir() and any(path.glob("*.et")))
    files = trace_files(path) if et else _kineto_files(path)
    for f in files:
        check_size(f)
    if not et:
        return _replay_kineto(path, files, sets, scenario, step)
    t = read_chakra(path)
    ref = scenario or t.scenario
    if not ref:
        raise TraceError(f"{path}: the trace names no scenario; give one with --scenario")
    own, target = load_scenario(ref, []), load_scenario(ref, sets)
    scale = gpu_scale(own.cluster.gpu, target.cluster.gpu, own.training.precision)
    program = chakra_program(t, scale)
    return _run(path, program, target, t.world, scale, own.cluster.gpu)


def _replay_kineto(path: Path, files: list[Path], sets: list[str], scenario: str | None,
                   step: str | None) -> RunResult:
    traces = [read_kineto(f, step) for f in files]
    first = traces[0]
    world = max(max(t.world for t in traces), len(traces))
    name = path.name.split(".")[0]
    if scenario is not None:
        own, target = load_scenario(scenario, []), load_scenario(scenario, sets)
    else:
        own = _own_scenario(name, first.gpu, world, [])
        target = _own_scenario(name, first.gpu, world, sets)
    trace_gpu = first.gpu or own.cluster.gpu
    scale = gpu_scale(trace_gpu, target.cluster.gpu, own.training.precision)
    program = kineto_program(traces, scale)
    result = _run(path, program, target, world, scale, trace_gpu)
    # the summary object's extra key for a profiler trace: what was measured
    extra: dict[str, Any] = result.summary  # type: ignore[assignment]
    extra["replay"] = {"step": first.step_name,
                                "measured_step_time_s": max(t.step_s for t in traces),
                                "trace_gpu": trace_gpu, "compute_scale": scale}
    return result


def _run(path: Path, program: Program, target: Scenario, world: int, scale: float,
         trace_gpu: str) -> RunResult:
    if target.gpus < world:
        raise ScenarioError(f"{path}: the trace has {world} ranks but the cluster "
                            f"{target.gpus} GPUs (set cluster.nodes)")
    if target.gpus > world:
        # the idle GPUs of a larger cluster: each its own class with nothing to do
        for r in range(world, target.gpus):
            program.classes.append(RankClass(len(program.classes), (r,), label=f"idle {r}"))
        program.n_ranks = target.gpus
    program.meta.update(trace=str(path), compute_scale=scale, trace_gpu=trace_gpu)
    ctx = JobContext.from_scenario(target, str(path))
    # Tokens always (the cost per token divides by them); the model's FLOPs only when a
    # scenario names the model (a profiler trace's own scenario has a placeholder).
    program.tokens_per_step = ctx.tokens_per_step
    program.micro_batches = ctx.micro_batches
    if not target.name.startswith("replay-"):
        program.model_flops_per_step = ctx.model.model_flops_per_token(ctx.seq) * \
            ctx.tokens_per_step
    return run_program(ctx, program, 1, engine_class=ReplayEngine,
                       host_factor=host_cpu_op_factor(target.cluster.gpu)
                       / host_cpu_op_factor(trace_gpu))
