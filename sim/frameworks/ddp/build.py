"""PyTorch DistributedDataParallel, and plain single-GPU PyTorch training.

What the step does, as torch's Reducer runs it (``torch/nn/parallel/distributed.py``,
``torch/csrc/distributed/c10d/reducer.cpp``):

* Every rank holds fp32 parameters, gradients and AdamW states; the model runs under
  ``torch.autocast(bfloat16)`` (:mod:`sim.workload.layer_ops` style ``autocast``).
* Gradients are bucketed: 25 MiB buckets, the first one 1 MiB so that communication starts
  early (``bucket_cap_mb`` left at its default). After the first iteration the Reducer
  rebuilds the buckets in the order gradients became ready, which is what we lay out.
* When a gradient is ready, its autograd hook copies it into its bucket scaled by 1/world
  (one memory-bound kernel on the compute stream). A bucket's all-reduce starts when all its
  gradients are in and every earlier bucket has started: buckets go in order on NCCL's stream.
* At the end of backward the compute stream waits for every all-reduce and copies the buckets
  back into the gradients (unless ``gradient_as_bucket_view``), then AdamW steps and
  ``zero_grad(set_to_none=True)`` frees the gradients.
* Gradient accumulation runs the first micro-batches under ``no_sync``: gradients accumulate
  in ``.grad`` (an add per parameter) and only the last micro-batch communicates.
* One GPU is plain PyTorch training: no DDP wrapper, no buckets, no communication.
"""

from __future__ import annotations

from sim.frameworks.common.accounting import block_grad_params, block_model_flops, tied_grad_sum_s
from sim.frameworks.common.base import JobContext
from sim.frameworks.common.steps import micro_batch_ops
from sim.program.ir import Op, Program, RankClass
from sim.scenario import DdpOptions
from sim.workload.layer_ops import FP32, Style

MIB = 1024 * 1024
DEFAULT_BUCKET_MB = 25.0        # torch _DEFAULT_BUCKET_CAP_MB
DEFAULT_FIRST_BUCKET_MB = 1.0   # reducer.hpp kDefaultFirstBucketBytes


def bucket_assignment(sizes: list[int], first_cap: float, cap: float) -> list[list[int]]:
    """Group tensors (given in ready order, sizes in bytes) into buckets as the Reducer does:
    a bucket closes once its size reaches the limit, so one may overshoot it.

    Examples
    --------
    >>> bucket_assignment([4, 4, 4, 30, 1], first_cap=4, cap=8)
    [[0], [1, 2], [3], [4]]
    """
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i, s in enumerate(sizes):
        current.append(i)
        size += s
        limit = first_cap if not buckets else cap
        if size >= limit:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


def kernel_style(ctx: JobContext) -> Style:
    """Hugging Face's Llama under bf16 autocast; ``torch.compile(model)`` traces its mask
    building too, so SDPA gets the mask."""
    opts = ctx.scenario.framework
    assert isinstance(opts, DdpOptions)
    return Style("autocast", compile=opts.compile, sdpa_mask=opts.compile)


def build_ddp(ctx: JobContext) -> Program:
    s = ctx.scenario
    opts = s.framework
    assert isinstance(opts, DdpOptions)
    ctx.require_data_parallel_only("ddp")
    m = ctx.model
    n = ctx.n_ranks
    sync = ctx.dp > 1
    style = kernel_style(ctx)
    costs = ctx.block_costs(style, kv_cache=not ctx.recompute)
    cm = ctx.compute

    # Parameters whose gradient each block's backward produces first (fp32 under autocast).
    grad_params = block_grad_params(m, costs)
    tied_sum_s = tied_grad_sum_s(cm, m, FP32)
    total = m.total_params
    bucket_view = opts.gradient_as_bucket_view and sync

    cls = RankClass(0, tuple(range(n)), label="all ranks" if n > 1 else "single GPU")
    cls.initial_memory = {"parameters": FP32 * total, "optimizer": 2 * FP32 * total}
    if sync:
        # Bucket buffers: a second copy of the gradients, or the gradients themselves.
        cls.initial_memory["gradients" if bucket_view else "buffers"] = FP32 * total
    program = Program([cls], n, ctx.tokens_per_step, ctx.model_flops_per_step(),
                      ctx.model_flops_per_step() + ctx.layer_recompute_flops(costs),
                      micro_batches=ctx.micro_batches)
    program.meta.update(framework="ddp", style=style.name)

    model_flops = block_model_flops(m, costs, ctx.micro_batch, ctx.seq)

    last_bwd: Op | None = None
    for mb in range(ctx.micro_batches):
        first, last = mb == 0, mb == ctx.micro_batches - 1
        communicate = sync and last
        grad_alloc = {} if (bucket_view or not first) else {
            b: FP32 * v for b, v in grad_params.items()}
        extra = {}
        for b, params in grad_params.items():
            t = 0.0
            if not first:
                t += cm.membound_time(3 * FP32 * params)   # AccumulateGrad: grad += new
            if communicate:
                t += cm.membound_time(2 * FP32 * params)   # copy into bucket, scaled 1/world
            if b == "embed":
                t += tied_sum_s                            # tied weight: embed + head grads
            extra[b] = t
        ops = micro_batch_ops(costs, m.layers, mb, ctx.recompute, style.autocast, grad_alloc,
                              extra, model_flops, reentrant=opts.checkpoint_use_reentrant)
        if not first:
            for op in ops.backward:
                block = op.name.split()[1]
                op.transient += FP32 * grad_params[block]  # the new gradient before the add
        for op in ops.forward + ops.backward:
            program.add(cls, op)
        last_bwd = ops.backward[-1]

        if communicate:
            ready = []  # (tensor bytes, op after which it is ready), in ready order
            for _name, numel, block, layer in reversed(m.parameter_tensors()):
                ready.append((FP32 * numel, ops.bwd_of[(block, layer)]))
            ready.sort(key=lambda x: x[1].index)   # rebuilt buckets follow readiness
            first_cap = (DEFAULT_FIRST_BUCKET_MB if opts.bucket_mb is None
                         else opts.bucket_mb) * MIB
            cap = (opts.bucket_mb or DEFAULT_BUCKET_MB) * MIB
            buckets = bucket_assignment([b for b, _ in ready], first_cap, cap)
            ars = []
            for i, members in enumerate(buckets):
                nbytes = sum(ready[j][0] for j in members)
                dep = max((ready[j][1] for j in members), key=lambda o: o.index)
                ars.append(program.add(cls, Op(
                    name=f"all-reduce bucket {i}", kind="collective", stream="comm",
                    phase="comm", deps=[dep], collective="all_reduce", group=cls.members,
                    nbytes=nbytes, dtype="f32", key=f"ddp/ar/{i}", category="all_reduce",
                    micro_batch=mb)))
            copy_back = 0.0 if bucket_view else cm.membound_time(2 * FP32 * total)
            last_bwd = program.add(cls, Op(
                name="finalize buckets", kind="compute", stream="compute", phase="bwd",
                duration=copy_back, deps=ars, category="backward", micro_batch=mb))

    tensors = len(m.parameter_tensors())
    fused = s.training.optimizer == "adamw_fused"
    opt = Op(name="optimizer step (AdamW)", kind="compute", stream="compute",
             phase="optimizer", duration=cm.adamw_time(total, fused, tensors),
             category="optimizer",
             free=(() if bucket_view else (("gradients", FP32 * total),)))
    opt.deps = [last_bwd] if last_bwd is not None else []
    program.add(cls, opt)
    return program
