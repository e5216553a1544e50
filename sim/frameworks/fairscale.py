"""FairScale's FullyShardedDataParallel, wrapped per transformer block.

Source: ``fairscale/nn/data_parallel/fully_sharded_data_parallel.py`` (commit 146f1602; the
project was archived in 2023) and ``fairscale/internal/reduce_scatter_bucketer.py``.

Wrapping (``auto_wrap`` with a transformer-block policy): one FSDP unit per transformer
block, plus the root FSDP instance, which keeps what no child owns: the token embedding, the
final norm and the LM head (one tensor with the embedding when tied). ``flatten_parameters``
(default ``True``): every unit owns one flat parameter. ``disable_reshard_on_root`` (default
``True``): ``_lazy_init`` turns ``reshard_after_forward`` off on the root, so the root's
parameters stay gathered from its forward to the end of its backward.

Sharding and precision (``_shard_parameters_``, ``_get_shard``, ``_init_param_attributes``):
each rank keeps ``ceil(numel / world)`` elements of every flat parameter as an fp32 shard (the
optimizer's master weights), with an fp32 gradient shard and AdamW's two fp32 moments: 16
bytes per parameter / world. With ``mixed_precision`` the gathered parameters, the compute and
the gradients are 16-bit (``compute_dtype``: fp16 by default, bf16 when asked); the module runs
on the gathered 16-bit weights without autocast (:mod:`sim.layer_ops` style ``bf16``). Without
``mixed_precision`` the gathered parameters are the fp32 weights and the 16-bit matrix math
comes from ``torch.autocast`` (style ``autocast``).

What waits for what, as the source issues it (streams from ``_setup_streams``: ``fp32_to_fp16``,
``all_gather``, ``post_backward``, shared by every unit; the default stream is ``compute``):

* ``_rebuild_full_params`` (every unit's forward; with ``reshard_after_forward`` again from
  ``_pre_backward_hook``): under ``torch.cuda.stream(all_gather)`` it calls
  ``_cast_fp32_param_shards_to_fp16``, which copies the fp32 shard into a 16-bit shard on the
  ``fp32_to_fp16`` stream and makes the ``all_gather`` stream wait for it; then
  ``dist._all_gather_base`` on the ``all_gather`` stream, the 16-bit shard freed after it; then
  ``current_stream().wait_stream(all_gather)``: the unit's compute waits for its gather.
* Neither side stream waits for the compute stream there. The only such wait is the root's
  ``_wait_for_previous_optim_step`` (from ``_lazy_init`` at every root forward): the
  ``fp32_to_fp16`` stream (the ``all_gather`` stream without mixed precision) waits for the
  compute stream, so a micro-batch's first gather starts only once everything queued before it
  on the compute stream (the previous backward's wait for its reduce-scatters, the optimizer
  step) has run. There is no explicit prefetch: a unit's gather is issued when the host reaches
  that unit, so it overlaps earlier compute only as far as the host runs ahead of the GPU
  (what PyTorch's FSDP notes call implicit prefetching), with nothing to limit how far: all
  units' gathered parameters can be alive at once. FairScale's attempts at explicit prefetch
  and at a limit (facebookresearch/fairscale PRs #865 and #972, "fix for high gpu reserved
  memory") were never merged; PyTorch's FSDP added its rate limiter, ``limit_all_gathers``,
  for this (pytorch/pytorch PR #83917). Ops here carry the host's issue time (``cpu_s``), so
  run-ahead is what the host allows.
* ``_post_backward_hook`` (when a unit's flat gradient is complete): frees the gathered
  parameters (``_free_full_params``, ``record_stream`` on the compute stream); then the
  ``post_backward`` stream waits for the compute stream, and on it: the fp32 cast of the
  gradient (``fp32_reduce_scatter``), the pre-division (``gradient_predivide_factor``), and
  ``ReduceScatterBucketer.reduce_scatter_async`` on the separate reduce-scatter process group;
  ``_post_reduction_hook`` then post-divides, casts the reduced shard to fp32 and adds it into
  the gradient shard.
* ``_wait_for_post_backward`` (queued on the root, after the whole backward): flushes the
  bucketer on the ``post_backward`` stream, then the compute stream waits for that stream;
  the bucket buffers are torn down. The optimizer step follows on the compute stream.

Ops are added in the order the host issues them (the engine's host clock follows program
order): in backward, a unit's post-backward hook (its ``AccumulateGrad``, which autograd runs
first) before the pre-backward hook of the unit below. Compute ops carry the CPU time eager
PyTorch takes to issue their kernels (as :mod:`sim.layer_ops` prices it), FairScale's own ops
one eager op per kernel or collective.

Reduce-scatter (``ReduceScatterBucketer``, 25 MiB / world elements per rank and bucket): a
flat gradient whose per-rank chunk is larger is ``torch.cat``-ed and reduce-scattered at once
(every transformer block of a billion-parameter model is); smaller ones are stacked into the
bucket, which is flushed when the next one does not fit and at the end of backward.

Memory: the fp32 shard, fp32 gradient shard and AdamW moments are held throughout (16 bytes
per parameter / world). A gather holds the unit's 16-bit shard until the all-gather ends and
the gathered flat parameter until the unit is resharded (after its forward, or after its
backward). Backward allocates each weight's 16-bit gradient; the flat parameter's split
backward (``FlatParameter.get_param_views``: split + view) concatenates them into the flat
gradient, which lives until its reduction is done; the reduction's temporaries (fp32 copy,
concatenated input, output shard, bucket buffers) are held as the source holds them.

Gradient accumulation: FairScale reduce-scatters every micro-batch unless the training loop
wraps the first ones in ``no_sync()`` (which keeps full unsharded gradients instead); the
default, modelled here, reduce-scatters each micro-batch and accumulates into the fp32 shard.
With one rank nothing is sharded: no collectives, the post-reduction hook runs on the
gradient itself.

Not modelled: ``move_params_to_cpu``/``move_grads_to_cpu``, fp16 loss scaling
(``ShardedGradScaler``), ``bucket_cap_mb`` other than its default, the Python time of the
hooks beyond one eager op per kernel or collective they issue.
"""

from __future__ import annotations

from dataclasses import dataclass

from sim.compute import EAGER_BWD_OP_CPU_S, EAGER_FWD_OP_CPU_S
from sim.frameworks.accounting import block_grad_params, block_model_flops, tied_grad_sum_s
from sim.frameworks.base import JobContext, register
from sim.frameworks.steps import micro_batch_ops
from sim.layer_ops import BF16, FP32, Style
from sim.program import Op, Phase, Program, RankClass
from sim.scenario import FairscaleOptions

MIB = 1024 * 1024
BUCKET_CAP_MB = 25
"""FullyShardedDataParallel.__init__ default ``bucket_cap_mb=25``, handed to the shared
``ReduceScatterBucketer`` (fairscale/internal/reduce_scatter_bucketer.py)."""
HOOK_OP_CPU_S = EAGER_FWD_OP_CPU_S
"""Host time of one kernel or collective that FairScale's Python hooks issue: PyTorch eager's
per-op cost (:data:`sim.compute.EAGER_FWD_OP_CPU_S`)."""


def gradient_divide_factors(world: int) -> tuple[float, float]:
    """(pre, post) gradient division factors of ``world`` ranks.

    ``FullyShardedDataParallel._get_gradient_predivide_factor``: the pre-factor doubles while
    it divides ``world`` and ``world / factor`` exceeds it; the post-factor is the rest, so
    their product is ``world`` (an average, split to avoid fp16 overflow and underflow).

    Examples
    --------
    >>> gradient_divide_factors(16), gradient_divide_factors(8), gradient_divide_factors(1)
    ((4.0, 4.0), (4.0, 2.0), (1.0, 1.0))
    """
    factor = 1
    while world % factor == 0 and world / factor > factor:
        factor *= 2
    return float(factor), world / factor


def shard_numel(numel: int, world: int) -> int:
    """Elements of one rank's shard: ``torch.chunk`` sizes, the last one padded
    (``_get_shard``, ``chunk_and_pad``)."""
    return -(-numel // world)


def bucket_shard_capacity(elem_bytes: int, world: int, cap_mb: float = BUCKET_CAP_MB) -> int:
    """Elements per rank a reduce-scatter bucket holds (``ReduceScatterBucketer.
    _get_shard_size``: ``cap_mb`` MiB of the dtype, divided by the world size); a gradient
    whose per-rank chunk is larger is reduce-scattered directly, without the bucket.

    Examples
    --------
    >>> bucket_shard_capacity(2, 8)   # 25 MiB of bf16 over 8 ranks
    1638400
    """
    return int(cap_mb * MIB / elem_bytes // world)


@dataclass
class _Unit:
    """One FSDP instance: its flat parameter and the compute blocks that use it."""

    name: str
    numel: int
    blocks: list[tuple[str, int]]
    resharded: bool
    """Gathered parameters freed after the forward (gathered again in backward)."""


@dataclass
class _Bucket:
    """The bucketer's one bucket for the reduce-scatter dtype: units waiting in it."""

    members: list[_Unit]
    offset: int = 0
    allocated: bool = False


@register("fairscale")
def build_fairscale(ctx: JobContext) -> Program:
    s = ctx.scenario
    opts = s.framework
    assert isinstance(opts, FairscaleOptions)
    ctx.require_data_parallel_only("fairscale")
    ctx.require(opts.mixed_precision or not opts.fp32_reduce_scatter,
                "framework.fp32_reduce_scatter",
                "needs framework.mixed_precision (FairScale raises ValueError otherwise)")
    m = ctx.model
    n = ctx.n_ranks
    cm = ctx.compute
    mixed = opts.mixed_precision
    style = Style("bf16") if mixed else Style("autocast")
    # The autocast style is Hugging Face's Llama, which builds a KV cache unless recomputed
    # (as for DDP); the 16-bit style is a plain module without one.
    costs = ctx.block_costs(style, kv_cache=not mixed and not ctx.recompute)
    pbytes = BF16 if mixed else FP32      # gathered parameters: compute_dtype
    gbytes = style.grad_bytes             # unsharded gradients, as autograd produces them
    rbytes = FP32 if (opts.fp32_reduce_scatter or not mixed) else BF16
    pre_div, post_div = gradient_divide_factors(n)
    bucket_capacity = bucket_shard_capacity(rbytes, n)
    group = tuple(range(n))

    root = _Unit("root", m.embedding_params + m.norm_params + m.lm_head_params,
                 [("embed", -1), ("head", -1)], resharded=False)
    layers = [_Unit(f"L{layer}", m.layer_params, [("attn", layer), ("mlp", layer)],
                    resharded=opts.reshard_after_forward) for layer in range(m.layers)]
    total = m.total_params

    cls = RankClass(0, group, label="all ranks (identical FSDP shards)")
    # fp32 shard (master weights), fp32 gradient shard, AdamW exp_avg and exp_avg_sq.
    cls.initial_memory = {"parameters": FP32 * total / n, "gradients": FP32 * total / n,
                          "optimizer": 2 * FP32 * total / n}
    program = Program([cls], n, ctx.tokens_per_step, ctx.model_flops_per_step(),
                      ctx.model_flops_per_step() + ctx.layer_recompute_flops(costs))
    program.meta.update(framework="fairscale", micro_batches=ctx.micro_batches,
                        style=style.name)

    model_flops = block_model_flops(m, costs, ctx.micro_batch, ctx.seq)

    def block_cpu(block: str, pass_: str) -> float:
        """Host time to issue a block's kernels (eager PyTorch, as layer_ops prices it)."""
        c = costs[block]
        per_op = EAGER_FWD_OP_CPU_S if pass_ == "fwd" else EAGER_BWD_OP_CPU_S
        kernels = c.fwd_kernels if pass_ == "fwd" else c.bwd_kernels
        t = kernels * per_op
        if block == "attn":
            t += cm.attention_cpu_s("fwd" if pass_ == "fwd" else "bwd") - per_op
        return t

    # Gradients each block's backward produces (per weight), and the flat gradient that the
    # flat parameter's split backward (FlatParameter.get_param_views: split + view) assembles
    # with a cat once the unit's last weight gradient exists; the pieces die after the cat.
    pieces = {b: gbytes * p for b, p in block_grad_params(m, costs).items()}
    flat_grad = {"embed": gbytes * root.numel, "attn": gbytes * m.layer_params}
    grad_alloc = {b: pieces[b] + flat_grad.get(b, 0.0) for b in pieces}
    extra = {"attn": cm.membound_time(2 * flat_grad["attn"]),
             "embed": cm.membound_time(2 * flat_grad["embed"])
             + tied_grad_sum_s(cm, m, gbytes)}   # tied: sum both uses
    pieces_freed = {"attn": pieces["attn"] + pieces["mlp"],
                    "embed": pieces["embed"] + pieces["head"]}

    def add(op: Op) -> Op:
        return program.add(cls, op)

    def held(unit: _Unit) -> float:
        """Bytes of a unit's gathered (padded) flat parameter; with one rank and no mixed
        precision the parameter is the fp32 shard itself and nothing is gathered."""
        if n == 1 and not mixed:
            return 0.0
        return float(pbytes * shard_numel(unit.numel, n) * n)

    def gather(unit: _Unit, mb: int, phase: Phase, wait: list[Op]) -> Op | None:
        """_rebuild_full_params: cast the fp32 shard (fp32_to_fp16 stream), then all-gather
        (all_gather stream, waiting for the cast). Returns the op the compute waits for."""
        chunk = shard_numel(unit.numel, n)
        full = pbytes * chunk * n
        tag = f"{unit.name} ({phase}) mb{mb}"
        cast: Op | None = None
        if mixed:
            cast = add(Op(
                name=f"cast fp32->16-bit shard {tag}", kind="compute", stream="fp32_to_fp16",
                phase=phase, deps=wait, duration=cm.membound_time((FP32 + pbytes) * chunk),
                category="copy", micro_batch=mb, cpu_s=HOOK_OP_CPU_S,
                alloc=(("buffers" if n > 1 else "parameters", pbytes * chunk),)))
        if n == 1:
            # Not sharded (world size 1): the 16-bit shard is the full parameter.
            return cast
        return add(Op(
            name=f"all-gather {tag}", kind="collective", stream="all_gather", phase="comm",
            deps=[cast] if cast is not None else wait, collective="all_gather", group=group,
            nbytes=full, key=f"fairscale/ag/{unit.name}/{phase}/{mb}", category="all_gather",
            micro_batch=mb, cpu_s=HOOK_OP_CPU_S, alloc=(("parameters", full),),
            free=(("buffers", pbytes * chunk),) if mixed else ()))

    def post_reduction(units: list[_Unit], mb: int, label: str, extra_free: float) -> Op:
        """_post_reduction_hook of each unit reduced together: post-divide, cast the reduced
        shard to fp32, add it into the fp32 gradient shard."""
        t = 0.0
        cast = 0.0
        kernels = 0
        for u in units:
            e = shard_numel(u.numel, n)
            if post_div > 1:
                t += cm.membound_time(2 * rbytes * e)
                kernels += 1
            if rbytes != FP32:
                t += cm.membound_time((rbytes + FP32) * e)
                cast += FP32 * e
                kernels += 1
            t += cm.membound_time(3 * FP32 * e)
            kernels += 1
        return add(Op(
            name=f"post-reduction {label} mb{mb}", kind="compute", stream="post_backward",
            phase="bwd", duration=t, category="copy", micro_batch=mb,
            cpu_s=HOOK_OP_CPU_S * kernels, transient=cast,
            free=(("buffers", extra_free),) if extra_free else ()))

    bucket = _Bucket(members=[])
    bucket_bytes = rbytes * bucket_capacity * (n + 1)   # data (world x shard) + output shard

    def flush(mb: int, wait: list[Op]) -> None:
        """Bucket.flush: one reduce-scatter of the filled part, then the callbacks, then
        the used part zeroed and a fresh output shard allocated."""
        if not bucket.members:
            return
        used = bucket.offset
        full = rbytes * used * n
        # data[:, :offset].contiguous() copies unless the bucket is exactly full.
        copy = used < bucket_capacity
        names = "+".join(u.name for u in bucket.members)
        prep = add(Op(
            name=f"bucket contiguous {names} mb{mb}", kind="compute", stream="post_backward",
            phase="bwd", deps=wait, duration=cm.membound_time(2 * full) if copy else 0.0,
            category="copy", micro_batch=mb, cpu_s=HOOK_OP_CPU_S if copy else 0.0,
            alloc=(("buffers", full),) if copy else ()))
        add(Op(
            name=f"reduce-scatter bucket {names} mb{mb}", kind="collective",
            stream="post_backward", phase="comm", deps=[prep], collective="reduce_scatter",
            group=group, nbytes=full, key=f"fairscale/rs/bucket/{names}/{mb}",
            category="reduce_scatter", micro_batch=mb, cpu_s=HOOK_OP_CPU_S,
            free=(("buffers", full),) if copy else ()))
        done = post_reduction(bucket.members, mb, f"bucket {names}", 0.0)
        done.duration += (cm.membound_time(rbytes * used * n)
                          + cm.membound_time(rbytes * bucket_capacity))
        done.cpu_s += 2 * HOOK_OP_CPU_S
        bucket.members = []
        bucket.offset = 0

    def post_backward(unit: _Unit, last_bwd: Op, mb: int) -> None:
        """_post_backward_hook: the post_backward stream waits for the compute stream, then
        reduces the unit's flat gradient (directly, or through the bucket)."""
        numel = unit.numel
        grad = gbytes * numel
        prep_t = 0.0
        prep_kernels = 0
        cast32 = 0.0
        if mixed and opts.fp32_reduce_scatter:
            prep_t += cm.membound_time((gbytes + FP32) * numel)     # grad.to(fp32)
            cast32 = FP32 * numel
            prep_kernels += 1
        if pre_div > 1:
            prep_t += cm.membound_time(2 * rbytes * numel)         # div_ in place
            prep_kernels += 1
        if n == 1:
            # Not sharded: _post_reduction_hook runs on the gradient itself.
            op = post_reduction([unit], mb, unit.name, 0.0)
            op.deps = [last_bwd]
            op.duration += prep_t
            op.cpu_s += prep_kernels * HOOK_OP_CPU_S
            op.transient += cast32
            op.free = (("gradients", grad),)
            return
        chunk = shard_numel(numel, n)
        padded = rbytes * chunk * n
        if chunk > bucket_capacity:
            # Too big for the bucket: torch.cat of the chunks, a zeroed output shard, and
            # _reduce_scatter_base right away (the bucket is not flushed).
            temps = cast32 + padded + rbytes * chunk
            prep = add(Op(
                name=f"prepare grads {unit.name} mb{mb}", kind="compute",
                stream="post_backward", phase="bwd", deps=[last_bwd],
                duration=prep_t + cm.membound_time(2 * padded)
                + cm.membound_time(rbytes * chunk),
                category="copy", micro_batch=mb, cpu_s=HOOK_OP_CPU_S * (prep_kernels + 2),
                alloc=(("buffers", temps),)))
            add(Op(
                name=f"reduce-scatter {unit.name} mb{mb}", kind="collective",
                stream="post_backward", phase="comm", deps=[prep],
                collective="reduce_scatter", group=group, nbytes=padded,
                key=f"fairscale/rs/{unit.name}/{mb}", category="reduce_scatter",
                micro_batch=mb, cpu_s=HOOK_OP_CPU_S))
            # The unsharded gradient (record_stream on post_backward) and the temporaries
            # die once the hook's work on the post_backward stream is done.
            done = post_reduction([unit], mb, unit.name, temps)
            done.free = done.free + (("gradients", grad),)
            return
        # Bucketed: cast and pre-divide, flush the bucket first if the chunk does not fit
        # in what is left, then torch.stack the chunks and copy them into the bucket.
        if prep_t:
            add(Op(name=f"prepare grads {unit.name} mb{mb}", kind="compute",
                   stream="post_backward", phase="bwd", deps=[last_bwd], duration=prep_t,
                   category="copy", micro_batch=mb, cpu_s=HOOK_OP_CPU_S * prep_kernels,
                   alloc=(("buffers", cast32),) if cast32 else ()))
        if chunk > bucket_capacity - bucket.offset:
            flush(mb, [last_bwd])
        alloc: tuple[tuple[str, float], ...] = ()
        if not bucket.allocated:
            alloc = (("buffers", bucket_bytes),)    # Bucket.setup on first use in backward
            bucket.allocated = True
        free: tuple[tuple[str, float], ...] = (("gradients", grad),)
        if cast32:
            free += (("buffers", cast32),)
        add(Op(
            name=f"copy grads into bucket {unit.name} mb{mb}", kind="compute",
            stream="post_backward", phase="bwd", deps=[last_bwd],
            duration=2 * cm.membound_time(2 * padded), category="copy", micro_batch=mb,
            cpu_s=HOOK_OP_CPU_S * 2, alloc=alloc, transient=padded, free=free))
        bucket.members.append(unit)
        bucket.offset += chunk

    prev_compute: Op | None = None
    for mb in range(ctx.micro_batches):
        ops = micro_batch_ops(costs, m.layers, mb, ctx.recompute, style.autocast, grad_alloc,
                              extra, model_flops)
        for (block, _layer), op in ops.fwd_of.items():
            op.cpu_s = block_cpu(block, "fwd")
        for (block, _layer), op in ops.bwd_of.items():
            op.cpu_s = block_cpu(block, "bwd")
            if op.phase == "recompute":
                op.cpu_s += block_cpu("attn", "fwd") + block_cpu("mlp", "fwd")
            if block in pieces_freed:
                op.free = op.free + (("gradients", pieces_freed[block]),)

        # ---------------- forward: the root gathers after the previous compute; each unit's
        # compute waits for its gather; resharded units free their parameters after it.
        root_ag = gather(root, mb, "fwd", [prev_compute] if prev_compute is not None else [])
        embed = ops.fwd_of[("embed", -1)]
        embed.deps = [root_ag] if root_ag is not None else []
        add(embed)
        for unit in layers:
            ag = gather(unit, mb, "fwd", [])
            first = ops.fwd_of[unit.blocks[0]]
            first.deps = [ag] if ag is not None else []
            for key in unit.blocks:
                add(ops.fwd_of[key])
            if unit.resharded:
                last = ops.fwd_of[unit.blocks[-1]]
                last.free = last.free + (("parameters", held(unit)),)
        add(ops.fwd_of[("head", -1)])

        # ---------------- backward: the root's parameters are still gathered; each layer's
        # pre-backward hook gathers again if resharded; its post-backward hook frees them
        # and reduce-scatters its gradient.
        add(ops.bwd_of[("head", -1)])
        for unit in reversed(layers):
            first = ops.bwd_of[unit.blocks[-1]]
            if unit.resharded:
                ag = gather(unit, mb, "bwd", [])
                first.deps = [ag] if ag is not None else []
            for key in reversed(unit.blocks):
                add(ops.bwd_of[key])
            last = ops.bwd_of[unit.blocks[0]]
            last.free = last.free + (("parameters", held(unit)),)
            post_backward(unit, last, mb)
        embed_bwd = add(ops.bwd_of[("embed", -1)])
        embed_bwd.free = embed_bwd.free + (("parameters", held(root)),)
        post_backward(root, embed_bwd, mb)

        # ---------------- _wait_for_post_backward: flush, compute waits, teardown.
        flush(mb, [])
        side = cls.streams.get("post_backward", [])
        teardown = (("buffers", bucket_bytes),) if bucket.allocated else ()
        bucket.allocated = False
        prev_compute = add(Op(
            name=f"wait for post-backward mb{mb}", kind="compute", stream="compute",
            phase="bwd", deps=[side[-1]] if side else [], category="backward",
            micro_batch=mb, free=teardown))

    add(Op(name="optimizer step (AdamW, local fp32 shard)", kind="compute", stream="compute",
           phase="optimizer", category="optimizer",
           duration=cm.adamw_time(total / n, s.training.optimizer == "adamw_fused",
                                  len(layers) + 1)))
    return program

