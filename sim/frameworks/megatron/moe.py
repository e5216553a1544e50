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
from it (:class:`~sim.frameworks.megatron.moe_plan.MoEPlan`). Expert parameters' gradients
are reduced over the expert-data-parallel group (``expt_dp``), the others over the usual
data-parallel group.

Routing: balanced by default; with a skewed ``training.routing`` every rank runs the busiest
EP rank's experts, the all-to-alls carry per-peer bytes (:mod:`.moe_pace`; ``flex``: per token,
:mod:`.moe_flex_skew`). ``alltoall`` without overlap by default; ``allgather``,
``moe_pad_expert_input_to_capacity`` and ``moe_shared_expert_overlap`` as
:mod:`sim.frameworks.megatron.moe_dispatch` describes; the dispatch buffers in memory as
:mod:`sim.frameworks.megatron.moe_memory` does; ``flex`` (DeepEP's fused, node-deduplicated
dispatch and combine over expert-TP x EP) as :mod:`sim.frameworks.megatron.moe_flex` does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sim.frameworks.common.nccl_dtype import element_type
from sim.frameworks.megatron.moe_flex import (
    attach_flex,
    flex_op,
)
from sim.frameworks.megatron.moe_host import (
    set_host,
    set_host_allgather,
)
from sim.frameworks.megatron.moe_hybridep import HybridEPPlan, hybridep_op
from sim.frameworks.megatron.moe_memory import attach_allgather, attach_alltoall
from sim.frameworks.megatron.moe_plan import MoEPlan
from sim.frameworks.megatron.overlap import TE_AMAX_BYTES, te_sp_gather_bytes
from sim.program.ir import CollectiveOp, NcclType, Op
from sim.program.mesh import Groups
from sim.workload.block_pricing import launch_cpu_s

AG_NAMES = {"ag_permute": "permute", "ag_combine": "unpermute"}
"""Op names of the allgather dispatcher's blocks around the experts."""


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
        if pl.flex is not None:
            groups = pl.tp_ep_groups(self.st)
            if isinstance(pl.flex, HybridEPPlan):
                return hybridep_op(self._coll, pl.flex, which, label, groups, mb, layer)
            return flex_op(self._coll, pl.flex, which, label, groups, mb, layer)
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
        if pl.etp == 1 or pl.flex is not None:   # flex: one group over expert-TP x EP
            return None
        return self._coll(f"{label} etp {op}", op, pl.etp_groups(self.st),
                          pl.etp_gather_bytes * pl.etp,
                          element_type(pl.act, pl.precision), "etp", mb, layer)

    def _shared(self, phase: str, label: str, mb: int, layer: int, flops: bool,
                part: str = "", after: Op | None = None) -> list[Op]:
        """The shared experts (a sequence-parallel TP MLP): gather, MLP, reduce-scatter; with
        ``part`` ``first`` / ``second`` only the half Megatron's overlap runs beside the
        first / second all-to-all (forward: gather + fc1, fc2 + reduce-scatter; backward:
        gather + fc2, fc1 + reduce-scatter), on the ``moe_shared`` stream after ``after``."""
        pl = self.plan
        c = pl.cost.get("shared")
        if c is None:
            return []
        bwd = phase == "bwd"
        dur = c.bwd_gpu_s if bwd else c.fwd_gpu_s
        n = c.bwd_kernels if bwd else c.fwd_kernels
        f = (c.flops_bwd if bwd else c.flops_fwd) if flops else 0.0
        name = "shared experts"
        if part:
            h = pl.shared_fc1
            assert h is not None
            # Forward runs fc1 first, backward fc2's gradient first.
            fc1_first = (part == "first") != bwd
            d1, n1 = (h.bwd_gpu_s, h.bwd_kernels) if bwd else (h.fwd_gpu_s, h.fwd_kernels)
            f1 = (h.flops_bwd if bwd else h.flops_fwd) if flops else 0.0
            dur, n, f = (d1, n1, f1) if fc1_first else (dur - d1, n - n1, f - f1)
            name = f"shared experts {'fc1' if fc1_first else 'fc2'}"
        mid = self._compute(f"{label} {name}", dur, phase, mb, layer, n, f)
        if not part:    # the overlap's halves keep their kernels' cost
            set_host(mid, pl.host, "shared", phase, self.cpu_call)
        out: list[Op] = [mid]
        if self.tp > 1:
            full = pl.ops.router.inputs[0].nbytes * self.tp   # the gathered [s, b, h]
            dt = element_type(pl.act, pl.precision)
            if part != "second":
                gather = self._coll(f"{label} shared all_gather", "all_gather",
                                    self.tp_groups, full, dt, "tp", mb, layer)
                if pl.precision == "fp8":
                    # TE quantizes fc1's input (forward) and fc2's output gradient (backward)
                    # before it gathers them, as for the dense MLP (te_sp_gather_bytes).
                    gather.nbytes = te_sp_gather_bytes(full, pl.act, True)
                    gather.dtype = "u8"
                out.insert(0, gather)
                if pl.amax_gather:
                    out.insert(0, self._coll(f"{label} shared amax all_reduce", "all_reduce",
                                             self.tp_groups, TE_AMAX_BYTES, "f32", "tp", mb,
                                             layer))
            if part != "first":
                out.append(self._coll(f"{label} shared reduce_scatter", "reduce_scatter",
                                      self.tp_groups, full, dt, "tp", mb, layer))
        if part:
            for o in out:
                o.stream = "moe_shared"
            out[0].deps = [after] if after is not None else []
        return out

    def _experts(self, label: str, phase: str, mb: int, layer: int) -> Op:
        """The grouped expert GEMMs (the busiest EP rank's under skewed routing); padded
        rows count as hardware FLOPs only."""
        pl, c = self.plan, self.plan.cost["experts"]
        bwd = phase == "bwd"
        f = 0.0 if phase == "recompute" else (c.flops_bwd if bwd else c.flops_fwd)
        op = self._compute(f"{label} experts",
                           pl.experts_cost.bwd_gpu_s if bwd else pl.experts_cost.fwd_gpu_s,
                           phase, mb, layer, c.bwd_kernels if bwd else c.fwd_kernels,
                           f * pl.useful)
        # TE GroupedLinear: one cuBLASLt GEMM an expert from C++ (multi_stream_cublas_gemm).
        extra = c.bwd_extra_launches if bwd else c.fwd_extra_launches
        gemm = c.bwd_extra_gemm_launches if bwd else c.fwd_extra_gemm_launches
        op.kernels += extra
        op.cpu_s += launch_cpu_s(extra, gemm)
        set_host(op, pl.host, "experts", phase, self.cpu_call, extra - gemm, gemm)
        if pl.useful < 1.0:
            op.hw_flops = c.flops_bwd if bwd else c.flops_fwd
        return op

    def _side(self, ops: list[Op | None], a2as: list[Op | None], phase: str, label: str,
              mb: int, layer: int, flops: bool, part: str) -> Op | None:
        """Append the all-to-alls ``a2as`` and, with the overlap, the shared-expert half beside
        them; return its last op (what the next routed-expert compute waits for), or None.

        The side stream waits for the compute stream just before the all-to-all
        (``wait_current_stream``); the host issues the forward's sequence-parallel gather
        before it (``pre_forward_comm`` in ``dispatch_preprocess``) and the GEMMs after it
        (``linear_fc1_forward_and_act`` after the tokens' all-to-all, ``linear_fc2_forward``
        after the combine's; in backward after them too: "probs A2A -> tokens A2A -> shared
        experts fc1")."""
        if not self.plan.shared_overlap:
            ops += a2as
            return None
        last = next(o for o in reversed(ops) if o is not None)
        side = self._shared(phase, label, mb, layer, flops, part, last)
        n = 1 if (part == "first" and phase != "bwd" and side[0].kind == "collective") else 0
        ops += side[:n]
        ops += a2as
        ops += side[n:]
        return side[-1]

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
        set_host(router, pl.host, "router", phase, self.cpu_call)
        router.cpu_s += pre_cpu
        aux = None
        if pl.aux_reduce:   # on the default stream, before the dispatcher's preprocess
            n_experts = pl.model.moe.experts if pl.model.moe else 0
            aux = self._coll(f"{label} aux-loss count all_reduce", "all_reduce",
                             self.tp_groups, 8.0 * n_experts, "i64", "tp", mb, layer)
        if pl.dispatcher == "allgather":
            out = self._forward_allgather(router, phase, label, mb, layer)
            return out[:1] + [aux] + out[1:] if aux is not None else out
        ops: list[Op | None] = [router, aux]
        if pl.ep * pl.etp > 1 and pl.capacity is None:
            # HybridEP's metadata_preprocess all-gathers the routing map itself (its token
            # counts come from it): moe_hybridep.HybridEPPlan.routing_map_bytes.
            dtype: NcclType = "i64"
            per = pl.ops.count_gather_bytes
            if isinstance(pl.flex, HybridEPPlan):
                per, dtype = pl.flex.routing_map_bytes, "u8"
            count = self._coll(f"{label} token count all_gather", "all_gather",
                               pl.tp_ep_groups(self.st), per * pl.ep * pl.etp,
                               dtype, "ep", mb, layer)
            # MoEAlltoAllTokenDispatcher: with ep or expert-TP > 1 the split sizes must be on
            # the host before the all-to-all (cuda_sync_point "before_ep_alltoall"); with a
            # capacity factor (dropping) even before the permutation ("before_permutation_1",
            # after preprocess's count all-gather all the same).
            count.host_sync = pl.ops.host_sync in ("before_ep_alltoall", "before_permutation_1")
            ops.append(count)
        if not pl.shared_overlap:
            ops += self._shared(phase, label, mb, layer, not rec)
        first = self._side(ops, [self._a2a("dispatch_fwd", label, mb, layer)], phase, label,
                           mb, layer, not rec, "first")
        ops += [self._a2a("dispatch_probs_fwd", label, mb, layer),
                self._etp("all_gather", label, mb, layer)]
        experts = self._experts(label, phase, mb, layer)
        if first is not None:
            experts.deps = [first]      # the SMs: fc1 before the grouped GEMMs
        ops += [experts, self._etp("reduce_scatter", label, mb, layer)]
        second = self._side(ops, [self._a2a("combine_fwd", label, mb, layer)], phase, label,
                            mb, layer, not rec, "second")
        unperm = self._compute(f"{label} combine", c["combine"].fwd_gpu_s, phase, mb, layer,
                               c["combine"].fwd_kernels,
                               0.0 if rec else c["combine"].flops_fwd)
        set_host(unperm, pl.host, "combine", phase, self.cpu_call)
        if second is not None:
            unperm.deps = [second]      # get_output: the shared output is added here
        ops.append(unperm)
        out = [o for o in ops if o is not None]
        if pl.flex is not None:
            attach_flex(pl.flex, out, False, label)
        else:
            attach_alltoall(pl, out, False, label)
        return out

    def backward(self, mb: int, layer: int, pre_s: float, pre_cpu: float) -> list[Op]:
        """The forward reversed: unpermute's backward, combine's reverse all-to-all,
        expert-TP all-gather of the gradient, experts, reduce-scatter, the dispatch's
        reverse all-to-alls, shared experts, router and permutation, norm."""
        pl, c = self.plan, self.plan.cost
        label = f"bwd moe L{layer} mb{mb}"
        router = self._compute(f"{label} router", c["router"].bwd_gpu_s + pre_s, "bwd", mb,
                               layer, c["router"].bwd_kernels, c["router"].flops_bwd)
        set_host(router, pl.host, "router", "bwd", self.cpu_call)
        router.cpu_s += pre_cpu
        if pl.dispatcher == "allgather":
            return self._backward_allgather(router, label, mb, layer)
        ops: list[Op | None] = [
            self._compute(f"{label} combine", c["combine"].bwd_gpu_s, "bwd", mb, layer,
                          c["combine"].bwd_kernels, c["combine"].flops_bwd)]
        set_host(ops[0], pl.host, "combine", "bwd", self.cpu_call)  # type: ignore[arg-type]
        first = self._side(ops, [self._a2a("combine_bwd", label, mb, layer)], "bwd", label,
                           mb, layer, True, "first")
        ops.append(self._etp("all_gather", label, mb, layer))
        experts = self._experts(label, "bwd", mb, layer)
        if first is not None:
            experts.deps = [first]
        ops += [experts, self._etp("reduce_scatter", label, mb, layer)]
        second = self._side(ops, [self._a2a("dispatch_bwd", label, mb, layer),
                                  self._a2a("dispatch_probs_bwd", label, mb, layer)], "bwd",
                            label, mb, layer, True, "second")
        if second is not None:
            router.deps = [second]
        else:
            ops += self._shared("bwd", label, mb, layer, True)
        ops.append(router)
        out = [o for o in ops if o is not None]
        if pl.flex is not None:
            attach_flex(pl.flex, out, True, label)
        else:
            attach_alltoall(pl, out, True, label)
        return out

    # ------------------------------------------------------------------ allgather dispatcher
    def _tp_ep(self, name: str, op: CollectiveOp, per_rank: float, elem: int,
               dtype: NcclType, mb: int, layer: int) -> Op | None:
        """A collective of the allgather dispatcher over expert-TP x EP: ``per_rank``
        elements of ``elem`` bytes from each member (all-gather output / reduce-scatter
        input: that times the group size)."""
        pl = self.plan
        n = pl.ep * pl.etp
        if n == 1:
            return None
        return self._coll(name, op, pl.tp_ep_groups(self.st), per_rank * elem * n, dtype,
                          "ep", mb, layer)

    def _forward_allgather(self, router: Op, phase: str, label: str, mb: int, layer: int
                           ) -> list[Op]:
        """``MoEAllGatherTokenDispatcher``: router, shared experts, gathers of the routing
        map, probs and tokens (the host then waits for the local counts), permutation,
        experts, unpermutation, the reduce-scatter in the probs' dtype, the cast back."""
        pl, c = self.plan, self.plan.cost
        rec = phase == "recompute"
        t = pl.gathered / (pl.ep * pl.etp)
        e, h = pl.model.moe.experts if pl.model.moe else 0, pl.model.hidden
        act = element_type(pl.act, pl.precision)
        ops: list[Op | None] = [router, *self._shared(phase, label, mb, layer, not rec),
                                self._tp_ep(f"{label} ag routing_map all_gather",
                                            "all_gather", t * e, 1, "u8", mb, layer),
                                self._tp_ep(f"{label} ag probs all_gather", "all_gather",
                                            t * e, 4, "f32", mb, layer),
                                self._tp_ep(f"{label} ag tokens all_gather", "all_gather",
                                            t * h, pl.act, act, mb, layer)]
        # dispatch_postprocess: tokens_per_expert = local_map.sum(0).cpu() (blocking).
        next(o for o in reversed(ops) if o is not None).host_sync = True
        for name in ("ag_permute", "experts", "ag_combine"):
            ops.append(self._experts(label, phase, mb, layer) if name == "experts" else
                       self._compute(f"{label} {AG_NAMES[name]}",
                                     c[name].fwd_gpu_s, phase, mb, layer,
                                     c[name].fwd_kernels, 0.0))
        ops += [self._tp_ep(f"{label} ag output reduce_scatter", "reduce_scatter", t * h, 4,
                            "f32", mb, layer),
                self._compute(f"{label} combine", c["ag_cast"].fwd_gpu_s, phase, mb, layer,
                              c["ag_cast"].fwd_kernels,
                              0.0 if rec else c["ag_cast"].flops_fwd)]
        out = [o for o in ops if o is not None]
        set_host_allgather(out[1:], pl.host, phase, self.cpu_call)
        attach_allgather(pl, out, False, label)
        return out

    def _backward_allgather(self, router: Op, label: str, mb: int, layer: int) -> list[Op]:
        """The allgather dispatcher's backward: the cast's, the reduce-scatter's gradient
        all-gathered (fp32), unpermutation, experts, permutation, the tokens' and probs'
        gradients reduce-scattered, shared experts, router."""
        pl, c = self.plan, self.plan.cost
        t = pl.gathered / (pl.ep * pl.etp)
        e, h = pl.model.moe.experts if pl.model.moe else 0, pl.model.hidden
        ops: list[Op | None] = [
            self._compute(f"{label} combine", c["ag_cast"].bwd_gpu_s, "bwd", mb, layer,
                          c["ag_cast"].bwd_kernels, c["ag_cast"].flops_bwd),
            self._tp_ep(f"{label} ag output grad all_gather", "all_gather", t * h, 4, "f32",
                        mb, layer)]
        for name in ("ag_combine", "experts", "ag_permute"):
            ops.append(self._experts(label, "bwd", mb, layer) if name == "experts" else
                       self._compute(f"{label} {AG_NAMES[name]}",
                                     c[name].bwd_gpu_s, "bwd", mb, layer,
                                     c[name].bwd_kernels, 0.0))
        ops += [self._tp_ep(f"{label} ag tokens grad reduce_scatter", "reduce_scatter", t * h,
                            pl.act, element_type(pl.act, pl.precision), mb, layer),
                self._tp_ep(f"{label} ag probs grad reduce_scatter", "reduce_scatter", t * e,
                            4, "f32", mb, layer),
                *self._shared("bwd", label, mb, layer, True), router]
        out = [o for o in ops if o is not None]
        set_host_allgather(out[:-1], pl.host, "bwd", self.cpu_call)
        attach_allgather(pl, out, True, label)
        return out
