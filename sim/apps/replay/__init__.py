"""``fabricsim replay TRACE``: a profiled (or exported) step rebuilt as a Program and run on a
scenario's fabric.

A trace is a folder (or file) of MLCommons Chakra ``.et`` files (:mod:`.chakra_in`). The
scenario whose fabric runs it is the one the trace's metadata names (``fabricsim
export-chakra`` writes it), with ``--set`` applied (``--set cluster.nic_gbps=400``); the
trace's ranks must fit its cluster.

Compute kernels keep their measured durations: a profiler measures a kernel beside the
collectives that ran with it, so the slowdown they caused is already in the number and is not
applied again (:class:`ReplayEngine`). On another GPU (``--set cluster.gpu=...``) each compute
duration is scaled by :func:`gpu_scale`. Collectives and transfers are simulated afresh on the
fabric: that is what a replay on another fabric changes.
"""

from __future__ import annotations

import gzip
import os
import struct
from pathlib import Path

from sim import catalog
from sim.api import RunResult, run_program
from sim.apps.replay.chakra_in import TraceError, chakra_program, read_chakra, trace_files
from sim.engine.core import Engine
from sim.frameworks import JobContext
from sim.program.ir import Op, RankClass
from sim.scenario import Scenario, ScenarioError, load_scenario

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
    """Refuse, before reading it, a trace file over ``limit`` bytes; a gzipped file by the
    uncompressed size its trailer records (RFC 1952 section 2.3.1: ISIZE, the input size
    modulo 2^32, the last four bytes little-endian; a file of over 4 GiB can read small, so
    a compressed size over ``limit`` / 1032, DEFLATE's best ratio, is refused too)."""
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
        if isize > limit or size > limit / 1032:
            raise TraceError(f"{path}: its gzip header says {isize / 2**30:.1f} GiB "
                             f"uncompressed, over the {limit / 2**30:g} GiB a trace may be")


def open_text(path: Path) -> str:
    """A trace file's text, gzipped or not (after :func:`check_size`)."""
    check_size(path)
    raw = path.read_bytes()
    try:
        return (gzip.decompress(raw) if path.suffix == ".gz" else raw).decode()
    except (OSError, UnicodeDecodeError, EOFError) as exc:
        raise TraceError(f"{path}: cannot be read as text ({exc})") from None


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


def _scenarios(ref: str, sets: list[str], origin: str) -> tuple[Scenario, Scenario]:
    """The trace's own scenario and the one it replays on (``sets`` applied)."""
    return load_scenario(ref, []), load_scenario(ref, sets)


def replay(trace: str | Path, sets: list[str] | None = None, scenario: str | None = None
           ) -> RunResult:
    """Rebuild the step of ``trace`` and run it on ``scenario``'s fabric (by default the one
    the trace's metadata names), with ``sets`` applied; the run's result and summary."""
    path = Path(trace)
    if not path.exists():
        raise TraceError(f"{path}: no such trace")
    files = trace_files(path) if path.is_dir() or path.suffix == ".et" else [path]
    for f in files:
        check_size(f)
    if not any(f.suffix == ".et" for f in files):
        raise TraceError(f"{path}: not a Chakra trace (.et files)")
    t = read_chakra(path)
    ref = scenario or t.scenario
    if not ref:
        raise TraceError(f"{path}: the trace names no scenario; give one with --scenario")
    try:
        own, target = _scenarios(ref, sets or [], str(path))
    except ScenarioError:
        raise
    if target.gpus < t.world:
        raise ScenarioError(f"{path}: the trace has {t.world} ranks but {ref}'s cluster "
                            f"{target.gpus} GPUs (set cluster.nodes)")
    scale = gpu_scale(own.cluster.gpu, target.cluster.gpu, own.training.precision)
    program = chakra_program(t, scale)
    if target.gpus > t.world:
        # idle GPUs of a larger cluster: each its own empty class
        for r in range(t.world, target.gpus):
            program.classes.append(RankClass(r, (r,), label=f"idle {r}"))
        program.n_ranks = target.gpus
    program.meta.update(trace=str(path), compute_scale=scale, trace_gpu=own.cluster.gpu)
    ctx = JobContext.from_scenario(target, str(path))
    program.tokens_per_step = ctx.tokens_per_step
    program.model_flops_per_step = ctx.model.model_flops_per_token(ctx.seq) * \
        ctx.tokens_per_step
    program.micro_batches = ctx.micro_batches
    return run_program(ctx, program, 1, engine_class=ReplayEngine)
