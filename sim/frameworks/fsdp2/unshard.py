"""FSDP2's unshard of one unit (``FSDPParamGroup.unshard`` / ``wait_for_unshard``): copy-in,
all-gather over the FSDP mesh (dp_shard x cp; ``efsdp`` for routed experts), copy-out into
the unsharded parameters.

Parameters live sharded in fp32 (1/n per rank, n = the FSDP world size); gathered in
``param_dtype`` (the copy-in cast is folded into the copy-in), or float8 for the blocks with
``float8_all_gather`` (:meth:`.units.Job.param_bytes`).
"""

from __future__ import annotations

from sim.frameworks.fsdp2.offload import h2d_params
from sim.frameworks.fsdp2.stage import Stage
from sim.frameworks.fsdp2.units import AG, Unit
from sim.program.ir import Op, Phase
from sim.workload.layer_ops import FP32


def gather(stage: Stage, u: Unit, deps: list[Op], mb: int, phase: str) -> Op:
    """unshard(): the copy-in and all-gather of a unit (the copy-in alone when the FSDP
    world size is 1)."""
    job = stage.job
    if job.host is not None:
        # CPU offload: the fp32 shard is copied to the GPU on the all-gather copy-in
        # stream before it is cast and gathered.
        deps = deps + [h2d_params(stage, u, deps, mb, phase)]
    nbytes = job.param_bytes(u)
    if job.shard_size(u) == 1:
        return copy_in(stage, u, deps, mb, phase)
    deps = [copy_in(stage, u, deps, mb, phase)]
    groups = stage.groups_of(u)
    return stage.add(Op(
        name=f"{AG} {u.name} ({phase}) mb{mb}", kind="collective", stream="ag",
        phase="comm", deps=deps, collective="all_gather", group=groups[0],
        groups=groups, nbytes=nbytes, dtype=job.gather_dtype(u),
        key=stage.key(f"ag/{u.name}/{phase}/{mb}"),
        category="all_gather", micro_batch=mb, alloc=(("buffers", nbytes),)))


def copy_in(stage: Stage, u: Unit, deps: list[Op], mb: int, phase: str) -> Op:
    """foreach_all_gather's copy-in (``torch/distributed/fsdp/_fully_shard/
    _fsdp_collectives.py``), on the all-gather copy-in stream: ``_get_param_all_gather_
    inputs`` casts this rank's fp32 shards into one flat param_dtype buffer
    (``torch._foreach_copy_``) and ``all_gather_copy_in`` copies that into this rank's
    slice of the all-gather output, which NCCL then gathers in place. There is no
    shortcut for an FSDP world size of 1: both copies run on the whole unit and the
    one-rank all-gather moves nothing, so this op stands for the gather."""
    job, cm = stage.job, stage.job.ctx.compute
    n = job.shard_size(u)
    local = job.param_bytes(u) / n
    cast = cm.membound_time(FP32 * u.numel / n + local)
    alloc: tuple[tuple[str, float], ...] = (
        (("buffers", job.param_bytes(u)),) if n == 1 else ())
    return stage.add(Op(
        name=f"all-gather copy-in {u.name} ({phase}) mb{mb}", kind="compute",
        stream="ag-copy-in", phase="comm", deps=deps, category="copy", micro_batch=mb,
        duration=cast + cm.membound_time(2 * local), transient=local, alloc=alloc))


def copy_out(stage: Stage, u: Unit, ag: Op, mb: int, phase: str) -> Op:
    """wait_for_unshard(): split_with_sizes_copy out of the all-gather buffer into the
    unsharded parameters (the buffer is released once copied), after the all-gather or,
    with an FSDP world size of 1, after the copy-in that stands for it."""
    job, cm = stage.job, stage.job.ctx.compute
    nbytes = job.param_bytes(u)
    ph: Phase = "fwd" if phase == "fwd" else "bwd"
    return stage.add(Op(
        name=f"copy-out {u.name} ({phase}) mb{mb}", kind="compute", stream="compute",
        phase=ph, deps=[ag], duration=cm.membound_time(2 * nbytes), category="copy",
        alloc=(("parameters", nbytes),), free=(("buffers", nbytes),), micro_batch=mb))
