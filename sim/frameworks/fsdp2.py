"""PyTorch FSDP2 (``fully_shard``) as torchtitan applies it to a Llama model.

Units (torchtitan ``apply_fsdp``): the token embedding, each transformer block, and the final
norm with the output projection (not resharded after forward: backward needs it at once);
the root wraps them and owns no parameters of its own here.

What each step does (``torch/distributed/fsdp/_fully_shard/``):

* Parameters live sharded in fp32 (1/n per rank) with fp32 gradients and AdamW states of the
  shard. Mixed precision: gathered parameters in bf16 (``param_dtype``), gradients reduced in
  fp32 (``reduce_dtype``) by default; compute in bf16 (:mod:`sim.layer_ops` style ``bf16``).
* Forward: each unit all-gathers its parameters on the all-gather stream (the copy-in cast to
  bf16 is folded into it), then the compute stream copies them out of the flat buffer and runs
  the unit. Prefetch is implicit: the CPU runs ahead, so unit u+1's all-gather is issued while
  unit u computes; it may start once the all-gather of unit u-1 has been copied out (the
  two-deep all-gather state). With ``reshard_after_forward`` a unit frees its gathered
  parameters after its forward.
* Backward: unit u's backward waits for its all-gather (issued again if resharded); when it
  starts, the all-gather of the unit before it is prefetched (one unit ahead). After the
  unit's backward its gradients are copied into a reduce_dtype buffer on the compute stream
  and reduce-scattered on the reduce-scatter stream; that copy-in waits until the previous
  reduce-scatter has finished (one input buffer). The optimizer waits for every
  reduce-scatter, then AdamW steps the local shard.
"""

from __future__ import annotations

from sim.frameworks.base import JobContext, register
from sim.frameworks.steps import micro_batch_ops
from sim.layer_ops import BF16, FP32, Style
from sim.program import Op, Program, RankClass
from sim.scenario import Fsdp2Options

AG, RS = "all-gather", "reduce-scatter"


@register("fsdp2")
def build_fsdp2(ctx: JobContext) -> Program:
    s = ctx.scenario
    opts = s.framework
    assert isinstance(opts, Fsdp2Options)
    ctx.require_data_parallel_only("fsdp2")
    m = ctx.model
    n = ctx.n_ranks
    cm = ctx.compute
    style = Style("bf16", compile=opts.compile)
    costs = ctx.block_costs(style, kv_cache=False)
    pbytes = BF16 if opts.param_dtype == "bf16" else FP32
    rbytes = BF16 if opts.reduce_dtype == "bf16" else FP32
    vh = m.vocab * m.hidden
    tied = m.tied_embeddings
    group = tuple(range(n))

    # Units in forward order: (name, numel, blocks it covers as (block, layer)).
    units: list[tuple[str, int, list[tuple[str, int]]]] = [
        ("embed", m.embedding_params, [("embed", -1)])]
    for layer in range(m.layers):
        units.append((f"L{layer}", m.layer_params, [("attn", layer), ("mlp", layer)]))
    units.append(("head", m.norm_params + m.lm_head_params, [("head", -1)]))
    total = m.total_params

    cls = RankClass(0, group, label="all ranks (identical FSDP shards)")
    cls.initial_memory = {"parameters": FP32 * total / n, "optimizer": 2 * FP32 * total / n,
                          "gradients": FP32 * total / n}
    program = Program([cls], n, ctx.tokens_per_step, ctx.model_flops_per_step(),
                      ctx.model_flops_per_step() + ctx.layer_recompute_flops(costs))
    program.meta.update(framework="fsdp2", micro_batches=ctx.micro_batches, style=style.name)

    tokens_mb = ctx.micro_batch * ctx.seq
    per_token = {"embed": 0.0,
                 "attn": 6.0 * costs["attn"].params + 6.0 * ctx.seq * m.q_dim,
                 "mlp": 6.0 * costs["mlp"].params, "head": 6.0 * vh}
    model_flops = {b: (v * tokens_mb / 3, 2 * v * tokens_mb / 3) for b, v in per_token.items()}

    def gather(name: str, numel: int, deps: list[Op], mb: int, phase: str) -> Op:
        return program.add(cls, Op(
            name=f"{AG} {name} ({phase}) mb{mb}", kind="collective", stream="ag", phase="comm",
            deps=deps, collective="all_gather", group=group, nbytes=pbytes * numel,
            key=f"fsdp2/ag/{name}/{phase}/{mb}", category="all_gather", micro_batch=mb,
            alloc=(("buffers", pbytes * numel),)))

    def copy_out(name: str, numel: int, ag: Op, mb: int, phase: str) -> Op:
        # split_with_sizes_copy out of the all-gather buffer into the unsharded parameters;
        # the flat buffer is released once copied (backward) or at the next unit (forward).
        return program.add(cls, Op(
            name=f"copy-out {name} ({phase}) mb{mb}", kind="compute", stream="compute",
            phase="fwd" if phase == "fwd" else "bwd", deps=[ag],
            duration=cm.membound_time(2 * pbytes * numel), category="copy",
            alloc=(("parameters", pbytes * numel),), free=(("buffers", pbytes * numel),),
            micro_batch=mb))

    last_rs: Op | None = None
    for mb in range(ctx.micro_batches):
        # Unsharded bf16 gradients, produced by each block's backward, freed by the copy-in.
        unsharded_grad = {
            "embed": BF16 * (m.embedding_params - (vh if tied else 0)),
            "attn": BF16 * costs["attn"].params, "mlp": BF16 * costs["mlp"].params,
            "head": BF16 * (costs["head"].params + (vh if tied else 0))}
        extra = {"embed": cm.membound_time(3 * BF16 * vh) if tied else 0.0}
        ops = micro_batch_ops(costs, m.layers, mb, ctx.recompute, style.autocast,
                              unsharded_grad, extra, model_flops)
        # ---------------- forward: gather, copy out, compute; reshard after
        outs: list[Op] = []
        for u, (name, numel, blocks) in enumerate(units):
            ag = gather(name, numel, [outs[u - 2]] if u >= 2 else [], mb, "fwd")
            outs.append(copy_out(name, numel, ag, mb, "fwd"))
            for key in blocks:
                program.add(cls, ops.fwd_of[key])
            reshard = opts.reshard_after_forward and name != "head"
            last_op = ops.fwd_of[blocks[-1]]
            if reshard:
                last_op.free = last_op.free + (("parameters", pbytes * numel),)
        # ---------------- backward: reverse units; prefetch one unit ahead
        bw_units = list(reversed(units))

        def resharded(unit_name: str) -> bool:
            return opts.reshard_after_forward and unit_name != "head"

        next_ag: Op | None = (gather(bw_units[0][0], bw_units[0][1], [], mb, "bwd")
                   if resharded(bw_units[0][0]) else None)
        for i, (name, numel, blocks) in enumerate(bw_units):
            bwd_ag = next_ag
            first_op = copy_out(name, numel, bwd_ag, mb, "bwd") if bwd_ag is not None else None
            next_ag = None
            if i + 1 < len(bw_units) and resharded(bw_units[i + 1][0]):
                # Backward prefetch: the previous unit's all-gather is issued as this unit's
                # backward begins.
                prev_name, prev_numel, _ = bw_units[i + 1]
                next_ag = gather(prev_name, prev_numel, [first_op] if first_op else [], mb,
                                 "bwd")
            for key in reversed(blocks):
                program.add(cls, ops.bwd_of[key])
            last = ops.bwd_of[blocks[0]]
            # Reshard after backward; gradients into the reduce-scatter input buffer (cast to
            # reduce_dtype), waiting for the previous reduce-scatter to free that buffer.
            ugrad = sum(unsharded_grad[b] for b, _ in blocks)
            last.free = last.free + (("parameters", pbytes * numel),)
            copy_in = program.add(cls, Op(
                name=f"copy-in grads {name} mb{mb}", kind="compute", stream="compute",
                phase="bwd", deps=[last_rs] if last_rs is not None else [],
                duration=cm.membound_time(ugrad + rbytes * numel), category="copy",
                alloc=(("buffers", rbytes * numel),), free=(("gradients", ugrad),),
                micro_batch=mb))
            last_rs = program.add(cls, Op(
                name=f"{RS} {name} mb{mb}", kind="collective", stream="rs", phase="comm",
                deps=[copy_in], collective="reduce_scatter", group=group,
                nbytes=rbytes * numel, key=f"fsdp2/rs/{name}/{mb}", category="reduce_scatter",
                free=(("buffers", rbytes * numel),), micro_batch=mb))
    fused = s.training.optimizer == "adamw_fused"
    tensors = len(m.parameter_tensors())
    program.add(cls, Op(
        name="optimizer step (AdamW, local shard)", kind="compute", stream="compute",
        phase="optimizer", deps=[last_rs] if last_rs else [],
        duration=cm.adamw_time(total / n, fused, tensors), category="optimizer"))
    return program
