"""Megatron-LM's job shape: rank layout and groups, per-stage sizes and memory.

:func:`megatron_shape` checks a scenario's Megatron options (refusing what Megatron-LM's
``validate_args`` refuses, :mod:`sim.frameworks.megatron.checks`) and derives, once,
everything the builder's units share: the parallel degrees, the rank numbering and groups of
``parallel_state.py``, the priced blocks of one micro-batch, the layers of each model chunk
and the parameters and state memory of each pipeline stage. :class:`MegatronShape` is
frozen: the builder's op makers read it and never change it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Literal

from sim.frameworks.common.base import JobContext
from sim.frameworks.common.nccl_dtype import element_type
from sim.frameworks.megatron.buckets import data_parallel_modes
from sim.frameworks.megatron.checks import check_options
from sim.frameworks.megatron.dualpipe import check_dualpipe
from sim.frameworks.megatron.fsdp import fsdp_memory
from sim.frameworks.megatron.layout import as_layout
from sim.frameworks.megatron.moe_dispatch import check_moe
from sim.frameworks.megatron.moe_plan import MoEPlan, moe_plan
from sim.frameworks.megatron.mtp import MTPPlan, mtp_plan
from sim.frameworks.megatron.optimizer_precision import (
    OptimizerPlan,
    check_optimizer,
    fp8_weight_bytes,
    main_grad_bytes,
    optimizer_plan,
)
from sim.frameworks.megatron.pipeline import Placement, chunk_layers, p2p_modes
from sim.frameworks.megatron.recompute import check_recompute, recompute_modules, recompute_plan
from sim.hardware.attention_cost import release_or_newest
from sim.program.ir import NcclType
from sim.program.mesh import Groups, RankMesh
from sim.scenario import MegatronOptions
from sim.workload.layer_ops import Block, BlockCost, price_block
from sim.workload.layer_rules import fp8_both_layouts
from sim.workload.megatron_loss import loss_impl
from sim.workload.megatron_ops import (
    STYLE,
    MegatronLayout,
    attention_key,
    megatron_blocks,
    padded_vocab,
)
from sim.workload.model import ModelSpec
from sim.workload.mx_swizzle import Operand, swizzled_operands

ORDER = "tp-cp-ep-dp-pp"
"""Megatron-Core's default rank order, innermost first (``parallel_state.py``,
``initialize_model_parallel(order=...)``)."""


@dataclass(frozen=True)
class MegatronShape:
    """The layout, sizes and priced blocks of one Megatron job (see :func:`megatron_shape`)."""

    opts: MegatronOptions
    model: ModelSpec
    t: int
    """Tensor-parallel size."""
    p: int
    """Pipeline stages."""
    cp: int
    """Context-parallel size."""
    vp: int
    """Model chunks (virtual stages) per pipeline stage."""
    dp: int
    sp: bool
    """Sequence parallelism in effect (requested and tp > 1)."""
    precision: str
    ac: Literal["none", "selective", "full"]
    """Activation checkpointing (recomputation granularity)."""
    mb_count: int
    """Micro-batches per step."""
    align_gather: bool
    """Effective ``align_param_gather`` (:func:`data_parallel_modes`)."""
    k_inst: int
    """Distributed-optimizer instances."""
    overlap_p2p: bool
    batch_p2p: bool
    lay: MegatronLayout
    blocks: dict[str, Block]
    """One micro-batch's blocks on one tensor-parallel rank (:func:`megatron_blocks`)."""
    cost: dict[str, BlockCost]
    """Each block priced on the job's GPU."""
    tokens: int
    """Tokens of one micro-batch on one context-parallel rank."""
    local_tokens: int
    """The same on one sequence-parallel rank (tokens / tp with sequence parallelism)."""
    h: int
    act: int
    """Bytes per activation element (16-bit activations)."""
    grad_bytes: int
    """Bytes per gradient element in the reduced buffers (fp32 or 16-bit)."""
    chunks: list[list[int]]
    """Layer numbers of each virtual stage, in the order activations flow through them
    (:attr:`place` says which stage runs each)."""
    stage_layer_count: list[int]
    layer_params: float
    """Parameters of one transformer layer on one tensor-parallel rank."""
    vocab_local: int
    emb_params: float
    head_params: float
    opt_bytes: float
    """Optimizer bytes per parameter held on the GPU through the step: master weights and
    Adam moments, the CPU-offloaded share excluded (:attr:`optim`)."""
    shard: int
    """Ranks the optimizer state is sharded over (1 without the distributed optimizer)."""
    linear_params: float
    """Linear-layer parameters of one layer (their FP8 copies under FP8 training)."""
    moe: MoEPlan | None = None
    """The expert layout and one MoE layer's ops (:mod:`sim.frameworks.megatron.moe`); None
    for a dense model. Its layers' ``layer_params`` count the router and shared experts, not
    the routed experts (:meth:`stage_expert_params`)."""
    dense_layer_params: float = 0.0
    """With experts: one dense layer's parameters (the ``first_k_dense`` layers)."""
    mtp: MTPPlan | None = None
    """The multi-token prediction modules on the last stage
    (:mod:`sim.frameworks.megatron.mtp`); their parameters are in :attr:`head_params`."""
    recompute: frozenset[str] = frozenset()
    """Modules recomputed under selective granularity (``framework.recompute_modules``,
    default ``core_attn``; :mod:`sim.frameworks.megatron.recompute`); empty otherwise."""
    optim: OptimizerPlan | None = None
    """What the optimizer keeps and moves per parameter
    (:mod:`sim.frameworks.megatron.optimizer_precision`); None: the default fp32 Adam."""

    @property
    def optimizer(self) -> OptimizerPlan:
        """:attr:`optim`, or the default fp32 Adam's plan."""
        if self.optim is not None:
            return self.optim
        return optimizer_plan(self.opts, self.precision, self.grad_bytes)

    @property
    def act_dtype(self) -> NcclType:
        """NCCL type of activations and gathered parameters (:attr:`act` bytes)."""
        return element_type(self.act, self.precision)

    @property
    def grad_dtype(self) -> NcclType:
        """NCCL type of the gradient reduces (:attr:`grad_bytes`): f32 with
        ``grad_reduce_in_fp32``, Megatron-Core's default for bf16 (and fp8) training."""
        return element_type(self.grad_bytes, self.precision)

    @property
    def n_virtual(self) -> int:
        """Virtual stages: pp x vp."""
        return self.p * self.vp

    @property
    def schedule_kind(self) -> str:
        """The kind :func:`~sim.frameworks.megatron.pipeline.schedule` takes: virtual stages
        run the interleaved 1F1B (Megatron's only interleaved schedule), one chunk a stage
        runs ``framework.pipeline_schedule``; ``dualpipe`` and ``dualpipev`` are DeepSeek's
        (:mod:`sim.frameworks.megatron.dualpipe`)."""
        if self.deepseek_schedule:
            return self.opts.pipeline_schedule
        return "1f1b" if self.vp > 1 else self.opts.pipeline_schedule

    @property
    def deepseek_schedule(self) -> bool:
        """DualPipe or DualPipeV (:mod:`sim.frameworks.megatron.dualpipe`)."""
        return self.opts.pipeline_schedule in ("dualpipe", "dualpipev")

    @cached_property
    def place(self) -> Placement:
        """Which stage runs each virtual stage: Megatron-Core's loop, DualPipeV's V or
        DualPipe's two directions."""
        return placement(self.opts, self.p, self.vp)

    @property
    def chunk_micro_batches(self) -> int:
        """Micro-batches through each virtual stage (:func:`micro_batches_per_chunk`)."""
        return micro_batches_per_chunk(self.opts, self.mb_count)

    @property
    def legacy(self) -> bool:
        """The local implementation (older Megatron, Megatron-DeepSpeed)."""
        return self.opts.implementation == "local"

    @property
    def row_reduce(self) -> Literal["reduce_scatter", "all_reduce"]:
        """The tensor-parallel reduce after a row-parallel linear (and the embedding):
        reduce-scatter under sequence parallelism, all-reduce otherwise."""
        return "reduce_scatter" if self.sp else "all_reduce"

    @property
    def p2p_split(self) -> int:
        """Megatron's pipeline p2p (Narayanan et al., SC'21, sec. 4.1 "scatter/gather
        optimization"): without sequence parallelism every tensor-parallel rank holds the
        same activation, so each sends only its 1/tp slice across the stage boundary
        (``scatter_gather_tensors_in_pipeline``, on by default in the local implementation)."""
        scatter_gather = self.opts.scatter_gather_tensors_in_pipeline
        if scatter_gather is None:
            scatter_gather = self.legacy
        return self.t if (scatter_gather and self.t > 1 and not self.sp) else 1

    # ------------------------------------------------------------------ ranks and groups
    @cached_property
    def mesh(self) -> RankMesh:
        """The job's ranks in Megatron-Core's default order ``tp-cp-ep-dp-pp``
        (``parallel_state.py``, ``RankGenerator``; innermost first): tensor-parallel peers
        adjacent, pipeline stages outermost. ep = 1: with parallel folding the attention's
        layout has no expert dimension (the experts' is :attr:`MoEPlan.mesh`)."""
        return RankMesh.from_order(ORDER, {"tp": self.t, "cp": self.cp, "ep": 1,
                                           "dp": self.dp, "pp": self.p})

    def rank(self, ti: int, ci: int, di: int, pi: int) -> int:
        """Global rank of (tp, cp, dp, pp) coordinates."""
        return self.mesh.rank(tp=ti, cp=ci, dp=di, pp=pi)

    def members(self, st: int) -> tuple[int, ...]:
        """Ranks of pipeline stage ``st`` (one rank class: they all run the same ops)."""
        return self.mesh.members(pp=st)

    # The groups and pairs below list their entries in the order this builder always has
    # (``over``): the collectives' flows go onto the fabric in that order.
    def tp_groups(self, st: int) -> Groups:
        return self.mesh.groups(["tp"], over=["cp", "dp"], pp=st)

    def dp_groups(self, st: int) -> Groups:
        """Gradients are reduced over data- and context-parallel ranks together
        (``parallel_state``'s ``dp-cp`` group)."""
        return self.mesh.groups(["dp", "cp"], over=["tp"], pp=st)

    def stage_pairs(self, a: int, b: int) -> tuple[tuple[int, int], ...]:
        """(rank on stage a, same coordinates on stage b) for every member: a pipeline
        transfer's pairs, or the tied embedding's group pairs."""
        return self.mesh.peer_pairs("pp", a, b, over=["tp", "cp", "dp"])

    def cp_ring_pairs(self, st: int) -> tuple[tuple[int, int], ...]:
        """(rank, next rank in its context-parallel ring) for every member of stage st."""
        return self.mesh.ring_pairs(["cp"], over=["tp", "dp"], pp=st)

    # ------------------------------------------------------------------ per-stage sizes
    def stage_layers(self, st: int) -> list[int]:
        """Transformer layers of stage ``st``, all its model chunks."""
        return [la for v in self.place.stage_virtuals(st) for la in self.chunks[v]]

    def stage_params(self, st: int) -> float:
        """Parameters of stage ``st`` on one tensor-parallel rank, routed experts excepted
        (those reduced over the data-parallel group): its layers, the embedding on the first
        stage, the output layer (a tied copy if tied) on the last."""
        if self.moe is None:
            n = self.stage_layer_count[st] * self.layer_params
        else:
            moe = self.moe
            n = sum(self.layer_params if moe.is_moe(la) else self.dense_layer_params
                    for la in self.stage_layers(st))
        return n + self.place.firsts(st) * self.emb_params \
            + self.place.lasts(st) * self.head_params

    def stage_expert_params(self, st: int) -> float:
        """Routed-expert parameters of stage ``st`` on one rank (its local experts' shards),
        reduced over the expert-data-parallel group."""
        if self.moe is None:
            return 0.0
        moe = self.moe
        mtp = self.mtp.depths * self.mtp.expert_params * self.place.lasts(st) \
            if self.mtp is not None else 0.0
        return sum(moe.expert_params for la in self.stage_layers(st) if moe.is_moe(la)) + mtp

    @property
    def expert_shard(self) -> int:
        """Ranks the experts' optimizer state is sharded over: the expert-data-parallel
        group with the distributed optimizer (Megatron-Core's ``DistributedOptimizer`` over
        the expert parameters' buffers uses ``expt_dp``), else 1."""
        return self.moe.edp if self.moe is not None and self.opts.distributed_optimizer else 1

    def stage_fp8_params(self, st: int) -> float:
        """Parameters of stage ``st`` in FP8 linears under FP8 training: every layer's linear
        weights; an MoE layer's attention linears, local experts and shared experts (the
        router's GEMM stays 16-bit); the MTP modules' eh_proj and layer (they run under the
        global FP8 context too)."""
        if self.moe is None:
            n = float(self.stage_layer_count[st] * self.linear_params)
        else:
            moe, attn = self.moe, self.cost["attn_main"].params
            mlp = self.linear_params - attn
            moe_lin = moe.expert_params + (moe.ops.shared.params if moe.ops.shared else 0)
            n = float(sum(attn + (moe_lin if moe.is_moe(la) else mlp)
                          for la in self.stage_layers(st)))
        if self.mtp is not None and self.place.lasts(st):
            layer = self.linear_params if self.moe is None else \
                self.cost["attn_main"].params + self.moe.expert_params + (
                    self.moe.ops.shared.params if self.moe.ops.shared else 0)
            eh_proj = 2 * self.h * self.h // self.t
            n += float(self.mtp.depths * (eh_proj + layer)) * self.place.lasts(st)
        return n

    def gather_bytes(self, st: int, expert: bool) -> float:
        """Bytes per element of stage ``st``'s distributed-optimizer parameter all-gathers
        (the dense buffers, or the experts' with ``expert``): 16-bit, or with
        ``fp8_param_gather`` 1 byte for the FP8 linear weights (Megatron-Core's DDP keeps them
        in their own uint8 buffers; the routed experts are all FP8 linears), averaged over
        the stage's dense parameters. MXFP8 primary weights are gathered in 16 bits into the
        reused gradient buffer and cast as they are copied out
        (``reuse_grad_buf_for_mxfp8_param_ag``, Megatron-Core ``param_and_grad_buffer.py``)."""
        if not (self.lay.fp8 and self.opts.fp8_param_gather) or self.lay.fp8 == "mxfp8":
            return float(self.act)
        if expert:
            return 1.0
        n = self.stage_params(st)
        fp8 = self.stage_fp8_params(st) - self.stage_expert_params(st)
        return self.act - (self.act - 1.0) * fp8 / n if n else float(self.act)

    def initial_memory(self, st: int) -> dict[str, float]:
        """Memory per rank of stage ``st`` before the step: 16-bit parameters, gradient
        buffers, the optimizer state's GPU share (:attr:`opt_bytes`) sharded by the
        distributed optimizer; TE's FP8 weight copies (``fp8_weight_bytes``); Megatron-FSDP
        shards all of it (:func:`~sim.frameworks.megatron.fsdp.fsdp_memory`)."""
        n = self.stage_params(st)
        mem = {"parameters": self.act * n, "gradients": self.grad_bytes * n,
               "optimizer": self.opt_bytes * n / self.shard}
        e = self.stage_expert_params(st)
        if e:
            mem["parameters"] += self.act * e
            mem["gradients"] += self.grad_bytes * e
            mem["optimizer"] += self.opt_bytes * e / self.expert_shard
        copy = 0.0   # TE's FP8 copy of a linear weight, bytes a parameter
        if self.lay.fp8:
            # Per FP8 linear parameter: the parameter itself (1 byte as a primary weight) and
            # TE's cached FP8 copy / transpose (optimizer_precision.fp8_weight_bytes).
            pbytes, bbytes = fp8_weight_bytes(self.opts.fp8_param_gather,
                                              self.lay.fp8_transpose, self.lay.fp8)
            lin = self.stage_fp8_params(st)
            mem["buffers"], copy = bbytes * lin, bbytes
            mem["parameters"] -= (self.act - pbytes) * lin
        if e and self.moe is not None and self.moe.flex is not None:
            # DeepEP's Buffer, allocated once per process (fused_a2a.get_buffer).
            mem["buffers"] = mem.get("buffers", 0.0) + self.moe.flex.persistent_bytes
        if self.opts.use_megatron_fsdp:
            mem = fsdp_memory(self, mem, copy)
        return mem

    def recompute_flops(self) -> float:
        """Hardware FLOPs beyond the model's: full recomputation re-runs every layer's
        forward once per micro-batch on every data- and context-parallel replica. The
        blocks are priced per tensor-parallel rank, so a layer's forward is ``t`` of them.
        Selective recomputation re-runs its modules' forward GEMMs (core attention's are not
        counted, as before ``recompute_modules``)."""
        if self.ac == "selective":
            return self._selective_recompute_flops()
        if self.ac != "full":
            return 0.0
        if self.mtp is not None:
            # _checkpointed_forward re-runs each depth's projection and layer.
            mlp = self.moe.flops_fwd if self.moe is not None else \
                self.blocks["mlp_main"].flops_fwd
            per_mb = self.mtp.depths * (self.mtp.proj_flops[0] + mlp
                                        + self.blocks["attn_main"].flops_fwd)
            extra_mtp = per_mb * self.mb_count * self.dp * self.cp * self.t
        else:
            extra_mtp = 0.0
        return extra_mtp + self._decoder_recompute_flops()

    def _selective_recompute_flops(self) -> float:
        """The modules' re-run forward FLOPs over every layer (and MTP depth)."""
        if self.recompute <= {"core_attn"}:
            return 0.0
        per = recompute_plan(self, None)[1]
        layers = list(range(self.model.layers)) + (list(self.mtp.layers) if self.mtp else [])
        total = sum(per["moe"] if self.moe is not None and self.moe.is_moe(la) else per["dense"]
                    for la in layers)
        return total * self.mb_count * self.dp * self.cp * self.t

    def _decoder_recompute_flops(self) -> float:
        layer_fwd_flops = sum(self.blocks[k].flops_fwd for k in ("attn_main", "mlp_main"))
        # Sliding-window layers re-run their windowed attention, not a full one.
        windowed = sum(self.blocks[attention_key(self.model, la, self.blocks)].flops_fwd
                       - self.blocks["attn_main"].flops_fwd for la in range(self.model.layers))
        if self.moe is not None:
            moe_layers = self.model.moe_layers
            extra = moe_layers * (self.moe.flops_fwd - self.blocks["mlp_main"].flops_fwd)
            return ((layer_fwd_flops * self.model.layers + extra + windowed)
                    * self.mb_count * self.dp * self.cp * self.t)
        return ((layer_fwd_flops * self.model.layers + windowed) * self.mb_count * self.dp
                * self.cp * self.t)


def micro_batches_per_chunk(opts: MegatronOptions, m: int) -> int:
    """Micro-batches through each virtual stage of ``m`` a step: DualPipe feeds half from
    each end, every other schedule all of them through every chunk."""
    return m // 2 if opts.pipeline_schedule == "dualpipe" else m


def placement(opts: MegatronOptions, p: int, vp: int) -> Placement:
    """The virtual stages' placement ``framework.pipeline_schedule`` runs on."""
    return Placement(p, vp, v_shape=opts.pipeline_schedule == "dualpipev",
                     bidirectional=opts.pipeline_schedule == "dualpipe")


def scenario_chunks(m: ModelSpec, opts: MegatronOptions, p: int, vp: int) -> list[list[int]]:
    """Transformer layers of each virtual stage under the scenario's split options."""
    layout = opts.pipeline_model_parallel_layout
    return chunk_layers(m.layers, p, vp, opts.account_for_embedding_in_pipeline_split,
                        opts.account_for_loss_in_pipeline_split,
                        opts.decoder_first_pipeline_num_layers,
                        opts.decoder_last_pipeline_num_layers,
                        as_layout(layout) if layout is not None else None)


def mx_swizzled(te_version: str | None, fp8_param_gather: bool) -> frozenset[Operand]:
    """The MXFP8 operands Transformer Engine ``te_version`` (``training.
    transformer_engine_version``; None: the newest) swizzles at each GEMM call, Megatron's FP8
    primary weights (``fp8_param_gather``) included (:mod:`sim.workload.mx_swizzle`)."""
    return swizzled_operands(release_or_newest(te_version),
                             fp8_param_gather)


def megatron_shape(ctx: JobContext) -> MegatronShape:
    """Check the scenario's Megatron options and derive the job's :class:`MegatronShape`."""
    s = ctx.scenario
    opts = s.framework
    assert isinstance(opts, MegatronOptions)
    par = s.parallelism
    m = ctx.model
    t, p, cp, vp = par.tp, par.pp, par.cp, par.vp
    check_options(ctx, opts)
    check_recompute(ctx, opts)
    check_optimizer(ctx, opts)
    precision = s.training.precision
    mb_count = ctx.micro_batches
    align_gather, k_inst = data_parallel_modes(ctx, opts, vp, ctx.dp * cp)
    if opts.pipeline_schedule in ("dualpipe", "dualpipev"):
        # DualPipe posts its own sends and receives (dualpipe.py): Megatron's p2p modes
        # configure Megatron's schedules only and are not read.
        check_dualpipe(ctx, opts, p, vp, mb_count)
        overlap_p2p, batch_p2p = False, False
    else:
        overlap_p2p, batch_p2p = p2p_modes(ctx, opts.overlap_p2p_comm, opts.batch_p2p_comm,
                                           p, vp)
    ctx.require(vp == 1 or mb_count % p == 0 or opts.pipeline_schedule == "dualpipev",
                "training.global_batch_size",
                f"interleaved 1F1B needs the micro-batch count ({mb_count}) to be a multiple "
                f"of pp={p}")
    sp = par.sequence_parallel and t > 1
    ac = s.training.activation_checkpointing
    modules = recompute_modules(ac, opts)
    blackwell = ctx.compute.gpu.arch == "blackwell"
    # FP8 primary weights are quantized by the optimizer step (its parameter copy), so the
    # forward casts nothing; on Hopper it still builds each weight's transpose once a step.
    # MXFP8 ones arrive in 16 bits and are cast once a step (gather_bytes). Under DualPipe
    # each copy of a stage sees half the micro-batches and casts its own weights.
    # Megatron-FSDP gathers 16-bit weights again, and casts them, every micro-batch (fsdp.py).
    cast = 0.0 if opts.fp8_param_gather and blackwell and opts.fp8_recipe != "mxfp8" \
        else 1.0 if opts.use_megatron_fsdp else 1.0 / micro_batches_per_chunk(
            opts, ctx.cast_micro_batches or mb_count)
    grad_bytes = main_grad_bytes(opts, precision)
    # Transformer Engine without a fused kernel for the layer's head dims runs its unfused
    # attention (sim.hardware.te_fused_attention): the same kernels as Megatron's local path.
    flash = opts.flash_attention and ctx.compute.attention_backend != "unfused"
    lay = MegatronLayout(tp=t, sequence_parallel=sp, flash_attention=flash,
                         dropout=opts.dropout, selective_recompute="core_attn" in modules, cp=cp,
                         fp8=opts.fp8_recipe if precision == "fp8" else None,
                         weight_cast_share=cast,
                         fp8_transpose=fp8_both_layouts(ctx.compute.gpu.arch, opts.fp8_recipe),
                         cross_entropy=loss_impl(opts.cross_entropy_loss_fusion,
                                                 opts.cross_entropy_fusion_impl),
                         rope_fusion=opts.apply_rope_fusion,
                         fp8_output=opts.fp8_output_proj and precision == "fp8",
                         fp8_attention=opts.fp8_dot_product_attention,
                         grad_accumulation_fusion=opts.gradient_accumulation_fusion,
                         main_grad_bytes=grad_bytes,
                         mx_swizzled=mx_swizzled(s.training.transformer_engine_version,
                                                 opts.fp8_param_gather))
    blocks = megatron_blocks(m, lay, ctx.micro_batch, ctx.seq)
    cost = {k: price_block(b, STYLE, ctx.compute) for k, b in blocks.items()}
    tokens = ctx.micro_batch * ctx.seq // cp
    optim = optimizer_plan(opts, precision, grad_bytes)
    chunks = scenario_chunks(m, opts, p, vp)
    if opts.pipeline_schedule == "dualpipe":
        # Both directions run the same p-stage split, each on its own copy of the layers.
        chunks, vp = chunks + chunks, 2
    place = placement(opts, p, vp)
    vocab_local = padded_vocab(m, t) // t
    local_tokens = tokens // t if sp else tokens
    dense_layer = (cost["attn_pre"].params + cost["attn_main"].params
                   + cost["mlp_pre"].params + cost["mlp_main"].params)
    moe = None
    layer_params: float = dense_layer
    if m.moe is not None:
        check_moe(ctx, opts.implementation, k_inst, sp)
        moe = moe_plan(ctx, t, p, local_tokens, ctx.compute, lay.fp8, lay.weight_cast_share,
                       lay.mx_swizzled)
        # A layer with experts: attention, the pre-MLP norm, the router and shared experts.
        layer_params = (cost["attn_pre"].params + cost["attn_main"].params
                        + cost["mlp_pre"].params + moe.dense_params)
    emb_params = vocab_local * m.hidden + (m.max_positions * m.hidden
                                           if m.position == "learned" else 0)
    mtp = mtp_plan(m, lay, ctx.micro_batch, ctx.seq, ctx.compute, p, layer_params,
                   moe.expert_params if moe is not None else 0.0, emb_params)
    return MegatronShape(
        opts=opts, model=m, t=t, p=p, cp=cp, vp=vp, dp=ctx.dp, sp=sp, precision=precision,
        ac=ac, mb_count=mb_count, align_gather=align_gather, k_inst=k_inst,
        overlap_p2p=overlap_p2p, batch_p2p=batch_p2p, lay=lay, blocks=blocks, cost=cost,
        tokens=tokens, local_tokens=local_tokens, h=m.hidden,
        act=2,  # 16-bit activations
        grad_bytes=grad_bytes, chunks=chunks,
        stage_layer_count=[sum(len(chunks[v]) for v in place.stage_virtuals(st))
                           for st in range(p)],
        layer_params=layer_params,
        vocab_local=vocab_local,
        emb_params=emb_params,
        # The output layer (a tied copy if tied), and the multi-token prediction modules.
        head_params=m.norm_params + vocab_local * m.hidden
        + (mtp.stage_params if mtp is not None else 0.0),
        opt_bytes=optim.gpu_bytes * (1.0 - optim.offload), optim=optim,
        shard=ctx.dp * cp // k_inst if opts.distributed_optimizer else 1,
        linear_params=cost["attn_main"].params + cost["mlp_main"].params,
        moe=moe, dense_layer_params=dense_layer, mtp=mtp, recompute=modules)
