"""One pipeline stage's whole step (the whole job without pipeline parallelism): its forward
and backward passes in schedule order, the pipeline's gradient reduction after each chunk's
last backward, and the optimizer.

The optimizer waits for every reduce, then AdamW steps the local shard (on the CPU with
offload, :mod:`.offload`). Gradient accumulation (torchtitan's train loop) reduce-scatters
every micro-batch without pipelining, and after every schedule step with it
(``local_batch_size``).
"""

from __future__ import annotations

from sim.frameworks.fsdp2.offload import cpu_optimizer_step
from sim.frameworks.fsdp2.passes import backward, forward
from sim.frameworks.fsdp2.pipeline import reduce_grad, step_order
from sim.frameworks.fsdp2.stage import Stage
from sim.program.ir import Op


def build_stage(stage: Stage) -> None:
    """Issue every op of the stage's step into its rank class."""
    job = stage.job
    pp, st = job.pp, stage.st
    sched = job.schedule
    backwards: dict[int, int] = {}
    n = job.round_mb        # micro-batches of one schedule (gradient-accumulation) step
    for kind, chunk, mb in step_order(job, st):
        v = chunk * pp + st
        start = len(stage.program.ops)
        waits: list[Op] = []
        if sched == "1f1b" and stage.sent:
            # Schedule1F1B batches the previous unit's send with this unit's receive and
            # waits for both before computing.
            waits.append(stage.sent[-1])
        if sched == "gpipe" and kind == "B" and backwards.get(v, 0) % n == 0:
            waits += stage.fwd_sent        # all forward sends are waited for first
        if kind == "F":
            forward(stage, v, mb)
        else:
            backward(stage, v, mb, first_of_step=backwards.get(v, 0) % n == 0)
            backwards[v] = backwards.get(v, 0) + 1
            if pp > 1 and backwards[v] % n == 0:
                # Single-stage schedules reduce once they have waited for their backward
                # sends (Schedule1F1B the last, ScheduleGPipe all); the interleaved
                # runtime right after the chunk's last backward (_add_reduce_grad).
                bwd_sent = [o for o in stage.sent if o not in stage.fwd_sent]
                reduce_grad(stage, v, mb, bwd_sent[-1:] if sched == "1f1b"
                            else bwd_sent if sched == "gpipe" else [])
        first = next((o for o in stage.program.ops[start:] if o.stream == "compute"), None)
        if first is not None:
            job.first_compute[(kind, v, mb)] = first
            if waits:
                first.deps = list(first.deps) + waits
    optimizer(stage)


def optimizer(stage: Stage) -> None:
    """AdamW on the local shard once every reduce (and HSDP all-reduce) is done."""
    job = stage.job
    m = job.ctx.model
    local = job.local_params(stage.st)
    last = [o for o in (stage.last_rs, *stage.last_ar.values()) if o is not None]
    if job.host is not None:
        cpu_optimizer_step(stage, last, local)
        return
    balance = expert_bias_all_reduce(stage)
    if balance is not None:
        last = last + [balance]
    fused = job.ctx.scenario.training.optimizer == "adamw_fused"
    # torch.optim.adamw._multi_tensor_adamw (foreach; torchtitan 9dec370's default,
    # foreach = not fused) allocates exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs):
    # one fp32 tensor per parameter shard, all at once; the fused kernel allocates none.
    elem = job.state_bytes
    stage.add(Op(name="optimizer step (AdamW, local shard)", kind="compute",
                 stream="compute", phase="optimizer", deps=last,
                 duration=job.ctx.compute.adamw_time(local, fused, len(m.parameter_tensors()),
                                                     elem),
                 transient=0.0 if fused else elem * local, category="optimizer"))


def expert_bias_all_reduce(stage: Stage) -> Op | None:
    """torchtitan's load balancing of MoE layers (``build_optimizers_with_moe_load_balancing``,
    an optimizer step pre-hook): the stage's per-layer expert token counts (fp32, one row of
    ``experts`` per MoE layer) all-reduced over the loss mesh before the expert biases are
    updated; None for a dense model or a loss mesh of one rank."""
    job = stage.job
    moe = job.moe
    if moe is None or moe.loss_ranks == 1:
        return None
    layers = sum(1 for v in range(stage.st, job.n_virtual, job.pp)
                 for u in job.chunk_units[v] if any(k[0] == "moe" for k in u.keys))
    if not layers:
        return None
    groups = job.mesh.loss_groups(stage.st)
    return stage.add(Op(
        name="all-reduce expert token counts (load balancing)", kind="collective",
        stream="compute", phase="comm", collective="all_reduce", group=groups[0],
        groups=groups, nbytes=layers * moe.balance_bytes, dtype="f32",
        key=stage.key("balance"), category="all_reduce"))
