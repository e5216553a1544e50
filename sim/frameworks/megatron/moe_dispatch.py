"""Megatron-Core's token-dispatch variants beside the plain ``alltoall`` path of
:mod:`sim.frameworks.megatron.moe`.

* **allgather** dispatcher (``token_dispatcher.py``, ``MoEAllGatherTokenDispatcher``): the
  router's output stays unpermuted; ``token_dispatch`` all-gathers the routing map (bool, under
  ``no_grad``), the probs (``moe_router_dtype``, fp32 here) and the hidden states (16-bit) over
  the expert-TP x EP group (``tp_ep_group``: "this allgather spans the communication domain of
  TP*EP"), so every rank holds ``tokens x etp x ep`` tokens; ``dispatch_postprocess`` slices
  the map and probs to the local experts, copies the per-expert counts to the host
  (``.cpu()``, a blocking copy) and permutes the gathered tokens routed to them;
  ``combine_preprocess`` unpermutes the expert output back into all gathered tokens
  (``restore_shape``: zeros where no local expert was chosen) and ``token_combine``
  reduce-scatters it over the same group *in the probs' dtype*
  (``hidden_states.to(self.local_probs.dtype)``, fp32 here) and casts it back. Backward: each
  all-gather's gradient is a reduce-scatter and the reduce-scatter's an all-gather (Megatron's
  ``gather_from_sequence_parallel_region`` / ``reduce_scatter_to_sequence_parallel_region``);
  the routing map has none.
* **Padding to capacity** (``moe_pad_expert_input_to_capacity`` with
  ``moe_expert_capacity_factor``): the router keeps exactly ``capacity`` tokens per expert
  (``moe_utils.apply_router_token_dropping`` with ``pad_to_capacity``), capacity =
  ``ceil(tokens x top_k / experts x factor)`` (``moe_utils.get_capacity``);
  ``MoEAlltoAllTokenDispatcher.preprocess`` then returns fixed counts (``capacity x tp x ep``
  rows per local expert) without the count all-gather or any host synchronisation, and the
  all-to-alls move ``experts x capacity`` rows whatever the routing.
* **Shared-expert overlap** (``moe_shared_expert_overlap``, ``SharedExpertMLP`` on its own
  CUDA stream): its sequence-parallel all-gather and fc1 run beside the dispatch all-to-all,
  its fc2 and reduce-scatter beside the combine all-to-all (``token_dispatch`` /
  ``token_combine`` of the alltoall dispatcher). The engine does not share SMs between two
  compute streams, so the routed experts (and the unpermutation) wait for the shared part
  before them: the overlap hides the shared expert behind communication only, as it does on a
  GPU whose SMs the grouped GEMMs fill.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from sim.frameworks.common.base import JobContext
from sim.hardware.compute import ComputeModel
from sim.workload.block_pricing import BlockCost, price_block
from sim.workload.kernels import BF16, FP32, Block, Kernel
from sim.workload.layer_builder import _Builder
from sim.workload.model import ModelSpec
from sim.workload.moe_ops import STYLE, MoELayout
from sim.workload.moe_router_ops import INT32, MASK, router_kernels


def expert_capacity(tokens: float, top_k: int, experts: int, factor: float) -> int:
    """Tokens one expert accepts from one rank (``moe_utils.get_capacity``, called by the
    dispatcher with ``num_tokens = tokens x top_k``).

    Examples
    --------
    >>> expert_capacity(4096, 2, 8, 1.0)       # Mixtral, 4,096 tokens on the rank
    1024
    >>> expert_capacity(4096, 8, 128, 1.25)    # ceil(256 x 1.25)
    320
    """
    return math.ceil(tokens * top_k / experts * factor)


@dataclass(frozen=True)
class AllGatherBlocks:
    """The allgather dispatcher's own kernels around the experts on one rank."""

    router: Block
    """Gate, routing, aux losses and counts: the alltoall path's router less its permutation
    (which runs after the gather here)."""
    permute: Block
    """The local experts' slice of the gathered map and probs, and the permutation of the
    gathered tokens routed to them."""
    combine: Block
    """Unpermutation into every gathered token and the cast to the probs' dtype."""
    cast: Block
    """The reduce-scattered output back to 16 bits (and the shared experts' output added)."""
    gathered: float
    """Tokens on the rank after the gather: ``tokens x etp x ep``."""


def allgather_blocks(m: ModelSpec, lay: MoELayout, tokens: float, rows: float
                     ) -> AllGatherBlocks:
    """The allgather dispatcher's kernels for ``tokens`` entering the layer on this rank and
    ``rows`` permuted rows (the local experts' tokens)."""
    assert m.moe is not None
    h, e = m.hidden, m.moe.experts
    local = e // lay.ep
    g = float(tokens) * lay.etp * lay.ep
    rb = router_kernels(m, lay, tokens)[0]
    router = rb.finish()

    pb = _Builder("moe_ag_permute", STYLE)
    gmap = pb.t("gathered_map", g * e, MASK)
    gprobs = pb.t("gathered_probs", g * e, FP32)
    pb.block.inputs += [pb.t("gathered_tokens", g * h, BF16), gprobs]
    lmap = pb.t("local_map", g * local, MASK)
    lprobs = pb.t("local_probs", g * local, FP32)
    # routing_map[:, local] and probs[:, local] (.contiguous()), then the counts summed.
    pb.fwd(Kernel("local_slice", "elementwise", (gmap, gprobs), (lmap, lprobs)))
    pb.fwd(Kernel("count_local", "elementwise", (lmap,), (pb.t("counts", local, 8),)))
    # permute (TE moe_permute, no probs): each gathered token routed to a local expert copied
    # once per such expert; row_id_map is [gathered, local experts]. Backward sums the rows'
    # gradient back into every gathered token (zeros for the others).
    rid = pb.t("row_id_map", g * local, INT32)
    pb.fwd(Kernel("permute", "elementwise", (pb.t("permute.gathered_rows", rows * h, BF16),
                                              lmap), (pb.t("permuted", rows * h, BF16), rid)))
    pb.bwd(Kernel("permute.bwd", "elementwise", (pb.t("g_permuted", rows * h, BF16), rid),
                  (pb.t("g_gathered_tokens", g * h, BF16),)))
    pb.save(rid)
    sel = pb.t("selected_probs", rows, FP32)
    pb.fwd(Kernel("probs_masked_select", "elementwise", (lprobs, lmap), (sel,)))
    g_sel = pb.t("g_selected_probs", rows, FP32)
    g_gprobs = pb.t("g_gathered_probs", g * e, FP32)
    # The probs' gradient scattered back into the dense [gathered, experts] (zeros elsewhere).
    pb.bwd(Kernel("probs_masked_select.bwd", "elementwise", (g_sel, lmap), (g_gprobs,)))
    pb.save(lmap)
    permute = pb.finish()

    cb = _Builder("moe_ag_combine", STYLE)
    x = cb.t("in", rows * h, BF16)
    cb.block.inputs.append(x)
    rid = cb.t("row_id_map", g * local, INT32)
    out = cb.t("unpermuted", g * h, BF16)
    cb.fwd(Kernel("unpermute", "elementwise", (x, rid), (out,)))
    out32 = cb.t("unpermuted_fp32", g * h, FP32)
    cb.fwd(Kernel("to_probs_dtype", "elementwise", (out,), (out32,)))
    g32 = cb.t("g_fp32", g * h, FP32)
    g16 = cb.t("g_unpermuted", g * h, BF16)
    cb.bwd(Kernel("to_probs_dtype.bwd", "elementwise", (g32,), (g16,)),
           Kernel("unpermute.bwd", "elementwise", (cb.t("unpermute.g_rows", rows * h, BF16),
                                                   rid), (cb.t("g_in", rows * h, BF16),)))
    combine = cb.finish()

    kb = _Builder("moe_ag_cast", STYLE)
    r32 = kb.t("scattered_fp32", tokens * h, FP32)
    kb.block.inputs.append(r32)
    y = kb.t("out", tokens * h, BF16)
    kb.fwd(Kernel("to_bf16", "elementwise", (r32,), (y,)))
    if m.moe.shared:
        s = kb.t("sum", tokens * h, BF16)
        kb.fwd(Kernel("add_shared", "elementwise", (y, kb.t("shared_out", tokens * h, BF16)),
                      (s,)))
        y = s
    kb.block.outputs.append(y)
    kb.bwd(Kernel("to_bf16.bwd", "elementwise", (kb.t("g_out", tokens * h, BF16),),
                  (kb.t("g_fp32", tokens * h, FP32),)))
    cast = kb.finish()
    return AllGatherBlocks(router=router, permute=permute, combine=combine, cast=cast,
                           gathered=g)


def shared_fc1_part(shared: Block, cm: ComputeModel) -> BlockCost:
    """The shared experts' fc1 and activation (forward) and activation and fc1 backward:
    the part Megatron runs beside the dispatch all-to-all; fc2 is the rest."""
    def fc1(k: Kernel) -> bool:
        return k.name.startswith(("fc1.", "bias_act"))
    fwd = [k for k in shared.forward if fc1(k)]
    bwd = [k for k in shared.backward if fc1(k)]
    part = replace(shared, forward=fwd, backward=bwd, flops_fwd=sum(k.flops for k in fwd),
                   flops_bwd=sum(k.flops for k in bwd))
    return price_block(part, STYLE, cm)


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
    # Transformer Engine GroupedLinear.__init__: "GroupedLinear doesn't support bias when
    # TP > 1" (v2.9 to v2.12): biased experts (GPT-OSS) need expert TP 1.
    ctx.require(not ctx.model.bias or ctx.scenario.parallelism.expert_tp == 1,
                "parallelism.etp", "experts with biases need etp 1 (Transformer Engine's "
                "GroupedLinear does not support bias when TP > 1)")
    ctx.require(k_inst == 1, "framework.num_distributed_optimizer_instances",
                "several distributed-optimizer instances are not modelled with experts yet")
