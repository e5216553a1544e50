"""Megatron-Core's mixture-of-experts layers: expert parallelism, its groups and its ops.

A layer with routed experts (``MoELayer``, ``megatron/core/transformer/moe/moe_layer.py``)
replaces the dense MLP; :func:`sim.workload.moe_ops.moe_layer_ops` gives its kernels on one
rank and the bytes of its all-to-alls, and this module lays them out as Megatron-Core runs
them with the ``alltoall`` token dispatcher (``token_dispatcher.py``,
``MoEAlltoAllTokenDispatcher``), all on the compute stream (the dispatcher's collectives are
issued on the current stream and block it):

* forward: [norm +] router (gate, top-k, aux loss, permutation); the token-count all-gather
  over expert-TP x EP and the host's wait for the counts (``preprocess``,
  ``cuda_sync_point``); the dispatch all-to-all of the tokens and of their probs over the EP
  group; the expert-TP all-gather; the grouped expert GEMMs; the expert-TP reduce-scatter;
  the combine all-to-all; the unpermutation (plus the shared experts' output);
* backward: the same in reverse, each all-to-all's gradient the reverse all-to-all, each
  expert-TP all-gather's gradient a reduce-scatter and the other way round.

**Parallel folding** (``parallel_state.initialize_model_parallel``, arXiv:2504.14960): the
attention keeps its ``tp-cp-dp-pp`` layout (Megatron-Core's decoder ``RankGenerator`` has
``ep=1``), and the experts get a second layout over the same ranks,
``RankGenerator(tp=etp, ep=ep, dp=world / (etp x ep x pp), pp=pp, cp=1)`` in the same order
``tp-cp-ep-dp-pp``: EP, expert-TP, their product and the expert-data-parallel groups come
from it (:class:`MoEPlan`). Expert parameters' gradients are reduced over the
expert-data-parallel group (``expt_dp``), the others over the usual data-parallel group.

Routing: balanced by default; with a skewed ``training.routing`` every rank runs the busiest
EP rank's experts and the all-to-alls carry per-peer bytes
(:mod:`sim.frameworks.common.moe_pace`). The ``alltoall`` dispatcher without
communication overlap, no shared-expert overlap.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

from sim.frameworks.common.base import JobContext
from sim.frameworks.common.moe_pace import Pace, routing_pace
from sim.frameworks.common.nccl_dtype import element_type
from sim.hardware.compute import ComputeModel
from sim.program.ir import CollectiveOp, NcclType, Op
from sim.program.mesh import Groups, RankMesh
from sim.scenario import MegatronOptions
from sim.workload.block_pricing import BlockCost, price_block
from sim.workload.model import ModelSpec
from sim.workload.moe_ops import STYLE, MoELayerOps, MoELayout, moe_layer_ops

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
        gradient go back the transposed way."""
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
        rank's experts)."""
        return sum((self.experts_cost if k == "experts" else c).saved_bytes
                   for k, c in self.cost.items())

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


def check_moe(ctx: JobContext, implementation: str, k_inst: int, sp: bool) -> None:
    """Refuse what this first cut of Megatron-Core's MoE path does not model."""
    t = ctx.scenario.parallelism.tp
    ctx.require(implementation == "transformer_engine", "framework.implementation",
                "mixture-of-experts layers are modelled with Transformer Engine's grouped "
                "GEMMs (implementation: transformer_engine)")
    # TransformerConfig.__post_init__: "When using MoE with expert parallelism and tensor
    # parallelism, sequence parallelism must be used"; the dispatcher then sees the
    # sequence-parallel shard.
    ctx.require(t == 1 or sp, "parallelism.sequence_parallel",
                "mixture-of-experts layers with tp > 1 need sequence parallelism "
                "(Megatron-Core TransformerConfig)")
    ctx.require(k_inst == 1, "framework.num_distributed_optimizer_instances",
                "several distributed-optimizer instances are not modelled with experts yet")


def moe_plan(ctx: JobContext, tp: int, pp: int, local_tokens: int, cm: ComputeModel,
             fp8: Literal["delayed", "tensorwise"] | None = None, weight_cast_share: float = 1.0
             ) -> MoEPlan:
    """The expert layout and one MoE layer's priced ops on one rank, whose ``local_tokens``
    (micro-batch x sequence / (cp x tp) with sequence parallelism) enter the router. With
    ``fp8`` the expert GEMMs run in FP8 as Transformer Engine's grouped linears do (the
    ``alltoall`` dispatch itself stays 16-bit)."""
    par = ctx.scenario.parallelism
    opts = ctx.scenario.framework
    assert isinstance(opts, MegatronOptions)
    ep, etp = par.ep, par.expert_tp
    lay = MoELayout(ep=ep, etp=etp, tp=tp, fp8=fp8, weight_cast_share=weight_cast_share,
                    router_fusion=opts.moe_router_fusion,
                    aux_loss=opts.moe_aux_loss_coeff > 0,
                    z_loss=opts.moe_z_loss_coeff is not None)
    ops = moe_layer_ops(ctx.model, lay, tokens=local_tokens)
    cost = {b.name.removeprefix("moe_"): price_block(b, STYLE, cm) for b in ops.blocks}
    return MoEPlan(model=ctx.model, ep=ep, etp=etp, edp=ctx.n_ranks // (etp * ep * pp), p=pp,
                   ops=ops, cost=cost, act=2, precision=ctx.scenario.training.precision,
                   pace=routing_pace(ctx, lay, local_tokens, cm))


@dataclass
class MoEOps:
    """Lays out one MoE layer's forward, recomputation or backward ops for one stage."""

    plan: MoEPlan
    st: int
    keys: Callable[[str], str]
    cpu_call: float
    tp_groups: Groups
    """The stage's attention tensor-parallel groups (the shared experts use them)."""
    tp: int

    def _compute(self, name: str, dur: float, phase: str, mb: int, layer: int,
                 kernels: int, flops: float = 0.0) -> Op:
        cat = {"fwd": "forward", "bwd": "backward"}.get(phase, phase)
        per_op = self.cpu_call if phase != "bwd" else self.cpu_call / 2
        return Op(name=name, kind="compute", stream="compute", phase=phase,  # type: ignore[arg-type]
                  duration=dur, micro_batch=mb, layer=layer, category=cat, flops=flops,
                  kernels=max(1, kernels), cpu_s=kernels * per_op)

    def _coll(self, name: str, op: CollectiveOp, groups: Groups, nbytes: float,
              dtype: NcclType, prefix: str, mb: int, layer: int) -> Op:
        return Op(name=name, kind="collective", stream="compute", phase="comm", collective=op,
                  group=groups[0], groups=groups, nbytes=nbytes, dtype=dtype,
                  key=self.keys(f"{prefix}/{self.st}"), category=op, micro_batch=mb,
                  layer=layer, cpu_s=self.cpu_call)

    def _a2a(self, which: str, label: str, mb: int, layer: int) -> Op | None:
        """One all-to-all over the EP groups: ``nbytes`` is this rank's whole send buffer
        (its own chunk included, as nccl-tests counts it; every source sends the same total,
        routing only changes where); with skewed routing the per-peer matrix."""
        pl = self.plan
        if pl.ep == 1:
            return None
        a = pl.ops.alltoall[which]
        elem = 4 if "probs" in which else pl.act
        op = self._coll(f"{label} {which.replace('_', ' ')}", "all_to_all",
                        pl.ep_groups(self.st), sum(a.send_bytes),
                        element_type(elem, pl.precision), "ep", mb, layer)
        op.peer_bytes = pl.peer_bytes(which)
        return op

    def _etp(self, op: CollectiveOp, label: str, mb: int, layer: int) -> Op | None:
        """The expert-TP all-gather of the dispatched tokens or reduce-scatter of the expert
        output (gathered size: every expert-TP rank's tokens)."""
        pl = self.plan
        if pl.etp == 1:
            return None
        return self._coll(f"{label} etp {op}", op, pl.etp_groups(self.st),
                          pl.etp_gather_bytes * pl.etp,
                          element_type(pl.act, pl.precision), "etp", mb, layer)

    def _shared(self, phase: str, label: str, mb: int, layer: int, flops: bool) -> list[Op]:
        """The shared experts (a sequence-parallel TP MLP): gather, MLP, reduce-scatter."""
        pl = self.plan
        c = pl.cost.get("shared")
        if c is None:
            return []
        bwd = phase == "bwd"
        dur = c.bwd_gpu_s if bwd else c.fwd_gpu_s
        n = c.bwd_kernels if bwd else c.fwd_kernels
        f = (c.flops_bwd if bwd else c.flops_fwd) if flops else 0.0
        mid = self._compute(f"{label} shared experts", dur, phase, mb, layer, n, f)
        if self.tp == 1:
            return [mid]
        full = pl.ops.router.inputs[0].nbytes * self.tp   # the gathered [s, b, h]
        dt = element_type(pl.act, pl.precision)
        return [self._coll(f"{label} shared all_gather", "all_gather", self.tp_groups, full,
                           dt, "tp", mb, layer), mid,
                self._coll(f"{label} shared reduce_scatter", "reduce_scatter", self.tp_groups,
                           full, dt, "tp", mb, layer)]

    def forward(self, phase: str, mb: int, layer: int, pre_s: float, pre_cpu: float
                ) -> list[Op]:
        """[norm +] router, count all-gather (the host waits for it), shared experts,
        dispatch, expert-TP gather, experts, expert-TP reduce-scatter, combine, unpermute."""
        pl, c = self.plan, self.plan.cost
        rec = phase == "recompute"
        label = f"{phase} moe L{layer} mb{mb}"
        router = self._compute(f"{label} router", pre_s + c["router"].fwd_gpu_s, phase, mb,
                               layer, c["router"].fwd_kernels,
                               0.0 if rec else c["router"].flops_fwd)
        router.cpu_s += pre_cpu
        ops: list[Op | None] = [router]
        if pl.ep * pl.etp > 1:
            count = self._coll(f"{label} token count all_gather", "all_gather",
                               pl.tp_ep_groups(self.st),
                               pl.ops.count_gather_bytes * pl.ep * pl.etp, "i64", "ep",
                               mb, layer)
            # MoEAlltoAllTokenDispatcher: with ep or expert-TP > 1 the split sizes must be on
            # the host before the all-to-all (cuda_sync_point "before_ep_alltoall").
            count.host_sync = pl.ops.host_sync == "before_ep_alltoall"
            ops.append(count)
        ops += self._shared(phase, label, mb, layer, not rec)
        ops += [self._a2a("dispatch_fwd", label, mb, layer),
                self._a2a("dispatch_probs_fwd", label, mb, layer),
                self._etp("all_gather", label, mb, layer),
                self._compute(f"{label} experts", pl.experts_cost.fwd_gpu_s, phase, mb, layer,
                              c["experts"].fwd_kernels, 0.0 if rec else c["experts"].flops_fwd),
                self._etp("reduce_scatter", label, mb, layer),
                self._a2a("combine_fwd", label, mb, layer),
                self._compute(f"{label} combine", c["combine"].fwd_gpu_s, phase, mb, layer,
                              c["combine"].fwd_kernels,
                              0.0 if rec else c["combine"].flops_fwd)]
        return [o for o in ops if o is not None]

    def backward(self, mb: int, layer: int, pre_s: float, pre_cpu: float) -> list[Op]:
        """The forward reversed: unpermute's backward, combine's reverse all-to-all,
        expert-TP all-gather of the gradient, experts, reduce-scatter, the dispatch's
        reverse all-to-alls, shared experts, router and permutation, norm."""
        c = self.plan.cost
        slow = self.plan.experts_cost
        label = f"bwd moe L{layer} mb{mb}"
        ops: list[Op | None] = [
            self._compute(f"{label} combine", c["combine"].bwd_gpu_s, "bwd", mb, layer,
                          c["combine"].bwd_kernels, c["combine"].flops_bwd),
            self._a2a("combine_bwd", label, mb, layer),
            self._etp("all_gather", label, mb, layer),
            self._compute(f"{label} experts", slow.bwd_gpu_s, "bwd", mb, layer,
                          c["experts"].bwd_kernels, c["experts"].flops_bwd),
            self._etp("reduce_scatter", label, mb, layer),
            self._a2a("dispatch_bwd", label, mb, layer),
            self._a2a("dispatch_probs_bwd", label, mb, layer)]
        ops += self._shared("bwd", label, mb, layer, True)
        router = self._compute(f"{label} router", c["router"].bwd_gpu_s + pre_s, "bwd", mb,
                               layer, c["router"].bwd_kernels, c["router"].flops_bwd)
        router.cpu_s += pre_cpu
        ops.append(router)
        return [o for o in ops if o is not None]
