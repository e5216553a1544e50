"""The end of a DeepSpeed pipeline-engine step: ``ReduceTiedGrads``, ``ReduceGrads`` and
``OptimizerStep`` (``runtime/pipe/engine.py`` at commit 38327e07), for the three optimizers
the PipelineEngine runs (see :mod:`sim.frameworks.deepspeed.pipe`). Everything runs on the
compute stream after the stage's last backward: the pipeline engine turns DeepSpeed's
backward all-reduce off (``enable_backward_allreduce = False``) and reduces only here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sim.frameworks.megatron.build import MEGATRON_CPU_S_PER_OP
from sim.program.ir import Op, Phase, RankClass

if TYPE_CHECKING:
    from sim.frameworks.deepspeed.pipe import _Pipe

W16 = 2
FP32 = 4
ENGINE_ALLREDUCE_ELEMENTS = 500_000_000
"""engine.py MEMORY_OPT_ALLREDUCE_SIZE: bucket of buffered_allreduce_fallback."""
TORCH_CALL_CPU_S = MEGATRON_CPU_S_PER_OP
"""Host time of one Python-level torch call in this stack (sim.frameworks.megatron.build)."""


def reduce_tied(pipe: _Pipe, cls: RankClass, st: int) -> None:
    """``_exec_reduce_tied_grads``: the tied word embedding's gradient all-reduced between
    the first and last stage (one pair per tensor- and data-parallel index)."""
    su, m = pipe.su, pipe.mdl
    if su.p == 1 or st not in (0, su.p - 1) or not m.tied_embeddings:
        return
    pairs = pipe.stage_pairs(0, su.p - 1)
    # BF16_Optimizer reduces the fp32 accumulator (weight._hp_grad), the others the .grad.
    width = FP32 if su.bf16_optimizer else W16
    pipe.op(cls, Op(name="all_reduce tied embedding grads", kind="collective",
                    stream="compute", phase="comm", collective="all_reduce",
                    group=pairs[0], groups=pairs,
                    nbytes=float(width * pipe.vocab_local * m.hidden),
                    dtype="f32" if su.bf16_optimizer else pipe.w16,
                    key="deepspeed-pipe/tied", category="all_reduce", cpu_s=TORCH_CALL_CPU_S))


def reduce_grads(pipe: _Pipe, cls: RankClass, st: int) -> None:
    """``_exec_reduce_grads``: the stage's gradients all-reduced over its data-parallel
    replicas in the 16-bit communication dtype."""
    su = pipe.su
    n = pipe.stage_params(st)
    groups = pipe.dp_groups(st)
    if su.dp == 1:
        return
    ph: Phase = "bwd"
    if su.bf16_optimizer:
        # buffered_allreduce_fallback over BF16_Optimizer's one flat fp32 gradient
        # (allreduce_bucket): cast to the bf16 communication dtype, all-reduce, scale by 1/dp
        # afterwards (postscale_gradients, the default), copy back.
        pipe.membound(cls, "cast fp32 grads to bf16", (FP32 + W16) * n, ph,
                      alloc=(("buffers", W16 * n),))
        pipe.collective(cls, "all_reduce grads (dp)", "all_reduce", W16 * n, groups, f"dp/{st}")
        pipe.membound(cls, "scale 1/dp", 2 * W16 * n, ph)
        pipe.membound(cls, "copy back to fp32", (W16 + FP32) * n, ph,
                      free=(("buffers", W16 * n),))
        return
    if su.fp16_optimizer:
        # allreduce_gradients -> buffered_allreduce_fallback over the fp16 .grad tensors:
        # a bucket closes once past 5e8 elements (allreduce_no_retain); flatten copy,
        # all-reduce, scale, unflatten copy.
        left, k = n, 0
        while left > 0:
            el = min(ENGINE_ALLREDUCE_ELEMENTS, left)
            pipe.membound(cls, f"flatten grad bucket {k}", 2 * W16 * el, ph,
                          alloc=(("buffers", W16 * el),))
            pipe.collective(cls, f"all_reduce grad bucket {k} (dp)", "all_reduce", W16 * el,
                            groups, f"dp/{st}")
            pipe.membound(cls, f"scale 1/dp + unflatten bucket {k}", 4 * W16 * el, ph,
                          kernels=2, free=(("buffers", W16 * el),))
            left -= el
            k += 1
        return
    # DeepSpeedZeroOptimizer.reduce_gradients(pipeline_parallel=True): every gradient in
    # parameter order through the ipg buffer, one all-reduce per reduce_bucket_size elements
    # (pre-divided), each rank copying its slice into its partition.
    bucket = pipe.opts.reduce_bucket_size
    pipe.compute(cls, "allocate ipg buffer", 0.0, ph,
                 alloc=(("buffers", W16 * min(bucket, n)),), cpu_s=TORCH_CALL_CPU_S)
    left, k = n, 0
    while left > 0:
        el = min(bucket, left)
        pipe.membound(cls, f"copy grads into ipg bucket {k}", 2 * W16 * el, ph)
        pipe.membound(cls, f"pre-divide bucket {k}", 2 * W16 * el, ph)
        pipe.collective(cls, f"all_reduce grad bucket {k} (dp)", "all_reduce", W16 * el,
                        groups, f"dp/{st}")
        pipe.membound(cls, f"copy my slice into partition (bucket {k})",
                      2 * W16 * el / su.dp, ph, kernels=2)
        left -= el
        k += 1
    pipe.compute(cls, "release ipg buffer + .grad", 0.0, ph,
                 free=(("buffers", W16 * min(bucket, n)), ("gradients", W16 * n)),
                 alloc=(("gradients", W16 * n / su.dp),))


def optimizer_step(pipe: _Pipe, cls: RankClass, st: int) -> None:
    """``_exec_optimizer_step``: global gradient norm (clipping), Adam on the fp32 states,
    the 16-bit weights refreshed (and all-gathered where the states are sharded)."""
    su, cm = pipe.su, pipe.cm
    n = pipe.stage_params(st)
    shard = 1 if su.fp16_optimizer else su.dp
    part = n / shard
    ph: Phase = "optimizer"
    grads = (FP32 if su.bf16_optimizer else W16) * part
    norm = pipe.membound(cls, "grad norm + overflow check", grads + (2 * FP32 * part if
                         su.fp16_optimizer else 0.0), ph, kernels=4)
    # Global norm: summed over the replica's model-parallel group (every stage and
    # tensor-parallel rank), so no stage steps before the slowest has reduced; the host
    # reads it (BF16_Optimizer asserts it is positive, FP16_Optimizer checks overflow).
    mp = pipe.model_parallel_groups()
    red = pipe.collective(cls, "all_reduce grad norm (model parallel)", "all_reduce", FP32,
                          mp, "", key="deepspeed-pipe/norm", dtype="f32")
    if su.bf16_optimizer or su.fp16_optimizer:
        (red or norm).host_sync = True
    if not su.bf16_optimizer:
        pipe.membound(cls, "grads to fp32 + unscale/clip", (W16 + 3 * FP32) * part, ph,
                      kernels=3, free=(("gradients", W16 * part),))
    pipe.compute(cls, "FusedAdam", cm.adamw_time(part, True, pipe.tensors(st))
                 + cm.membound_time(2 * FP32 * part), ph, cpu_s=TORCH_CALL_CPU_S)
    pipe.membound(cls, "copy fp32 master into 16-bit weights", (FP32 + W16) * part, ph)
    if shard > 1:
        pipe.collective(cls, "all_gather updated weights (dp)", "all_gather", W16 * n,
                        pipe.dp_groups(st), f"dp/{st}")
    if su.bf16_optimizer:
        pipe.membound(cls, "clear_hp_grads (zero fp32 grads)", FP32 * n, ph)
