"""FSDP2's forward and backward of one model chunk for one micro-batch: each unit's unshard,
compute and reshard, and its gradient reduction (or accumulation under pipelining).

* Forward: each unit all-gathers its parameters on the all-gather stream, then the compute
  stream copies them out of the flat buffer and runs the unit. Prefetch is implicit: the CPU
  runs ahead, so unit u+1's all-gather is issued while unit u computes; it may start once the
  all-gather of unit u-1 has been copied out (the two-deep ``AllGatherState``,
  ``FSDPParamGroup.wait_for_unshard``). With ``reshard_after_forward`` a unit frees its
  gathered parameters after its forward.
* Backward: unit u's backward waits for its all-gather (issued again if resharded); when it
  starts, the all-gather of the unit before it is prefetched (``_backward_prefetch``, one unit
  ahead). After the unit's backward (``post_backward``) it reshards and its gradients are
  reduced (:mod:`.reduce`) every micro-batch, or, under pipeline parallelism, accumulated
  (:mod:`.pipeline`).
"""

from __future__ import annotations

from sim.frameworks.common.accounting import tied_grad_sum_s
from sim.frameworks.common.steps import micro_batch_ops
from sim.frameworks.fsdp2.pipeline import accumulate, send
from sim.frameworks.fsdp2.reduce import drop_reduce_scatter_state, reduce
from sim.frameworks.fsdp2.stage import Stage
from sim.frameworks.fsdp2.units import BlockOps, Unit
from sim.frameworks.fsdp2.unshard import copy_out, gather
from sim.program.ir import Op
from sim.workload.layer_ops import BF16


def block_ops(stage: Stage, mb: int) -> tuple[BlockOps, BlockOps]:
    """Forward and backward ops of each (block, layer) of micro-batch ``mb``."""
    if mb in stage.per_mb:
        return stage.per_mb[mb]
    job, m, cm = stage.job, stage.job.ctx.model, stage.job.ctx.compute
    ops_f: BlockOps
    ops_b: BlockOps
    if stage.titan is not None:
        tp = stage.titan

        def ops_f(k: tuple[str, int]) -> list[Op]:
            if k[0] == "moe":
                assert stage.moe is not None
                return stage.moe.forward(mb, k[1]).ops
            return tp.forward(k[0], k[1], mb)

        def ops_b(k: tuple[str, int]) -> list[Op]:
            ops = tp.backward(k[0], k[1], mb)
            # The block's bf16 weight gradients exist once its backward is done.
            done = next(x for x in reversed(ops) if x.kind == "compute")
            done.alloc = done.alloc + (("gradients", job.ugrad[k[0]]),)
            return ops
    else:
        extra = {"embed": tied_grad_sum_s(cm, m, BF16)}
        pops = micro_batch_ops(job.costs, m.layers, mb, job.ctx.recompute,
                               job.style.autocast, job.ugrad, extra, job.model_flops,
                               sac=job.sac, reentrant=job.opts.checkpoint_use_reentrant,
                               attn_key=job.attn_key)

        def ops_f(k: tuple[str, int]) -> list[Op]:
            if k[0] == "moe":
                assert stage.moe is not None
                return stage.moe.forward(mb, k[1]).ops
            return [pops.fwd_of[k]]

        def ops_b(k: tuple[str, int]) -> list[Op]:
            if k[0] == "moe":
                assert stage.moe is not None
                return stage.moe.backward(mb, k[1]).ops
            return [pops.bwd_of[k]]
    stage.per_mb[mb] = (ops_f, ops_b)
    return ops_f, ops_b


def forward(stage: Stage, v: int, mb: int) -> None:
    """Model chunk ``v``'s forward of micro-batch ``mb``, then its activation sent on."""
    job = stage.job
    if job.moe is not None and job.moe.split_experts:
        _forward_explicit(stage, v, mb)
        return
    fwd_ops, _ = block_ops(stage, mb)
    copied: list[Op] = []
    last: Op | None = None
    for u in job.chunk_units[v]:
        if not stage.gathered.get(u.name):
            # Implicit prefetch: this all-gather waits for the copy-out two gathers back
            # (the AllGatherState the previous unit's wait_for_unshard released).
            ag = gather(stage, u, copied[-2:-1], mb, "fwd")
            copied.append(copy_out(stage, u, ag, mb, "fwd"))
            stage.gathered[u.name] = True
        for k in u.keys:
            for op in fwd_ops(k):
                last = stage.add(op)
        assert last is not None
        _reshard_after_forward(stage, u, last)
    assert last is not None
    send(stage, "F", v, mb, last)


def _reshard_after_forward(stage: Stage, u: Unit, last: Op) -> None:
    """``reshard_after_forward``: the unit's gathered parameters are freed when its last
    forward op ends (FSDP2's post-forward reshard)."""
    if u.reshard_after_forward:
        last.free = last.free + (("parameters", stage.job.param_bytes(u)),)
        stage.gathered[u.name] = False


def _gather_unit(stage: Stage, u: Unit, deps: list[Op], mb: int, phase: str,
                 pending: dict[str, Op], by: Unit | None = None) -> None:
    """Issue the all-gathers of a unit and, when a transformer block ``by`` prefetches it, of
    its nested experts unit, those not gathered yet: torchtitan's ``apply_fsdp`` has each
    block prefetch ``[next_block, next_block.moe.experts]``, but the embedding (and, in
    backward, the output) only ``[block]``; an experts unit nobody prefetched is gathered
    when its module is entered (:func:`_enter_experts`)."""
    experts = by is not None and by.name.startswith("L")
    for w in (u, u.experts if experts else None):
        if w is not None and not stage.gathered.get(w.name) and w.name not in pending:
            pending[w.name] = gather(stage, w, deps, mb, phase)


def _unshard_and_prefetch(stage: Stage, units: list[Unit], i: int, mb: int, phase: str,
                          pending: dict[str, Op]) -> None:
    """Unit ``i``'s pre-forward (pre-backward) under explicit prefetching: its pending
    all-gather copied out, then the next unit's (``units`` in the pass's order) issued after
    that copy, with its experts when a block prefetches them (:func:`_gather_unit`)."""
    u = units[i]
    copied = None
    if u.name in pending:
        copied = copy_out(stage, u, pending.pop(u.name), mb, phase)
        stage.gathered[u.name] = True
    if i + 1 < len(units):
        _gather_unit(stage, units[i + 1], [copied] if copied else [], mb, phase, pending, by=u)


def _forward_explicit(stage: Stage, v: int, mb: int) -> None:
    """Forward with torchtitan's explicit prefetching under expert parallelism: once a unit
    is unsharded (its pre-forward), the next unit and its experts are all-gathered, ahead of
    the host's wait for the token counts in this unit's MoE layer. The experts' unit is
    waited for just before the routed experts run, and resharded after them."""
    job = stage.job
    assert stage.moe is not None
    fwd_ops, _ = block_ops(stage, mb)
    units = job.chunk_units[v]
    pending: dict[str, Op] = {}
    last: Op | None = None
    for i, u in enumerate(units):
        _gather_unit(stage, u, [], mb, "fwd", pending)
        _unshard_and_prefetch(stage, units, i, mb, "fwd", pending)
        for k in u.keys:
            if k[0] == "moe":
                last = _moe_forward(stage, u, k[1], mb, pending)
                continue
            for op in fwd_ops(k):
                last = stage.add(op)
        assert last is not None
        _reshard_after_forward(stage, u, last)
    assert last is not None
    send(stage, "F", v, mb, last)


def _enter_experts(stage: Stage, e: Unit, mb: int, phase: str, pending: dict[str, Op]) -> None:
    """The experts unit's pre-forward (pre-backward): all-gathered now unless prefetched or
    still gathered, then copied out."""
    if stage.gathered.get(e.name):
        return
    ag = pending.pop(e.name, None) or gather(stage, e, [], mb, phase)
    copy_out(stage, e, ag, mb, phase)
    stage.gathered[e.name] = True


def _moe_forward(stage: Stage, u: Unit, layer: int, mb: int, pending: dict[str, Op]) -> Op:
    """An MoE layer's forward; its experts' unit copied out as the experts module is
    entered (before the token counts are exchanged), resharded as it is left (after the
    combine all-to-all)."""
    assert stage.moe is not None
    step = stage.moe.forward(mb, layer)
    e = u.experts
    last = step.ops[0]
    for op in step.ops:
        if op is step.enter and e is not None:
            _enter_experts(stage, e, mb, "fwd", pending)
        if op is step.leave and e is not None and e.reshard_after_forward:
            op.free = op.free + (("parameters", stage.job.param_bytes(e)),)
            stage.gathered[e.name] = False
        last = stage.add(op)
    return last


def backward(stage: Stage, v: int, mb: int, first_of_step: bool) -> None:
    """Model chunk ``v``'s backward of micro-batch ``mb``, then its input gradient sent on."""
    job = stage.job
    _, bwd_ops = block_ops(stage, mb)
    units = list(reversed(job.chunk_units[v]))
    pending: dict[str, Op] = {}
    _gather_unit(stage, units[0], [], mb, "bwd", pending)
    last: Op | None = None
    for i, u in enumerate(units):
        # Backward prefetch: the previous unit's all-gather (with its experts' under expert
        # parallelism) is issued as this unit's backward begins.
        _unshard_and_prefetch(stage, units, i, mb, "bwd", pending)
        for k in reversed(u.keys):
            if k[0] == "moe":
                last = _moe_backward(stage, u, k[1], mb, pending, first_of_step)
                continue
            for op in bwd_ops(k):
                last = stage.add(op)
        assert last is not None
        if job.pp == 1:
            _post_backward(stage, u, mb, last)
        else:
            accumulate(stage, u, mb, first_of_step)
    assert last is not None
    if job.pp == 1:
        drop_reduce_scatter_state(stage, mb)      # finalize_backward
    send(stage, "B", v, mb, last)


def _moe_backward(stage: Stage, u: Unit, layer: int, mb: int, pending: dict[str, Op],
                  first_of_step: bool) -> Op:
    """An MoE layer's backward: under expert parallelism the experts' unit is copied out
    when the gradient reaches the experts module's output (its pre-backward, before the
    combine's reverse all-to-all) and, once the gradient of the module's input exists (after
    the dispatch's reverse all-to-all), resharded and its gradients reduce-scattered over
    ``efsdp`` (its post-backward)."""
    assert stage.moe is not None
    job = stage.job
    step = stage.moe.backward(mb, layer)
    e = u.experts
    last = step.ops[0]
    for op in step.ops:
        if op is step.enter and e is not None:
            _enter_experts(stage, e, mb, "bwd", pending)
        last = stage.add(op)
        if op is step.leave and e is not None:
            if job.pp > 1:
                # Pipelining: no sync and no reshard after backward; the gradient
                # accumulates until the chunk's REDUCE_GRAD (:func:`.pipeline.reduce_grad`).
                accumulate(stage, e, mb, first_of_step)
                continue
            _post_backward(stage, e, mb, op)
    return last


def _post_backward(stage: Stage, u: Unit, mb: int, last: Op) -> None:
    """Without pipelining, after unit ``u``'s backward ends at ``last``: reshard, then reduce
    every micro-batch (torchtitan's train loop), or, where the train loop turns gradient sync
    off for all but the step's last micro-batch (:attr:`Job.sync_last_micro_batch_only`,
    NeMo AutoModel's ``get_sync_ctx``: ``set_requires_gradient_sync(is_optim_step)``),
    accumulate the unsharded gradient in reduce_dtype and reduce it once, at the last."""
    job = stage.job
    last.free = last.free + (("parameters", job.param_bytes(u)),)
    stage.gathered[u.name] = False
    if job.sync_last_micro_batch_only and job.n_mb > 1:
        accumulate(stage, u, mb, first=mb == 0)
        if mb == job.n_mb - 1:
            reduce(stage, u, stage.accumulated.pop(u.name), mb, [], free_params=False,
                   first_grad=True)
        return
    reduce(stage, u, u.grad_bytes, mb, [], free_params=False, first_grad=mb == 0)
