"""The plan of Megatron-Core's mixture-of-experts layers: their groups, kernels and bytes.

**Parallel folding** (``parallel_state.initialize_model_parallel``, arXiv:2504.14960): the
attention keeps its ``tp-cp-dp-pp`` layout (Megatron-Core's decoder ``RankGenerator`` has
``ep=1``), and the experts get a second layout over the same ranks,
``RankGenerator(tp=etp, ep=ep, dp=world / (etp x ep x pp), pp=pp, cp=1)`` in the same order
``tp-cp-ep-dp-pp``: EP, expert-TP, their product and the expert-data-parallel groups come
from it (:class:`MoEPlan`). Expert parameters' gradients are reduced over the
expert-data-parallel group (``expt_dp``), the others over the usual data-parallel group.
:func:`moe_plan` prices one rank's MoE layer once (its kernels, routing pace, dispatcher
plan); :mod:`sim.frameworks.megatron.moe` lays its ops out per layer and micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import Literal

from sim.config.base import Fp8Recipe
from sim.frameworks.common.base import JobContext
from sim.frameworks.common.moe_pace import Pace, routing_pace
from sim.frameworks.megatron.moe_dispatch import (
    allgather_blocks,
    expert_capacity,
    shared_fc1_part,
)
from sim.frameworks.megatron.moe_dispatch import check_moe as check_moe  # shape.py's
from sim.frameworks.megatron.moe_flex import (
    FlexPlan,
    check_router_groups,
    drop_chunk_sorts,
    flex_plan,
)
from sim.frameworks.megatron.moe_flex_skew import flex_pace
from sim.frameworks.megatron.moe_host import (
    megatron_host_calls,
)
from sim.frameworks.megatron.moe_hybridep import (
    FUSED_KERNELS,
    drop_fused_kernels,
    hybridep_plan,
)
from sim.frameworks.megatron.moe_rank_budget import (
    check_op_fuser,
    check_rank_budget,
    held_scale,
    with_stash_copies,
)
from sim.frameworks.megatron.moe_ranks import RankExperts, rank_experts
from sim.frameworks.megatron.optimizer_precision import main_grad_bytes
from sim.frameworks.megatron.overlap import amax_reductions
from sim.hardware.compute import ComputeModel
from sim.program.mesh import Groups, RankMesh
from sim.scenario import MegatronOptions
from sim.workload.block_pricing import BlockCost, price_block
from sim.workload.kernels import drop_kernels
from sim.workload.layer_rules import fp8_both_layouts
from sim.workload.model import ModelSpec
from sim.workload.moe_host_ops import HostCalls
from sim.workload.moe_ops import STYLE, MoELayerOps, MoELayout, moe_layer_ops
from sim.workload.moe_router_ops import router_dtype_bytes
from sim.workload.mx_swizzle import Operand

ORDER = "tp-cp-ep-dp-pp"
"""Megatron-Core's rank order, innermost first; the expert layout uses it too."""


@dataclass(frozen=True)
class MoEPlan:
    """The expert layout of a Megatron job and the priced ops of one MoE layer on one rank
    (see :func:`moe_plan`)."""

    model: ModelSpec
    ep: int
    etp: int
    edp: int
    """Expert-data-parallel size: world / (etp x ep x pp)."""
    p: int
    ops: MoELayerOps
    cost: dict[str, BlockCost]
    """``router``, ``experts``, ``combine`` (and ``shared``) priced on the job's GPU."""
    act: int
    """Bytes per token element on the wire (16-bit)."""
    precision: str
    pace: Pace | None = None
    """The busiest EP rank under skewed routing (its experts' time, expert-TP bytes and the
    all-to-alls' per-peer tokens); None when routing is balanced."""
    dispatcher: Literal["alltoall", "allgather", "flex"] = "alltoall"
    """``moe_token_dispatcher_type`` (:mod:`sim.frameworks.megatron.moe_dispatch`)."""
    flex: FlexPlan | None = None
    """``flex``: DeepEP's fused transfers (:mod:`sim.frameworks.megatron.moe_flex`)."""
    capacity: int | None = None
    """With ``moe_pad_expert_input_to_capacity``: the tokens each expert takes from each
    rank (every expert's input padded to it); None: dropless sizes."""
    useful: float = 1.0
    """Share of the expert GEMMs' rows that are routed tokens: below 1 when padded to
    capacity (the padding rows are hardware FLOPs, not model FLOPs)."""
    gathered: float = 0.0
    """allgather dispatcher: tokens on the rank after the expert-TP x EP gather."""
    shared_overlap: bool = False
    """``moe_shared_expert_overlap``: the shared experts on their own stream."""
    shared_fc1: BlockCost | None = None
    """With the overlap: the shared experts' fc1 part (beside the dispatch); the rest is fc2."""
    ranks: tuple[RankExperts, ...] = ()
    """Under skewed routing, each EP rank's load (:func:`.moe_ranks.split_expert_ranks`)."""
    amax_gather: bool = False
    """FP8 current scaling: an amax all-reduce over TP before each quantize-then-gather
    (:func:`~sim.frameworks.megatron.overlap.amax_reductions`)."""
    expert_held: float = 1.0
    """What the routed experts' saved activations are held at over the rows received: the
    rank budget's rows over them (``moe_expert_rank_capacity_factor``, budget-sized
    tensors) or the paged stash pool's factor (:mod:`.moe_rank_budget`); 1 otherwise."""
    aux_reduce: bool = False
    """``TopKRouter._apply_aux_loss`` all-reduces ``routing_map.sum(dim=0)`` ([experts] int64)
    over ``tp_cp_group`` every forward (``moe_utils.get_tokens_per_expert_and_token_count``);
    laid out for tp > 1 with cp = 1, where that group is the TP group."""
    host: dict[str, HostCalls] | None = None
    """Python-level host calls per component (:mod:`.moe_host`); None: kernels x per-op."""

    # ------------------------------------------------------------------ layers and sizes
    def is_moe(self, layer: int) -> bool:
        """Whether transformer layer ``layer`` (0-based) has experts: all but the first
        ``first_k_dense`` (DeepSeek's ``first_k_dense_replace``; Megatron's
        ``moe_layer_freq`` pattern with leading dense layers)."""
        assert self.model.moe is not None
        return layer >= self.model.moe.first_k_dense

    @property
    def expert_params(self) -> float:
        """Routed-expert parameters of one MoE layer on one rank: ``experts / ep`` local
        experts, each ``1 / etp`` of its width."""
        return float(self.ops.experts.params)

    @property
    def dense_params(self) -> float:
        """The MoE layer's other MLP-side parameters on one rank: the router (replicated)
        and the shared experts (split over tp); reduced over the usual data-parallel group."""
        return float(self.ops.router.params + (self.ops.shared.params if self.ops.shared
                                               else 0))

    @property
    def experts_cost(self) -> BlockCost:
        """The expert block whose time every rank waits for: the busiest EP rank's."""
        return self.pace.experts if self.pace is not None else self.cost["experts"]

    @property
    def etp_gather_bytes(self) -> float:
        """Bytes one rank adds to the expert-TP all-gather (the busiest EP rank's)."""
        return (self.pace.ops if self.pace is not None else self.ops).etp_gather_bytes

    def peer_bytes(self, which: str) -> tuple[tuple[float, ...], ...]:
        """All-to-all ``which``'s byte matrix over one EP group (row: sender), or () for
        the even split: tokens follow the dispatch matrix, the combine and the dispatch's
        gradient go back the transposed way. Made once per ``which`` (every MoE layer and
        micro-batch asks for the same matrix)."""
        made = self._peer_bytes_made
        if which not in made:
            made[which] = self._peer_bytes(which)
        return made[which]

    @cached_property
    def _peer_bytes_made(self) -> dict[str, tuple[tuple[float, ...], ...]]:
        return {}

    def _peer_bytes(self, which: str) -> tuple[tuple[float, ...], ...]:
        if self.pace is None:
            return ()
        m = self.pace.peer_tokens
        if len({x for row in m for x in row}) == 1:
            return ()
        per = 4.0 if "probs" in which else float(self.act * self.model.hidden)
        if which in ("combine_fwd", "dispatch_bwd", "dispatch_probs_bwd"):
            m = tuple(zip(*m, strict=True))
        return tuple(tuple(x * per for x in row) for row in m)

    @property
    def saved_bytes(self) -> float:
        """Activation bytes one MoE layer's blocks save for backward (the busiest EP
        rank's experts, held at :attr:`expert_held` times their rows)."""
        return sum(self.experts_cost.saved_bytes * self.expert_held if k == "experts"
                   else c.saved_bytes for k, c in self.cost.items())

    @property
    def flops_fwd(self) -> float:
        return sum(c.flops_fwd for c in self.cost.values())

    @property
    def flops_bwd(self) -> float:
        return sum(c.flops_bwd for c in self.cost.values())

    # ------------------------------------------------------------------ groups
    @cached_property
    def mesh(self) -> RankMesh:
        """The expert layout: ``RankGenerator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1)``."""
        return RankMesh.from_order(ORDER, {"tp": self.etp, "cp": 1, "ep": self.ep,
                                           "dp": self.edp, "pp": self.p})

    def ep_groups(self, st: int) -> Groups:
        return self.mesh.groups(["ep"], over=["dp", "tp"], pp=st)

    def etp_groups(self, st: int) -> Groups:
        return self.mesh.groups(["tp"], over=["dp", "ep"], pp=st)

    def tp_ep_groups(self, st: int) -> Groups:
        """Expert-TP x EP (``get_ranks('tp-ep')``: expert-TP fastest): the count
        all-gather's group."""
        return self.mesh.groups(["ep", "tp"], over=["dp"], pp=st)

    def edp_groups(self, st: int) -> Groups:
        """Expert-data-parallel groups (``expt_dp``): expert gradients are reduced here."""
        return self.mesh.groups(["dp"], over=["ep", "tp"], pp=st)


def moe_plan(ctx: JobContext, tp: int, pp: int, local_tokens: int, cm: ComputeModel,
             fp8: Fp8Recipe | None = None, weight_cast_share: float = 1.0,
             mx_swizzled: frozenset[Operand] = frozenset()) -> MoEPlan:
    """The expert layout and one MoE layer's priced ops on one rank, whose ``local_tokens``
    (micro-batch x sequence / (cp x tp) with sequence parallelism) enter the router. With
    ``fp8`` the expert GEMMs run in FP8 as Transformer Engine's grouped linears do (the
    ``alltoall`` dispatch itself stays 16-bit)."""
    par = ctx.scenario.parallelism
    opts = ctx.scenario.framework
    assert isinstance(opts, MegatronOptions)
    ep, etp = par.ep, par.expert_tp
    lay = MoELayout(ep=ep, etp=etp, tp=tp, fp8=fp8, weight_cast_share=weight_cast_share,
                    mx_swizzled=mx_swizzled,
                    fp8_transpose=fp8_both_layouts(cm.gpu.arch, fp8),
                    # moe_permute_fusion (the Bridge/NeMo model providers set it): TE's
                    # fused permutations, else PyTorch's ops as moe_utils.py issues them.
                    permute="te" if opts.moe_permute_fusion else "torch",
                    router_fusion=opts.moe_router_fusion,
                    router_bytes=router_dtype_bytes(opts.moe_router_dtype),
                    main_grad_bytes=main_grad_bytes(opts, ctx.scenario.training.precision),
                    aux_loss=opts.moe_aux_loss_coeff > 0,
                    z_loss=opts.moe_z_loss_coeff is not None,
                    token_drop=None if ctx.model.moe is None or ctx.model.moe.capacity_factor
                    is None else "pad" if opts.moe_pad_expert_input_to_capacity else "drop",
                    # TEGroupedMLP (experts.py): TE GroupedLinear, one cuBLASLt call an expert.
                    gemm_per_expert=True,
                    te_ops=opts.use_transformer_engine_op_fuser or opts.cutedsl_fused_grouped_mlp,
                    # TE's fused grouped MLP runs on sm 10.x only (grouped_mlp.is_supported);
                    # the recipe and shapes it needs are the experts block's to check.
                    fused_glu=opts.cutedsl_fused_grouped_mlp and cm.gpu.arch == "blackwell")
    check_rank_budget(ctx)
    check_op_fuser(ctx)
    aux_reduce = lay.aux_loss and tp > 1 and par.cp == 1
    moe = ctx.model.moe
    assert moe is not None
    capacity = drop = None
    kw: dict[str, object] = {}
    if moe.capacity_factor is not None and not opts.moe_pad_expert_input_to_capacity:
        # Token dropping without padding (apply_router_token_dropping): each rank keeps at
        # most ``capacity`` copies per expert; balanced routing loses copies only with a
        # factor below 1 (skewed routing: :func:`routing_pace` caps the hot experts).
        drop = expert_capacity(local_tokens, moe.top_k, moe.experts, moe.capacity_factor)
        share = local_tokens * moe.top_k / moe.experts
        if drop < share:
            local = moe.experts // ep
            kw = {"tokens_per_expert": (float(drop * ep * etp),) * local,
                  "send_tokens": (float(drop * local),) * ep,
                  "recv_tokens": (float(drop * local),) * ep,
                  "permuted_rows": float(drop * moe.experts)}
    if opts.moe_pad_expert_input_to_capacity:
        ctx.require(moe.capacity_factor is not None,
                    "framework.moe_pad_expert_input_to_capacity",
                    "padding expert inputs to capacity needs model.capacity_factor "
                    "(Megatron-Core: moe_expert_capacity_factor must be set)")
        assert moe.capacity_factor is not None
        capacity = expert_capacity(local_tokens, moe.top_k, moe.experts, moe.capacity_factor)
        local = moe.experts // ep
        # MoEAlltoAllTokenDispatcher.preprocess (drop_and_pad): capacity x tp x ep rows per
        # local expert, capacity x local experts to and from every EP peer.
        kw = {"tokens_per_expert": (float(capacity * ep * etp),) * local,
              "send_tokens": (float(capacity * local),) * ep,
              "recv_tokens": (float(capacity * local),) * ep,
              "permuted_rows": float(capacity * moe.experts)}
    ctx.require(not opts.moe_shared_expert_overlap
                or opts.moe_token_dispatcher_type in ("alltoall", "flex"),
                "framework.moe_shared_expert_overlap",
                "moe_shared_expert_overlap only works with the alltoall or flex token "
                "dispatcher (Megatron-Core TransformerConfig)")
    check_router_groups(ctx)
    ctx.require(not opts.moe_deepep_fp8_dispatch or opts.moe_token_dispatcher_type == "flex",
                "framework.moe_deepep_fp8_dispatch",
                "FP8 dispatch is DeepEP's: it needs moe_token_dispatcher_type flex")
    ctx.require(opts.moe_permute_fusion or opts.moe_token_dispatcher_type == "alltoall",
                "framework.moe_permute_fusion",
                "the unfused permutation is modelled for the alltoall token dispatcher only "
                "(set moe_permute_fusion: true with allgather or flex)")
    ops = moe_layer_ops(ctx.model, lay, tokens=local_tokens, **kw)  # type: ignore[arg-type]
    if opts.moe_token_dispatcher_type == "flex" and opts.moe_flex_dispatcher_backend == "hybridep":
        drop_fused_kernels(ops)   # its dispatch and combine permute themselves
    elif opts.moe_token_dispatcher_type == "flex" and capacity is None:
        drop_chunk_sorts(ops)     # DeepEP: one permute after the dispatch, none by source rank
    if opts.moe_router_padding_for_quantization:
        # The router pads every expert's count to the alignment (pad_routing_map): the
        # experts' Fp8Padding then finds them aligned (skip_routed_expert_padding).
        drop_kernels(ops.experts, FUSED_KERNELS["experts"])
    if capacity is not None:
        # preprocess returns before the count all-gather: no host synchronisation at all.
        ops.count_gather_bytes = 0.0
        ops.host_sync = "no_sync"
    if opts.moe_expert_rank_capacity_factor is not None:
        ops.host_sync = "no_sync"   # HybridEP's rank budget: the counts stay on the device
    cost = {b.name.removeprefix("moe_"): price_block(b, STYLE, cm) for b in ops.blocks}
    if opts.moe_paged_stash:
        cost["experts"] = with_stash_copies(cost["experts"], cm)
    gathered = 0.0
    if opts.moe_token_dispatcher_type == "allgather":
        ag = allgather_blocks(ctx.model, lay, local_tokens, sum(ops.tokens_per_expert))
        gathered = ag.gathered
        del cost["combine"]
        for name, b in (("router", ag.router), ("ag_permute", ag.permute),
                        ("ag_combine", ag.combine), ("ag_cast", ag.cast)):
            cost[name] = price_block(b, STYLE, cm)
    overlap = opts.moe_shared_expert_overlap and ops.shared is not None
    plan = MoEPlan(model=ctx.model, ep=ep, etp=etp, edp=ctx.n_ranks // (etp * ep * pp), p=pp,
                   ops=ops, cost=cost, act=2, precision=ctx.scenario.training.precision,
                   # Padded inputs: every size is fixed by capacity, whatever the routing.
                   pace=None if capacity is not None
                   else routing_pace(ctx, lay, local_tokens, cm, drop),
                   dispatcher=opts.moe_token_dispatcher_type, capacity=capacity,
                   useful=1.0 if capacity is None
                   else min(1.0, local_tokens * moe.top_k / (moe.experts * capacity)),
                   gathered=gathered, shared_overlap=overlap,
                   amax_gather=ctx.scenario.training.precision == "fp8"
                   and amax_reductions(opts.fp8_recipe, True), aux_reduce=aux_reduce,
                   host=megatron_host_calls(ctx, lay),
                   shared_fc1=shared_fc1_part(ops.shared, cm)
                   if overlap and ops.shared is not None else None,
                   # (the budget needs the fuser, which runs at expert-TP 1 only)
                   expert_held=held_scale(opts, local_tokens, moe.top_k,
                                          sum(ops.tokens_per_expert)))
    if opts.moe_token_dispatcher_type == "flex":   # skew: its own pace (moe_flex_skew)
        make = hybridep_plan if opts.moe_flex_dispatcher_backend == "hybridep" else flex_plan
        fx = make(ctx, [plan.tp_ep_groups(st) for st in range(pp)], local_tokens)
        plan = replace(plan, flex=fx, pace=None if fx.skew is None
                       else flex_pace(ctx, lay, local_tokens, cm, fx.skew))
    return replace(plan, ranks=rank_experts(ctx, lay, local_tokens, cm, plan.pace))
