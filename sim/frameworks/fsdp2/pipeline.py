"""FSDP2 under pipeline parallelism (``torch/distributed/pipelining``).

Each stage's model chunks are separate FSDP roots. ``_PipelineStageBase.backward_maybe_with_
nosync`` runs every backward with ``set_requires_gradient_sync(False)`` and
``set_reshard_after_backward(False)``: gradients accumulate unsharded (cast to reduce_dtype on
the first micro-batch, ``FSDPParam.to_accumulated_grad_if_needed``, then added,
``accumulate_unsharded_grad_if_needed``) and parameters stay gathered; after the chunk's last
backward (``_add_reduce_grad`` / ``perform_reduce_grad`` -> ``_post_backward``)
``post_backward`` runs for every unit in module order: one reduce-scatter per unit per schedule
step (the train step runs one schedule per gradient-accumulation step with ``local_batch_size``).
Schedules come from :func:`sim.frameworks.megatron.build.schedule` (the same orders as torch's
``Schedule1F1B``, ``ScheduleGPipe`` and ``ScheduleInterleaved1F1B``, whose warm-up is
``(vp - 1) * pp + 2 * (pp - 1 - rank)``); Schedule1F1B batches each forward's send with the
next backward's receive and waits for both, and each backward's send with the next forward's
receive. The layers are split over the model chunks by :func:`.mesh.stage_layers`.
"""

from __future__ import annotations

from sim.frameworks.fsdp2.reduce import drop_reduce_scatter_state, reduce
from sim.frameworks.fsdp2.stage import Stage
from sim.frameworks.fsdp2.units import Job, Unit
from sim.frameworks.megatron.build import schedule as pipeline_order
from sim.program.ir import Op
from sim.workload.layer_ops import BF16


def step_order(job: Job, st: int) -> list[tuple[str, int, int]]:
    """(F|B, model chunk, micro-batch) in the order stage ``st`` runs them: under pipeline
    parallelism one schedule per gradient-accumulation step (:attr:`Job.round_mb`
    micro-batches each, numbered on through the step)."""
    if job.pp == 1:
        return [(k, 0, mb) for mb in range(job.n_mb) for k in ("F", "B")]
    n = job.round_mb
    one = pipeline_order("1f1b" if job.vp > 1 else job.opts.pipeline_schedule,
                         job.pp, st, n, job.vp)
    return [(k, v, r * n + mb) for r in range(job.n_mb // n) for k, v, mb in one]


def accumulate(stage: Stage, u: Unit, mb: int, first: bool) -> None:
    """No gradient sync (pipeline parallelism, or a train loop that syncs only the step's
    last micro-batch): the unsharded gradient is kept in reduce_dtype
    (FSDPParam.to_accumulated_grad_if_needed on the first backward,
    accumulate_unsharded_grad_if_needed after)."""
    job, cm = stage.job, stage.job.ctx.compute
    if first:
        if job.rbytes != BF16:
            stage.add(Op(name=f"grad to reduce dtype {u.name} mb{mb}", kind="compute",
                         stream="compute", phase="bwd", category="copy", micro_batch=mb,
                         duration=cm.membound_time(u.grad_bytes + job.rbytes * u.numel),
                         alloc=(("gradients", job.rbytes * u.numel),),
                         free=(("gradients", u.grad_bytes),)))
            stage.accumulated[u.name] = job.rbytes * u.numel
        else:
            stage.accumulated[u.name] = u.grad_bytes
        return
    held = stage.accumulated[u.name]
    stage.add(Op(name=f"accumulate grad {u.name} mb{mb}", kind="compute", stream="compute",
                 phase="bwd", category="copy", micro_batch=mb,
                 duration=cm.membound_time(u.grad_bytes + 2 * held),
                 free=(("gradients", u.grad_bytes),)))


def send(stage: Stage, kind: str, v: int, mb: int, after: Op) -> None:
    """The activation (F) or input gradient (B) of model chunk ``v`` sent to the next (previous)
    chunk's stage; none past either end."""
    job = stage.job
    nxt = v + 1 if kind == "F" else v - 1
    if not 0 <= nxt < job.n_virtual:
        return
    op = stage.add(Op(
        name=f"send {'act' if kind == 'F' else 'grad'} v{v}->v{nxt} mb{mb}", kind="send",
        stream=f"pp-{'fwd' if kind == 'F' else 'bwd'}", phase="comm", deps=[after],
        pairs=job.mesh.stage_pairs(stage.st, nxt % job.pp), nbytes=job.p2p_bytes,
        dtype=stage.act_dtype,
        key=f"pp/{kind}/{v}/{mb}", category="send_recv", micro_batch=mb))
    job.sends[(kind, v, mb)] = op
    stage.sent.append(op)
    if kind == "F":
        stage.fwd_sent.append(op)


def reduce_grad(stage: Stage, v: int, mb: int, wait: list[Op]) -> None:
    """Pipeline REDUCE_GRAD (stage ``_post_backward``): post_backward of every unit of the
    chunk in module order: reshard, reduce-scatter the accumulated gradient."""
    for unit in stage.job.chunk_units[v]:
        # Module order: a block before its nested experts unit (model.modules()).
        for u in (unit, unit.experts):
            if u is None:
                continue
            reduce(stage, u, stage.accumulated.pop(u.name), mb, wait, free_params=True,
                   first_grad=True)
            stage.gathered[u.name] = False
            wait = []
    drop_reduce_scatter_state(stage, mb)          # finalize_backward


def link_stages(job: Job) -> None:
    """A stage's forward (backward) waits for the activation (gradient) its neighbour sent."""
    for (kind, v, mb), first in job.first_compute.items():
        sender = job.sends.get((kind, v - 1 if kind == "F" else v + 1, mb))
        if sender is not None:
            first.deps = list(first.deps) + [sender]
