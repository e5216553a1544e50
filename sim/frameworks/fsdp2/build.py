"""The registered FSDP2 builder: the job's shapes, units and costs (:class:`.units.Job`), one
rank class per pipeline stage, each stage's step (:func:`.step.build_stage`), and the links
between stages.

Resharding after forward follows torchtitan's ``fsdp_reshard_after_forward`` policy
(``get_fsdp_reshard_after_forward_policy``): with ``reshard_after_forward`` left unset it is
``"default"``: the embedding and the blocks reshard without pipeline parallelism and do not
with it ("to avoid per-microbatch all-gathers"); set explicitly, it applies to them either way.
Norm + output are never resharded after forward (backward needs them right away); torchtitan's
``"always"``, which reshards them too, is not offered by the boolean.
"""

from __future__ import annotations

from dataclasses import replace

from sim.frameworks.common.accounting import block_grad_params, block_model_flops
from sim.frameworks.common.base import JobContext
from sim.frameworks.fsdp2.automodel import te_layer_costs
from sim.frameworks.fsdp2.checks import check
from sim.frameworks.fsdp2.cp import titan_repeats_kv
from sim.frameworks.fsdp2.mesh import Mesh, stage_layers
from sim.frameworks.fsdp2.moe import split_moe_ranks, titan_moe
from sim.frameworks.fsdp2.pipeline import link_stages
from sim.frameworks.fsdp2.stage import Stage
from sim.frameworks.fsdp2.step import build_stage
from sim.frameworks.fsdp2.tp import TitanBlocks, titan_blocks
from sim.frameworks.fsdp2.units import Job, chunk_units, reshard_blocks
from sim.hardware.host import HostSpec
from sim.program.ir import Program, RankClass
from sim.scenario import Fsdp2Options
from sim.workload.layer_ops import (
    BF16,
    FP32,
    BlockCost,
    Style,
    head_block,
    model_blocks,
    op_sac_costs,
    price_block,
)


def build_fsdp2(ctx: JobContext) -> Program:
    """The program of one training step of FSDP2 as torchtitan (or a Hugging Face model)
    runs it: see :mod:`sim.frameworks.fsdp2`."""
    s = ctx.scenario
    opts = s.framework
    assert isinstance(opts, Fsdp2Options)
    check(ctx, opts)
    job = _job(ctx, opts)
    classes = _rank_classes(job)
    program = Program(classes, ctx.n_ranks, ctx.tokens_per_step, ctx.model_flops_per_step(),
                      _hw_flops(job), micro_batches=job.n_mb, pipeline_stages=job.pp)
    program.meta.update(framework="fsdp2", style=job.style.name, schedule=job.schedule,
                        hsdp_replicas=job.mesh.replicate, fsdp_shards=job.n_shard)
    if job.moe is not None:
        program.meta.update(ep=job.moe.ep, efsdp_shards=job.mesh.efsdp)
    for st, cls in enumerate(classes):
        build_stage(Stage(job, program, cls, st))
    link_stages(job)
    if job.moe is not None:          # skewed routing: a class per expert load
        split_moe_ranks(program, job.moe, job.mesh.sparse)
    return program


# The first PyTorch release whose ``nn.RMSNorm`` / ``F.rms_norm`` runs one fused CUDA kernel
# (``_fused_rms_norm``, pytorch/pytorch PR 153666, opened 2025-05-15; assumed in 2.8, the
# release after it): before it the op is composite, eager kernel by kernel, as was
# torchtitan's own ``RMSNorm`` class of 2024-25 (``torchtitan/models/norms.py``: ``x.float()``,
# pow, mean, rsqrt, products, ``type_as``), which its published 2024 benchmarks ran.
FIRST_TORCH_WITH_FUSED_RMSNORM = (2, 8)


def torch_has_fused_rmsnorm(torch_version: str) -> bool:
    """Whether torchtitan's RMSNorm of a PyTorch release's time is one fused kernel.

    Examples
    --------
    >>> torch_has_fused_rmsnorm("2.6"), torch_has_fused_rmsnorm("2.8")
    (False, True)
    """
    major, minor = (int(x) for x in torch_version.split(".")[:2])
    return (major, minor) >= FIRST_TORCH_WITH_FUSED_RMSNORM


def _style(ctx: JobContext, opts: Fsdp2Options) -> Style:
    """Kernels: torchtitan's Llama (``bf16``) or Hugging Face's eager code (``hf_bf16``).
    training.precision fp8: torchtitan's float8 converter (torchao Float8Linear, dynamic
    scaling by ``float8_recipe``) on every linear but the output layer; parameters stay
    bf16."""
    fp8 = ctx.scenario.training.precision == "fp8"
    hf = opts.model_code == "huggingface"
    return Style("hf_bf16" if hf else "bf16", compile=opts.compile, float8=fp8,
                 float8_weights=fp8 and opts.float8_all_gather,
                 float8_recipe=opts.float8_recipe,
                 fused_rmsnorm=torch_has_fused_rmsnorm(ctx.scenario.training.torch_version),
                 fused_loss=opts.cross_entropy == "fused",
                 bf16_loss=opts.model_code == "automodel")


def kernel_style(ctx: JobContext) -> Style:
    """:func:`_style` of the scenario's options (the registry's ``kernel_style``)."""
    opts = ctx.scenario.framework
    assert isinstance(opts, Fsdp2Options)
    return _style(ctx, opts)


def _block_costs(ctx: JobContext, opts: Fsdp2Options, style: Style
                 ) -> tuple[dict[str, BlockCost], bool]:
    """The priced blocks of one micro-batch, and whether the head runs eagerly."""
    hf = opts.model_code == "huggingface"
    # HF's use_cache defaults on and LlamaModel builds a DynamicCache in training too;
    # GradientCheckpointingLayer drops it under checkpointing (transformers modeling_layers.py).
    kv_cache = hf and not ctx.recompute
    costs = ctx.block_costs(style, kv_cache=kv_cache)
    if opts.model_code == "automodel":
        # AutoModel's Transformer Engine layers (attention and MLP); embedding and head
        # as torchtitan's (:mod:`.automodel`).
        costs.update(te_layer_costs(ctx.model, ctx.compute, ctx.micro_batch, ctx.seq))
    # torchtitan's apply_compile compiles the transformer blocks; the loss is compiled apart
    # (loss.py) or, before that existed, not at all: then norm, output and cross-entropy run
    # eagerly (fp32 logits, log_softmax and their gradients materialised).
    eager_head = opts.compile and opts.compile_loss is False
    if eager_head:
        eager = replace(style, compile=False)
        costs["head"] = price_block(head_block(ctx.model, eager, ctx.micro_batch, ctx.seq),
                                    eager, ctx.compute)
    return costs, eager_head


def _unit_sizes(ctx: JobContext, costs: dict[str, BlockCost], tb: TitanBlocks | None
                ) -> tuple[dict[str, int], dict[str, float]]:
    """Parameters of each block on one tensor-parallel rank, and the unsharded bf16 gradients
    its backward produces."""
    m = ctx.model
    if tb is not None:
        numel = dict(tb.params)
        ugrad = {b: float(BF16 * n) for b, n in numel.items()}
    else:
        numel = {"embed": m.embedding_params, "attn": costs["attn"].params,
                 "mlp": costs["mlp"].params, "head": m.norm_params + m.lm_head_params}
        # Unsharded bf16 gradients, produced by each block's backward, freed by the copy-in
        # (a tied matrix gets its gradient from the output layer and the embedding).
        ugrad = {b: BF16 * p for b, p in block_grad_params(m, costs).items()}
    return numel, ugrad


def _job(ctx: JobContext, opts: Fsdp2Options) -> Job:
    """What every stage of the step shares: mesh, kernels, units, sizes."""
    s = ctx.scenario
    par = s.parallelism
    m = ctx.model
    t, pp, cp, vp = par.tp, par.pp, par.cp, par.vp
    dp = ctx.dp
    shard = opts.hsdp_shard_size or dp
    mesh = Mesh(pp, dp // shard, shard, cp, t, par.ep)
    style = _style(ctx, opts)
    n_virtual = pp * vp
    chunk_layers = stage_layers(m.layers, n_virtual, opts.pipeline_first_stage_less_layers,
                                opts.pipeline_last_stage_less_layers)
    costs, eager_head = _block_costs(ctx, opts, style)
    selective = s.training.activation_checkpointing == "selective"
    tb = titan_blocks(m, style, ctx.compute, ctx.micro_batch, ctx.seq, t, cp,
                      opts.cp_rotate_method, sac=selective, eager_head=eager_head,
                      repeat_kv=titan_repeats_kv(s.training.torch_version)
                      ) if t > 1 or cp > 1 else None
    numel, ugrad = _unit_sizes(ctx, costs, tb)
    moe = titan_moe(ctx, style, par.ep, mesh.efsdp, dp * cp,
                    [mesh.ep_groups(st) for st in range(pp)], t, cp,
                    opts.moe_score_before_experts)
    # Qwen3's q_norm / k_norm are SequenceParallel(sequence_dim=2) under tensor parallelism:
    # replicated head_dim weights whose gradients are all-reduced like the block norms'.
    qk = (m.head_dim, m.head_dim) if m.qk_norm and t > 1 else ()
    units = chunk_units(chunk_layers, numel, ugrad, reshard_blocks(opts, pp), t, moe, qk)
    tokens_mb = ctx.micro_batch * ctx.seq
    return Job(
        ctx=ctx, opts=opts, mesh=mesh, style=style, n_mb=ctx.micro_batches, moe=moe,
        n_shard=shard * cp, pbytes=BF16 if opts.param_dtype == "bf16" else FP32,
        rbytes=BF16 if opts.reduce_dtype == "bf16" else FP32, costs=costs, titan=tb,
        chunk_units=units, ugrad=ugrad,
        model_flops=block_model_flops(m, costs, ctx.micro_batch, ctx.seq),
        # Activations sent between stages: the last block's output, this rank's share.
        p2p_bytes=float(BF16 * (tb.local_tokens if tb is not None else tokens_mb) * m.hidden),
        stage_params=[sum(u.numel for v in range(st, n_virtual, pp) for u in units[v])
                      for st in range(pp)],
        host=HostSpec.from_scenario(s) if opts.cpu_offload else None,
        sac=(op_sac_costs(model_blocks(m, style, ctx.micro_batch, ctx.seq, False)[1:3],
                          style, ctx.compute)
             if selective and tb is None else None))


def _rank_classes(job: Job) -> list[RankClass]:
    """One rank class per pipeline stage, holding its sharded fp32 state."""
    pp, mesh = job.pp, job.mesh
    classes = [RankClass(st, mesh.members(st),
                         label=(f"pipeline stage {st}" if pp > 1
                                else "all ranks (identical FSDP shards)"))
               for st in range(pp)]
    state = job.state_bytes
    for st, cls in enumerate(classes):
        shard_params = job.local_params(st)
        # fp32 sharded parameters, gradients and the two AdamW moments: 16 B per parameter
        # over the FSDP world size (AutoModel's bf16 model: 8 B); in host memory with CPU
        # offload.
        cls.initial_memory = {} if job.opts.cpu_offload else {
            "parameters": state * shard_params, "optimizer": 2 * state * shard_params,
            "gradients": state * shard_params}
        if job.moe is not None and job.moe.plan.flex is not None:
            # DeepEP's Buffer, allocated once per process (fused_a2a.get_buffer).
            cls.initial_memory["buffers"] = job.moe.plan.flex.persistent_bytes
    return classes


def _hw_flops(job: Job) -> float:
    """FLOPs the hardware runs per step: the model's, plus what recomputation re-runs."""
    ctx, tb, m = job.ctx, job.titan, job.ctx.model
    dp, cp, t = ctx.dp, job.mesh.cp, job.mesh.tp
    if tb is not None and tb.sac is not None:
        # Every rank re-runs its own shard's share of each layer (local widths, seq/cp).
        return ctx.model_flops_per_step() + m.layers * ctx.micro_batches * dp * cp * t * sum(
            c.recompute_flops for c in tb.sac.values())
    if job.sac is not None:
        return ctx.model_flops_per_step() + m.layers * ctx.micro_batches * dp * cp * sum(
            c.recompute_flops for c in job.sac.values())
    if job.moe is not None and ctx.recompute:
        # Every layer's forward again; an MoE layer's is its attention and MoE parts.
        moe = job.moe
        n_moe = sum(moe.is_moe(i) for i in range(m.layers))
        per_mb = sum(job.attn_cost(i).flops_fwd for i in range(m.layers)) \
            + n_moe * moe.flops_fwd \
            + (m.layers - n_moe) * job.costs["mlp"].flops_fwd
        return ctx.model_flops_per_step() + per_mb * ctx.micro_batches * dp
    return ctx.model_flops_per_step() + ctx.layer_recompute_flops(costs=job.costs)
