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
on the gathered 16-bit weights without autocast (:mod:`sim.workload.layer_ops` style ``bf16``).
Without
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
PyTorch takes to issue their kernels (as :mod:`sim.workload.layer_ops` prices it), FairScale's own
ops
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

Where each part lives: :mod:`sim.frameworks.fairscale.shape` (option checks, units, dtypes,
division factors, bucket size, priced blocks), :mod:`sim.frameworks.fairscale.units` (each
hook's ops and the bucket); this module assembles them into the step.

Not modelled: ``move_params_to_cpu``/``move_grads_to_cpu``, fp16 loss scaling
(``ShardedGradScaler``), ``bucket_cap_mb`` other than its default, the Python time of the
hooks beyond one eager op per kernel or collective they issue.
"""

from __future__ import annotations

from sim.frameworks.common.base import JobContext
from sim.frameworks.fairscale.shape import (  # noqa: F401 - re-exported
    BUCKET_CAP_MB,
    MIB,
    FairscaleShape,
    FsdpUnit,
    bucket_shard_capacity,
    fairscale_shape,
    gradient_divide_factors,
    shard_numel,
)
from sim.frameworks.fairscale.units import FairscaleStep
from sim.hardware.compute import EAGER_FWD_OP_CPU_S
from sim.program.ir import Op, Program, RankClass

HOOK_OP_CPU_S = EAGER_FWD_OP_CPU_S
"""Host time of one kernel or collective that FairScale's Python hooks issue: PyTorch eager's
per-op cost (:data:`sim.hardware.compute.EAGER_FWD_OP_CPU_S`). Read at build time."""


def build_fairscale(ctx: JobContext) -> Program:
    """FairScale FSDP's training step (see the module docstring): check and shape the job,
    add every micro-batch's gathers, compute and reductions in the order the host issues
    them, then the optimizer step on the local fp32 shard."""
    s = fairscale_shape(ctx, HOOK_OP_CPU_S)
    cls = RankClass(0, s.group, label="all ranks (identical FSDP shards)")
    cls.initial_memory = s.initial_memory()
    program = Program([cls], s.n, ctx.tokens_per_step, ctx.model_flops_per_step(),
                      ctx.model_flops_per_step() + ctx.layer_recompute_flops(s.costs),
                      micro_batches=ctx.micro_batches)
    program.meta.update(framework="fairscale", style=s.style.name)
    step = FairscaleStep(s, ctx.compute, program, cls)
    prev_compute: Op | None = None
    for mb in range(ctx.micro_batches):
        prev_compute = step.micro_batch(mb, ctx.recompute, prev_compute)
    step.add(Op(name="optimizer step (AdamW, local fp32 shard)", kind="compute",
                stream="compute", phase="optimizer", category="optimizer",
                duration=ctx.compute.adamw_time(
                    s.model.total_params / s.n,
                    ctx.scenario.training.optimizer == "adamw_fused", len(s.layers) + 1)))
    return program
