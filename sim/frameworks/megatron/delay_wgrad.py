"""Megatron-Core's ``--delay-wgrad-compute`` in the combined 1F1B schedule.

Megatron-Bridge's performance scripts set it with ``moe_a2a_overlap``
(``set_moe_a2a_overlap_overrides``, scripts/performance/utils/helpers.py @ da98070). What it
does (NVIDIA/Megatron-LM @ d98e8a6, TransformerEngine @ d0067d0, 2026):

* Transformer Engine's linears get ``delay_wgrad_compute=True``
  (``megatron/core/extensions/transformer_engine.py``): their backward runs the dgrad GEMM and
  puts the wgrad GEMM with its operands (the output gradient and the saved input) in a
  ``WeightGradStore`` (``transformer_engine/pytorch/module/_common.py``; ``linear.py``,
  ``layernorm_linear.py``, ``grouped_linear.py``); ``backward_dw()`` (``module/base.py``) runs
  it later, then the gradient-accumulation and reduce hooks
  (``_trigger_wgrad_accumulation_and_reduce_hooks``: Megatron's DDP registers its grad-ready
  hook there, ``distributed_data_parallel.py``). Megatron's own linears (the output layer,
  ``ColumnParallelLinear.backward_dw`` "does nothing") and the router's gating GEMM (a plain
  autograd function) keep their wgrad in the backward, as does core attention.
* The schedule plan (``models/common/model_chunk_schedule_plan.py``,
  ``TransformerLayerSchedulePlan.run``; ``models/gpt/fine_grained_callables.py``
  ``build_transformer_layer_callables``) calls two ``backward_dw`` per backward layer on the
  compute stream, outside the chunk's event (``TransformerLayerNode.backward_dw``,
  ``models/common/utils.py``: no ``stream_acquire_context``, so the layer's next
  communication node does not wait for it):

  - the ``mlp`` node's (``MoELayer.backward_dw``: the routed experts' grouped fc2 then fc1;
    a dense layer's ``MLP.backward_dw``: fc2, fc1) right after the forward's dispatch is
    issued and before the backward's dispatch all-to-all: "comp_stream: ... mlp_bwd ->
    mlp_bwd_dw -> mlp_fwd", so the dispatch's reverse all-to-all starts after the experts'
    dgrad and runs beside their wgrad;
  - the ``pre_dispatch_computation`` node's (``_BackwardDWWrapper``: the shared experts'
    fc2, fc1, then the attention's linears, QKV then the output projection, MLA's down and up
    projections; an MTP layer adds ``eh_proj``) after the forward's ``mtp_post_process``, so
    the next layer's combine all-to-all, which waits only for the attention's dgrad, runs
    beside it. The chunk's first layer's (the backward's last) waits until after every layer
    and the pipeline sends ("Delay the last ... wgrad ... for overlapping with the p2p
    comm"), before the forward's output layer and the backward's embedding.

Here each backward unit's layers give up their delayed GEMMs' time, FLOPs and launches to one
new op per ``backward_dw`` call site (named ``... delayed wgrad``), which
:func:`sim.frameworks.megatron.a2a_overlap.issue_pair` issues where the plan does. The
GEMMs are priced by the compute model as the layer's own ``wgrad`` kernels are
(:mod:`sim.workload.layer_rules`, :mod:`sim.workload.grouped_gemm`), so the total is
unchanged. Memory: the store holds each GEMM's output gradient and, where the backward would
not have kept it, its input (the sequence-parallel re-gathered input) from the dgrad to the
delayed op; the saved inputs of the attention and shared experts, freed with the layer's
activations otherwise, are freed by the delayed op. The layer's data-parallel gradient hooks
move to it too (its gradients are ready then).

Not modelled: the experts' gradient hooks fire with the layer's, after the attention's delayed
wgrad, not right after theirs; the backward's pipeline send, which Megatron posts before the
chunk's first layer's delayed GEMMs, waits for them here (it waits for the whole pair, as
without the option); ``ep_overlap_early_attn_memory_release``; CUDA-graphed scopes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from sim.frameworks.common.base import JobContext
from sim.frameworks.common.moe_ranks import experts_op_name, is_expert_gemm
from sim.frameworks.megatron.a2a_overlap import LayerNodes, split_unit
from sim.frameworks.megatron.shape import MegatronShape
from sim.hardware.compute import ComputeModel
from sim.program.ir import Op, Program
from sim.workload.block_pricing import (
    extra_gemm_launches,
    extra_launches,
    kernel_time,
    launch_cpu_s,
)
from sim.workload.kernels import Block, Kernel
from sim.workload.megatron_mtp import mtp_proj_block
from sim.workload.megatron_ops import attention_key

if TYPE_CHECKING:
    from sim.frameworks.megatron.layer import UnitKey, UnitOps

KEY = "framework.delay_wgrad_compute"
CORE_BMM = frozenset({"qk_bmm", "pv_bmm"})
"""Core attention's GEMMs (the unfused path): autograd's, not a Transformer Engine linear's."""


def check_delay_wgrad(ctx: JobContext, s: MegatronShape) -> None:
    """Refuse what Megatron-Core and Transformer Engine refuse with ``delay_wgrad_compute``,
    one line naming the key: ``TransformerConfig.__post_init__`` ("overlap_moe_expert_
    parallel_comm must be enabled when enabling delay_wgrad_compute") and TE's
    ``WeightGradStore`` ("ub_bulk_wgrad is not supported when enabling delay_wgrad_compute":
    Megatron passes ``tp_comm_bulk_wgrad``, default on, whenever ``tp_comm_overlap`` is set).
    ``validate_args``' "only supported with transformer_engine implementation" is already
    the MoE layers' own refusal of ``implementation: local``."""
    o = s.opts
    ctx.require(o.moe_a2a_overlap, KEY,
                "overlap_moe_expert_parallel_comm must be enabled when enabling "
                "delay_wgrad_compute (framework.moe_a2a_overlap: true)")
    ctx.require(not (o.tp_comm_overlap and s.t > 1), KEY,
                "Transformer Engine's userbuffers bulk wgrad overlap (tp_comm_overlap) is not "
                "supported when enabling delay_wgrad_compute")


# ---------------------------------------------------------------------- prices
@dataclass(frozen=True)
class WgradPrice:
    """The delayed weight-gradient GEMMs of one block for one micro-batch."""

    seconds: float = 0.0
    flops: float = 0.0
    kernels: int = 0
    launches: int = 0
    """Launches beyond one per kernel (TE's grouped GEMM: one cuBLASLt GEMM per local expert,
    issued from C++: :func:`sim.workload.block_pricing.extra_launches`)."""
    gemm_launches: int = 0
    """Of ``launches``, the cuBLASLt GEMM calls
    (:func:`sim.workload.block_pricing.extra_gemm_launches`)."""
    held: float = 0.0
    """Bytes the store keeps from the dgrad to the delayed GEMMs that the backward would have
    dropped: output gradients and inputs that are not saved activations."""
    saved: float = 0.0
    """Bytes of saved activations the GEMMs read (freed by the delayed op)."""


def delayed_kernels(block: Block) -> list[Kernel]:
    """The block's backward GEMMs that Transformer Engine delays: its linears' wgrad."""
    return [k for k in block.backward if k.gemm is not None and k.gemm[3] == "wgrad"
            and k.name.split(".")[0] not in CORE_BMM]


def price(block: Block | None, cm: ComputeModel) -> WgradPrice:
    """GPU seconds, FLOPs and held bytes of ``block``'s delayed GEMMs."""
    if block is None:
        return WgradPrice()
    ks = delayed_kernels(block)
    saved = {id(t) for t in block.saved}
    # What a GEMM reads and also writes is the gradient it accumulates into (main_grad,
    # kernels.accumulating): persistent, not an operand the store holds.
    reads = {id(t): t for k in ks for t in k.reads if not any(t is w for w in k.writes)}
    return WgradPrice(seconds=sum(kernel_time(cm, k) for k in ks),
                      flops=sum(k.flops for k in ks), kernels=len(ks),
                      launches=extra_launches(ks), gemm_launches=extra_gemm_launches(ks),
                      held=sum(t.nbytes for i, t in reads.items() if i not in saved),
                      saved=sum(t.nbytes for i, t in reads.items() if i in saved))


def grouped_price(ks: list[Kernel], counts: tuple[int, ...], cm: ComputeModel) -> WgradPrice:
    """The experts' delayed grouped GEMMs ``ks`` repriced for an EP rank whose local experts
    get ``counts`` rows (a rank class of its own under skewed routing)."""
    rows = [float(c) for c in counts]
    total = sum(rows)
    sec = fl = 0.0
    for k in ks:
        assert k.gemm is not None
        sec += kernel_time(cm, replace(k, group=tuple(rows),
                                       gemm=(total, k.gemm[1], k.gemm[2], "wgrad")))
        fl += 2.0 * total * k.gemm[1] * k.gemm[2]
    return WgradPrice(seconds=sec, flops=fl, kernels=len(ks))


# ---------------------------------------------------------------------- the split
@dataclass
class LayerWgrad:
    """One backward layer's delayed ops, by the node whose ``backward_dw`` issues them."""

    mlp: list[Op] = field(default_factory=list)
    """``mlp.backward_dw``: the routed experts' (or the dense MLP's) GEMMs."""
    pre: list[Op] = field(default_factory=list)
    """``pre_dispatch_computation.backward_dw``: the shared experts', then the attention's."""


def _named(ops: list[Op], prefix: str) -> list[Op]:
    """The compute ops of one block: named ``prefix`` or ``prefix`` and a suffix."""
    return [o for o in ops if o.kind == "compute"
            and (o.name == prefix or o.name.startswith(prefix + " "))]


class WgradSplit:
    """Takes the delayed GEMMs out of a job's backward units (see the module docstring)."""

    def __init__(self, ctx: JobContext, s: MegatronShape, cpu_call: float) -> None:
        cm = ctx.compute
        self.s, self.cpu_call = s, cpu_call
        self.attn = {k: price(b, cm) for k, b in s.blocks.items()}
        self.proj = price(mtp_proj_block(s.model, s.lay, ctx.micro_batch, ctx.seq), cm) \
            if s.mtp is not None else WgradPrice()
        """An MTP layer's ``eh_proj`` (``build_mtp_layer_callables`` adds it to the
        pre_dispatch node's ``backward_dw``, after the attention's)."""
        pl = s.moe
        self.mlp = price(s.blocks.get("mlp_main"), cm)
        self.shared = self.experts = WgradPrice()
        self.useful = 1.0
        self.expert_kernels: list[Kernel] = []
        if pl is not None:
            ops = pl.pace.ops if pl.pace is not None else pl.ops
            self.shared = price(pl.ops.shared, cm)
            # The busiest EP rank's time and held bytes (every rank waits for it), the
            # balanced rows' FLOPs (the ranks' mean, as the experts' op counts them).
            self.experts = replace(price(ops.experts, cm),
                                   flops=price(pl.ops.experts, cm).flops)
            self.expert_kernels = delayed_kernels(ops.experts)
            self.useful = pl.useful

    def units(self, units: dict[UnitKey, UnitOps]) -> dict[UnitKey, dict[int, LayerWgrad]]:
        """Every backward unit's delayed ops, by layer; each layer's gradients are ready at
        its last delayed op (``part_op``, where the bucket hooks attach)."""
        out: dict[UnitKey, dict[int, LayerWgrad]] = {}
        for key, unit in units.items():
            if key[0] != "B":
                continue
            out[key] = mine = {}
            for n in split_unit(unit.ops, False)[1]:
                layer, mb = _layer_mb(n)
                mine[layer] = w = self.layer(n, layer, mb)
                if w.pre and layer in unit.part_op:
                    unit.part_op[layer] = w.pre[-1]
        return out

    def layer(self, n: LayerNodes, layer: int, mb: int) -> LayerWgrad:
        """Split one backward layer's nodes: the mlp node's GEMMs, then the pre node's."""
        s = self.s
        w = LayerWgrad()
        moe = s.moe is not None and s.moe.is_moe(layer)
        if moe:
            name = experts_op_name("bwd", layer, mb)
            src = [o for o in n.mlp if o.name == name]
            w.mlp += self._take(src, self.experts, name, self.useful)
        else:
            w.mlp += self._take(_named(n.mlp, f"bwd mlp L{layer} mb{mb}"), self.mlp,
                                f"bwd mlp L{layer} mb{mb}")
        if moe:
            name = f"bwd moe L{layer} mb{mb} shared experts"
            w.pre += self._take([o for o in n.pre if o.name == name], self.shared, name)
        label = f"bwd attn L{layer} mb{mb}"
        attn = self.attn[attention_key(s.model, layer, s.blocks)]
        src = _named(n.pre, label)
        w.pre += self._take(src, attn, label)
        # Their saved inputs are freed with the layer's activations, by the attention's
        # last op: that much now waits for the delayed GEMMs.
        _move_saved(src, w.pre, attn.saved + (self.shared.saved if moe else 0.0))
        if s.mtp is not None and layer in s.mtp.layers:
            label = f"bwd mtp proj L{layer} mb{mb}"
            src = [o for o in n.pre if o.name == label]
            w.pre += self._take(src, self.proj, label)
            _move_saved(src, w.pre, self.proj.saved)
        return w

    def _take(self, src: list[Op], p: WgradPrice, label: str, useful: float = 1.0
              ) -> list[Op]:
        """Move ``p`` out of the ops ``src`` into one new delayed op: the time first from a
        split-off ``... wgrad`` op (a column-parallel linear's under sequence parallelism),
        then from the longest ops (not a context-parallel ring step); model FLOPs (``useful``
        of them for padded expert rows), hardware FLOPs, launches and their host time with it.
        """
        if not src or p.kernels == 0:
            return []
        order = sorted((o for o in src if " cp step " not in o.name),
                       key=lambda o: (not o.name.endswith(" wgrad"), -o.duration))
        left = p.seconds
        for o in order:
            d = min(left, o.duration)
            o.duration -= d
            left -= d
        fl = _drain(src, "flops", p.flops * useful)
        hw = _drain(src, "hw_flops", p.flops)
        # The wgrads' Python calls and, for grouped linears, their per-expert launches.
        host = _drain(src, "cpu_s", p.kernels * self.cpu_call / 2
                      + launch_cpu_s(p.launches, p.gemm_launches))
        big = max(src, key=lambda o: o.kernels)
        n = min(p.kernels + p.launches, big.kernels - 1)
        big.kernels -= n
        first = src[0]
        op = Op(name=f"{label} delayed wgrad", kind="compute", stream="compute", phase="bwd",
                duration=p.seconds - left, cpu_s=host, kernels=max(1, n), flops=fl,
                hw_flops=hw, layer=first.layer, micro_batch=first.micro_batch,
                category="backward")
        if p.held:
            first.alloc = (*first.alloc, ("activations", p.held))
            op.free = (("activations", p.held),)
        return [op]



def _move_saved(src: list[Op], dw: list[Op], nbytes: float) -> None:
    """Move ``nbytes`` of the activation free on the last of the ops ``src`` that frees that
    much to the last delayed op ``dw`` (the saved inputs its GEMMs read)."""
    if not dw or nbytes <= 0:
        return
    for o in reversed(src):
        acts = [a for c, a in o.free if c == "activations"]
        if acts and acts[0] >= nbytes:
            rest = [(c, a) for c, a in o.free if c != "activations"]
            o.free = (*rest, ("activations", acts[0] - nbytes),
                      *[("activations", a) for a in acts[1:]])
            dw[-1].free = (*dw[-1].free, ("activations", nbytes))
            return


def _drain(src: list[Op], attr: str, amount: float) -> float:
    """Take up to ``amount`` of ``attr`` from the ops ``src`` in order; return what was."""
    left = amount
    for o in src:
        have = getattr(o, attr)
        d = min(left, have)
        if d > 0:
            setattr(o, attr, have - d)
            left -= d
    return amount - left


def _layer_mb(n: LayerNodes) -> tuple[int, int]:
    op = next(o for o in (*n.post, *n.combine, *n.mlp, *n.dispatch, *n.pre)
              if o.layer is not None)
    assert op.layer is not None
    return op.layer, op.micro_batch or 0


# ---------------------------------------------------------------------- skewed routing
def resplit_expert_classes(program: Program, s: MegatronShape, cm: ComputeModel,
                           split: WgradSplit) -> None:
    """After the rank classes by expert load are made (each class's expert GEMMs given its
    own load's whole backward, :func:`sim.frameworks.megatron.moe_ranks.split_expert_ranks`),
    take each class's own delayed share out of its experts' backward again."""
    pl = s.moe
    if pl is None or not pl.ranks or not split.expert_kernels:
        return
    for cls in program.classes:
        ep = pl.mesh.coords(cls.members[0]).get("ep", 0)
        p = grouped_price(split.expert_kernels, pl.ranks[ep].counts, cm)
        ops = {o.name: o for o in cls.streams.get("compute", [])}
        for name, dw in ops.items():
            main = ops.get(name.removesuffix(" delayed wgrad"))
            if main is None or main is dw or not is_expert_gemm(main):
                continue
            # patch_experts gave the experts' op its load's whole backward FLOPs, and its
            # load's time less what the build had delayed (the busiest's share, still on
            # ``dw``): give that back, then take the load's own share out.
            main.duration += dw.duration
            dw.duration = min(p.seconds, main.duration)
            main.duration -= dw.duration
            dw.flops = min(p.flops * split.useful, main.flops) if main.flops else 0.0
            main.flops -= dw.flops
            dw.hw_flops = min(p.flops, main.hw_flops) if main.hw_flops else 0.0
            main.hw_flops -= dw.hw_flops
