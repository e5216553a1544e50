"""torchtitan's mixture-of-experts layers under FSDP2, with expert parallelism.

Source: torchtitan v0.2.2 (``73a0e69``, 2026-02): ``torchtitan/models/moe/moe.py`` (``MoE``,
``TokenChoiceTopKRouter``, ``GroupedExperts``), ``torchtitan/distributed/expert_parallel.py``
(``ExpertParallel``), ``torchtitan/models/llama4/infra/parallelize.py`` (``apply_fsdp``,
``apply_moe_ep_tp``, which Qwen3 and DeepSeek-V3 reuse) and
``torchtitan/distributed/parallel_dims.py`` (the sparse mesh, :mod:`.mesh`).

One MoE layer's forward on one rank, all on the compute stream (the functional collectives
are waited for by the next op that reads them):

1. ``ffn_norm``, then the router (gate linear, softmax or sigmoid in fp32, top-k, the token
   count ``histc``) and the reorderer (``argsort`` by expert, the gather of each token once
   per chosen expert): the ``router`` block of :func:`sim.workload.moe_ops.moe_layer_ops`,
   with PyTorch's unfused ops (no Transformer Engine router fusion) and no auxiliary loss
   (torchtitan balances with the expert bias instead, ``load_balance_coeff``); with
   ``score_before_experts`` the routed rows are scaled by their scores in fp32
   (:func:`.moe_blocks.score_block`);
2. ``ExpertParallel._token_dispatch``: an all-to-all of the per-expert token counts over the
   EP group, then ``output_splits.to("cpu", non_blocking=False)``: the host waits for the
   counts ("this would incur a device-to-host sync"); then the dispatch all-to-all of the
   tokens with those uneven splits (``all_to_all_single_autograd``), and ``_permute`` into
   local-expert order, each expert's rows padded to ``TOKEN_GROUP_ALIGN_SIZE_M`` (8 rows in
   bf16, ``torchtitan/models/moe/utils.py``);
3. ``GroupedExperts``: ``torch._grouped_mm`` for w1 and w3, SiLU-gate, w2 over the local
   experts (the ``experts`` block; :mod:`sim.workload.grouped_gemm` prices the GEMMs);
4. ``_token_combine``: ``_unpermute`` and the combine all-to-all back (the reverse splits);
5. the shared experts (a dense FeedForward on every token, after the routed ones: "to
   implicitly overlap the shared expert compute with token combine communication"), the
   unsort and top-k sum or fp32 score-weighted ``bmm`` (:func:`.moe_blocks.combine_block`),
   the residual add.

Backward runs it in reverse: each all-to-all's gradient is the reverse all-to-all (no count
exchange and no host sync: the splits are kept). No probs travel: torchtitan weights the tokens
by their scores before the dispatch or after the combine (``score_before_experts``).

FSDP (``apply_fsdp``): with ``ep > 1`` each MoE block's routed experts are their own
``fully_shard`` unit over the ``efsdp`` mesh (with ``dp_replicate`` under HSDP), while the
block (attention, norms, router, shared experts) is sharded over ``dp_shard x cp`` as a dense
block. So expert parameters, gradients and AdamW states are split ``ep x efsdp`` ways, the
others ``dp_shard x cp`` ways; expert gradients are reduce-scattered over ``efsdp`` only
(:mod:`.reduce`). With ``ep > 1`` torchtitan sets explicit prefetching, "as D2H syncs in EP
could interfere with implicit prefetching in FSDP": each block's pre-forward all-gathers the
next block and its experts (and the same backwards), :mod:`.passes`. When ``efsdp * ep`` exceeds
the number of experts the experts are sharded on dim 1 instead (``shard_placement_fn``): the
same bytes. Without EP the experts stay inside the block's unit.

Load balancing (``build_optimizers_with_moe_load_balancing``, ``components/optimizer.py``):
before each optimizer step the per-layer expert token counts (fp32, one row of ``experts`` per
MoE layer) are all-reduced over the loss mesh (``dp_replicate x dp_shard x cp``) to update the
expert biases.

Routing: balanced, or skewed by ``training.routing``: the busiest EP rank's experts set the
pace and the all-to-alls carry per-peer bytes (the same rule as Megatron's:
:func:`sim.frameworks.common.moe_pace.routing_pace`, :class:`MoEPlan.peer_bytes`); after the
build each distinct EP load gets its own rank class with its own expert GEMM time, FLOPs and
saved activations (:func:`split_moe_ranks`, :mod:`sim.frameworks.common.moe_ranks`, up to
its class limit). The
skewed experts are priced on their routed rows as Megatron's (no ``TOKEN_GROUP_ALIGN_SIZE_M``
padding, at most 7 rows per expert).

Tensor parallelism (``apply_moe_ep_tp`` with expert TP 1): the MoE module's input is
all-gathered over tp and its Partial output (routed and shared experts) reduce-scattered,
the router gate is replicated, the shared experts are column/row-parallel, and
``ReordererSequenceParallel`` splits the routed tokens over the tensor-parallel ranks, which EP
borrows (ep a multiple of tp; ``efsdp = dp_shard x cp x tp / ep``). torchtitan's DeepEP
path (v0.2.2 and the commits before the token dispatcher of 2026-04, ``DeepEPMoE``) sets its
``reorderer`` to None, so the plan's ``ReordererSequenceParallel`` finds nothing to split:
every tensor-parallel rank routes and dispatches all the gathered tokens (``tp`` copies of
each reach the experts) and the reduce-scatter sums the copies (:attr:`TitanMoE.tp_copies`).
Context parallelism:
each rank routes its own sequence shard, and EP borrows cp ranks after the tensor-parallel
ones. Pipeline parallelism composes: each stage's experts accumulate and reduce like its other
units. Modelled with 16-bit precision; the MoE
kernels are priced eagerly (with ``compile`` only the rest of the block is fused). Megatron's
grouped fc1 (gate and up together) stands for torchtitan's two grouped GEMMs (w1, w3): the same
FLOPs and bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sim.frameworks.common.base import JobContext
from sim.frameworks.common.moe_pace import routing_pace
from sim.frameworks.common.moe_ranks import (
    RankExperts,
    patch_expert_memory,
    patch_experts,
    rank_experts,
    split_by_load,
)
from sim.frameworks.common.nccl_dtype import element_type
from sim.frameworks.fsdp2.moe_blocks import combine_block, score_block
from sim.frameworks.fsdp2.tp_pass import TitanPass
from sim.frameworks.megatron.moe_flex import (
    attach_flex,
    deepep_plan,
    drop_chunk_sorts,
    flex_op,
)
from sim.frameworks.megatron.moe_flex_skew import flex_pace
from sim.frameworks.megatron.moe_plan import MoEPlan
from sim.hardware.compute import ComputeModel
from sim.program.ir import CollectiveOp, NcclType, Op, Phase, Program, RankClass
from sim.program.mesh import Groups, RankMesh
from sim.scenario import Fsdp2Options
from sim.workload.block_pricing import BlockCost, price_block
from sim.workload.kernels import Style
from sim.workload.layer_builder import _Builder
from sim.workload.layer_ops import BF16, FP32
from sim.workload.model import ModelSpec
from sim.workload.moe_ops import (
    MXFP8_ALIGN,
    STYLE,
    MoELayout,
    balanced_tokens_per_expert,
    moe_layer_ops,
    shared_experts_block,
)

TOKEN_GROUP_ALIGN_SIZE_M = 8
"""Rows each expert's group is padded to for ``torch._grouped_mm`` in bf16
(``torchtitan/models/moe/utils.py``: "for bf16, 8 is enough (16 byte alignment / 2 bytes per
elem)")."""
MXFP8_GROUP_ALIGNMENT_SIZE = MXFP8_ALIGN
"""The same for MXFP8 grouped GEMMs (``torchtitan/components/quantization/mx.py``: "token
group sizes must be multiples of 32", one scale block): Transformer Engine's MXFP8 alignment,
the same block."""
COUNT_BYTES = 8
"""The per-expert token counts exchanged before the dispatch: int64 (``torch.histc`` of the
int64 expert indices keeps their dtype)."""


def _aligned(counts: tuple[float, ...], a: int = TOKEN_GROUP_ALIGN_SIZE_M
             ) -> tuple[float, ...]:
    """Each local expert's rows padded up to ``a`` (``generate_permute_indices``).

    >>> _aligned((8192.0, 5.0, 0.0))
    (8192.0, 8.0, 0.0)
    >>> _aligned((8200.0,), MXFP8_GROUP_ALIGNMENT_SIZE)
    (8224.0,)
    """
    return tuple(float(-(-c // a) * a) for c in counts)


def _around_blocks(m: ModelSpec, style: Style, tokens: float
                   ) -> tuple[_Builder, _Builder]:
    """What an MoE layer adds around the MoE module: ``ffn_norm`` (with the residual stream's
    gradient sum, as the dense MLP block has it) and the residual add."""
    h = m.hidden
    pre = _Builder("moe_norm", style)
    x = pre.t("in", tokens * h, style.act_bytes)
    pre.block.inputs.append(x)
    pre.sum_grads(2, tokens * h, style.act_bytes, "resid_in")
    pre.block.outputs.append(pre.norm(m, x, tokens, "norm"))
    post = _Builder("moe_resid", style)
    a = post.t("in", tokens * h, style.act_bytes)
    o = post.t("moe_out", tokens * h, BF16)
    post.block.inputs.append(a)
    post.block.outputs.append(post.residual_add(a, o, tokens, h, "resid"))
    return pre, post


@dataclass(frozen=True)
class TitanMoE:
    """The MoE layers of an FSDP2 job: one layer's priced ops on one rank and its sizes."""

    plan: MoEPlan
    """The layer's ops, costs and routing pace (the type Megatron's builder uses too; its
    Megatron process groups are not used here)."""
    norm: BlockCost
    resid: BlockCost
    combine: BlockCost
    """Unsort and top-k reduction of the combined tokens (:mod:`.moe_blocks`)."""
    score: BlockCost | None
    """The scores applied before the dispatch (``score_before_experts``), else None."""
    efsdp: int
    """FSDP size of the routed experts' units (dp_shard x cp x tp / ep)."""
    loss_ranks: int
    """Ranks of the load-balancing all-reduce (dp_replicate x dp_shard x cp)."""
    tp: int = 1
    """Tensor parallelism: EP borrows the tensor-parallel ranks and each routes 1/tp of
    the micro-batch's tokens (``ReordererSequenceParallel``)."""
    tp_copies: bool = False
    """Every tensor-parallel rank routes all the gathered tokens (torchtitan's DeepEP path,
    which has no reorderer to split them): the routed part is done ``tp`` times over."""
    cp: int = 1
    """Context parallelism: each rank holds (and routes) seq / cp of every sequence."""
    resident_experts: bool = False
    """The routed experts stay outside FSDP (NeMo AutoModel's ``apply_fsdp`` when EP and
    pipeline stages already shard them fully, ``efsdp`` 1: the block's ``ignored_params``):
    no gathers or reduces, their bf16 gradients accumulated in place each micro-batch."""
    grad_accumulate_s: float = 0.0
    """With resident experts: autograd's in-place add of a micro-batch's expert gradients
    into ``.grad`` (after the step's first micro-batch)."""

    @property
    def ep(self) -> int:
        return self.plan.ep

    def is_moe(self, layer: int) -> bool:
        return self.plan.is_moe(layer)

    @property
    def split_experts(self) -> bool:
        """Whether the routed experts are their own FSDP unit (``ep > 1``)."""
        return self.plan.ep > 1

    @property
    def expert_numel(self) -> int:
        """Routed-expert parameters of one layer on one rank (``experts / ep`` of them)."""
        return int(self.plan.expert_params)

    @property
    def dense_numel(self) -> int:
        """The MoE layer's other parameters beside the attention block: ``ffn_norm``, the
        router gate and the shared experts."""
        return int(self.plan.dense_params + self.norm.params)

    def blocks(self) -> dict[str, BlockCost]:
        """Every priced part of the layer in forward order (``experts``: the busiest rank's)."""
        c = self.plan.cost
        out = {"norm": self.norm, "router": c["router"]}
        if self.score is not None:
            out["score"] = self.score
        out.update(experts=self.plan.experts_cost, combine=self.combine)
        if "shared" in c:
            out["shared"] = c["shared"]
        out["resid"] = self.resid
        return out

    @property
    def flops_fwd(self) -> float:
        """Forward FLOPs of one MoE layer over one whole micro-batch, as the hardware runs
        them (each rank's MoE part over its 1/(tp x cp) of the tokens, or with
        :attr:`tp_copies` its routed part over all of them, ``tp`` times over; norm and
        residual over a cp shard)."""
        return sum(c.flops_fwd * (1 if k in ("norm", "resid") else self.tp)
                   for k, c in self.blocks().items()) * self.cp

    @property
    def balance_bytes(self) -> float:
        """Bytes of one layer's row in the expert-bias all-reduce (fp32 counts)."""
        assert self.plan.model.moe is not None
        return float(FP32 * self.plan.model.moe.experts)


def titan_moe(ctx: JobContext, style: Style, ep: int, efsdp: int, loss_ranks: int,
              ep_groups: Sequence[Groups], tp: int = 1, cp: int = 1,
              score_before: bool = True) -> TitanMoE | None:
    """The MoE layers' plan of an FSDP2 job (None for a dense model). With tensor
    parallelism each rank routes ``1 / tp`` of the micro-batch's tokens
    (``ReordererSequenceParallel``: EP borrows the tensor-parallel ranks, expert TP 1); its
    router is priced on those tokens too, though torchtitan scores every token of the
    all-gathered input on each tensor-parallel rank (``NoParallel`` gate: a tokens x experts
    GEMM and top-k, small beside the permutation of tokens x top-k rows that is split), and
    its shared experts are column/row-parallel over ``tp`` on all the tokens. With context
    parallelism each rank routes its own ``seq / cp`` tokens (EP borrows cp ranks after the
    tensor-parallel ones: the sparse mesh's ``ep`` is innermost)."""
    m = ctx.model
    if m.moe is None:
        return None
    cm: ComputeModel = ctx.compute
    full = ctx.micro_batch * ctx.seq // cp
    opts = ctx.scenario.framework
    assert isinstance(opts, Fsdp2Options)
    automodel = opts.model_code == "automodel"
    deepep = ep > 1 and comm_backend(opts) == "deepep"
    # torchtitan's DeepEP path has no reorderer: each TP rank routes every gathered token.
    tp_copies = deepep and tp > 1 and not automodel
    tokens = full if tp_copies else full // tp
    # DeepEP: AutoModel's copy of Megatron's flex dispatcher (moe_permute_fusion=True: TE's
    # fused permutations; grouped_gemm's one-kernel GEMMs, :mod:`.automodel`), or
    # torchtitan's (torchtitan/distributed/deepep/deepep.py: Megatron-Core's unfused
    # permutation, masked_select and index_select in, scatter_add_ out).
    mx = opts.grouped_mm_recipe == "mxfp8"
    lay = MoELayout(ep=ep, tp=tp, router_fusion=False, aux_loss=False, z_loss=False,
                    permute=("te" if automodel else "torch") if deepep else "plain",
                    eager_fc1_bias=automodel, torch_grouped_mm=not automodel, torchao_mx=mx)
    balanced = balanced_tokens_per_expert(tokens, m.moe.top_k, m.moe.experts, ep)
    align = MXFP8_GROUP_ALIGNMENT_SIZE if mx else TOKEN_GROUP_ALIGN_SIZE_M
    ops = moe_layer_ops(m, lay, tokens=tokens,
                        tokens_per_expert=balanced if deepep else _aligned(balanced, align),
                        recv_tokens=(sum(balanced) / ep,) * ep)
    if tp_copies and ops.shared is not None:
        # The shared experts stay column/row-parallel over the gathered tokens.
        ops.shared = shared_experts_block(m, lay, full // tp)
    if deepep:
        drop_chunk_sorts(ops)
    cost = {b.name.removeprefix("moe_"): price_block(b, STYLE, cm) for b in ops.blocks}
    pre, post = _around_blocks(m, style, full)
    flex = deepep_plan(ctx, ep_groups, tokens) if deepep else None
    pace = routing_pace(ctx, lay, tokens, cm) if flex is None or flex.skew is None \
        else flex_pace(ctx, lay, tokens, cm, flex.skew)
    plan = MoEPlan(model=m, ep=ep, etp=1, edp=efsdp, p=1, ops=ops, cost=cost, act=BF16,
                   precision=ctx.scenario.training.precision, pace=pace,
                   dispatcher="flex" if deepep else "alltoall", flex=flex,
                   ranks=rank_experts(ctx, lay, tokens, cm, pace))
    score = price_block(score_block(m, tokens), STYLE, cm) \
        if score_before and not deepep else None
    # DeepEP's path unpermutes and weights the rows itself (the layer's own combine block);
    # torchtitan's unsorts and sums them (:mod:`.moe_blocks`).
    combine = cost["combine"] if deepep else price_block(
        combine_block(m, tokens, full, score_before), STYLE, cm)
    # AutoModel's apply_fsdp leaves the experts out of FSDP when efsdp is 1 (ignored_params).
    resident = automodel and ep > 1 and efsdp == 1
    expert_grads = float(BF16 * plan.expert_params)
    return TitanMoE(plan=plan, norm=price_block(pre.finish(), style, cm),
                    resid=price_block(post.finish(), style, cm), combine=combine,
                    score=score, efsdp=efsdp, loss_ranks=loss_ranks, tp=tp, cp=cp,
                    tp_copies=tp_copies,
                    resident_experts=resident,
                    grad_accumulate_s=cm.membound_time(3 * expert_grads) if resident else 0.0)


def comm_backend(opts: Fsdp2Options) -> str:
    """``expert_parallel_comm_backend``, or the model code's own when unset: DeepEP for
    AutoModel's "TE + DeepEP" backend, torchtitan's standard all-to-alls otherwise."""
    if opts.expert_parallel_comm_backend is not None:
        return opts.expert_parallel_comm_backend
    return "deepep" if opts.model_code == "automodel" else "standard"


def split_moe_ranks(program: Program, moe: TitanMoE, sparse: RankMesh) -> bool:
    """Under skewed routing, one rank class per stage and EP load, each with its own expert
    GEMMs (:func:`sim.frameworks.common.moe_ranks.split_by_load`; the EP index is the rank's
    ``ep`` coordinate on torchtitan's sparse mesh); returns whether it split. The ops' times
    are :attr:`BlockCost.fwd_s` (GPU time bounded by the host's issue), as :class:`MoEPass`
    prices them."""
    ranks = moe.plan.ranks
    if len({r.counts for r in ranks}) <= 1:
        return False
    ep_of = {r: sparse.coords(r)["ep"] for c in program.classes for r in c.members}
    busiest = moe.plan.experts_cost

    def patch(cls: RankClass, load: RankExperts, _k: int) -> None:
        patch_experts(cls, load, gpu_time=False)
        # Its experts' saved tensors and working set at its own rows (the busiest's stay).
        patch_expert_memory(cls, load, busiest)

    return split_by_load(program, ep_of, ranks, patch)


@dataclass(frozen=True)
class MoEStep:
    """One MoE layer's ops for one micro-batch, in issue order, and the span of the routed
    experts' module (``moe.experts``, where ``ExpertParallel`` puts its hooks): FSDP2's hooks
    wrap the EP ones (``fully_shard`` prepends its pre-forward hook and appends its
    post-forward hook, and is applied after ``parallelize_module``), so the experts' unit is
    waited for before ``enter`` (forward: the count all-to-all; backward: the combine's
    reverse all-to-all) and resharded (in backward, reduced) after ``leave`` (the combine
    all-to-all; the dispatch's reverse one)."""

    ops: list[Op]
    enter: Op
    leave: Op


@dataclass
class MoEPass:
    """Lays out one stage's MoE layers: forward, recomputation and backward ops."""

    moe: TitanMoE
    ep_groups: Groups
    key: Callable[[str], str]
    recompute: bool
    attn: Callable[[int], BlockCost]
    """Each layer's attention block: full checkpointing recomputes it before the MoE."""
    grad_bytes: float
    """bf16 gradients the layer's non-expert MoE parameters produce (norm, router, shared)."""
    expert_grad_bytes: float
    titan: TitanPass | None = None
    """Tensor parallelism: torchtitan's blocks (:mod:`.tp_pass`) put the sequence-parallel
    norm, the all-gather before the MoE module and the reduce-scatter of its Partial
    output (routed and shared experts together) and the residual around the MoE ops."""

    def _compute(self, name: str, c: BlockCost, phase: Phase, mb: int, layer: int,
                 alloc: float = 0.0, free: float = 0.0, grads: float = 0.0) -> Op:
        fwd = phase != "bwd"
        model_flops = 0.0 if phase == "recompute" else (c.flops_fwd if fwd else c.flops_bwd)
        allocs: tuple[tuple[str, float], ...] = ()
        if alloc:
            allocs += (("activations", alloc),)
        if grads:
            allocs += (("gradients", grads),)
        return Op(name=name, kind="compute", stream="compute", phase=phase,
                  duration=c.fwd_s if fwd else c.bwd_s,
                  kernels=max(1, c.fwd_kernels if fwd else c.bwd_kernels), alloc=allocs,
                  free=(("activations", free),) if free else (),
                  transient=c.fwd_transient_bytes if fwd else c.bwd_transient_bytes,
                  layer=layer, micro_batch=mb, flops=model_flops,
                  hw_flops=c.flops_fwd if fwd else c.flops_bwd,
                  category={"fwd": "forward", "bwd": "backward"}.get(phase, "recompute"))

    def _a2a(self, which: str, label: str, mb: int, layer: int) -> Op | None:
        """One token all-to-all over the EP groups: ``nbytes`` is this rank's whole send
        buffer (its own chunk included, as nccl-tests counts it); with skewed routing the
        per-peer matrix."""
        pl = self.moe.plan
        if pl.ep == 1:
            return None
        if pl.flex is not None:       # DeepEP (AutoModel's, or torchtitan's deepep backend)
            return flex_op(self._coll, pl.flex, which, label, self.ep_groups, mb, layer)
        op = self._coll(f"{label} {which.replace('_', ' ')}", "all_to_all", self.ep_groups,
                        sum(pl.ops.alltoall[which].send_bytes),
                        element_type(pl.act, pl.precision), "ep", mb, layer)
        op.peer_bytes = pl.peer_bytes(which)
        return op

    def _coll(self, name: str, op: CollectiveOp, groups: Groups, nbytes: float,
              dtype: NcclType, prefix: str, mb: int, layer: int) -> Op:
        """A collective on the compute stream (the factory :func:`flex_op` calls)."""
        return Op(name=name, kind="collective", stream="compute", phase="comm", collective=op,
                  group=groups[0], groups=groups, nbytes=nbytes, dtype=dtype,
                  key=self.key(prefix), category=op, micro_batch=mb, layer=layer)

    def _counts(self, label: str, mb: int, layer: int) -> Op | None:
        """The all-to-all of the per-expert token counts, then the host's wait for them."""
        pl = self.moe.plan
        if pl.ep == 1:
            return None
        assert pl.model.moe is not None
        op = self._coll(f"{label} token count all_to_all", "all_to_all", self.ep_groups,
                        float(COUNT_BYTES * pl.model.moe.experts), "i64", "ep", mb, layer)
        op.host_sync = True
        return op

    def forward(self, mb: int, layer: int, phase: Phase = "fwd") -> MoEStep:
        """norm, router, counts (host sync), dispatch, experts, combine, shared, residual.
        Without checkpointing each part keeps what its backward reads; checkpointed, the
        forward keeps nothing (the layer input is the attention block's) and the
        recomputation keeps it all."""
        keep = not self.recompute or phase == "recompute"
        b = self.moe.blocks()
        label = f"{phase} moe L{layer} mb{mb}"

        def part(name: str) -> Op:
            c = b[name]
            return self._compute(f"{label} {name}", c, phase, mb, layer,
                                 alloc=c.saved_bytes if keep else 0.0)

        experts = part("experts")
        counts = self._counts(label, mb, layer)
        combine = self._a2a("combine_fwd", label, mb, layer)
        ops: list[Op | None] = [
            part("router"), part("score") if "score" in b else None, counts,
            self._a2a("dispatch_fwd", label, mb, layer), experts, combine]
        if "shared" in b:
            ops.append(part("shared"))
        ops.append(part("combine"))
        core = [o for o in ops if o is not None]
        if self.moe.plan.flex is not None:
            attach_flex(self.moe.plan.flex, core, False, label)
        if self.titan is not None:
            return MoEStep(self.titan.forward("mlp", layer, mb, phase, middle=core),
                           counts or experts, combine or experts)
        return MoEStep([part("norm"), *core, part("resid")], counts or experts,
                       combine or experts)

    def backward(self, mb: int, layer: int) -> MoEStep:
        """The forward reversed (after its recomputation under full checkpointing, itself
        after the attention block's): each part frees what it saved; the expert gradients
        exist after the experts' backward, the others after the norm's."""
        b = self.moe.blocks()
        label = f"bwd moe L{layer} mb{mb}"
        ops: list[Op | None] = []
        tp = self.titan
        if self.recompute and tp is not None:
            ops += tp.forward("attn", layer, mb, "recompute")
            ops += self.forward(mb, layer, "recompute").ops
        elif self.recompute:
            a = self.attn(layer)
            ops.append(Op(
                name=f"recompute attn L{layer} mb{mb}", kind="compute", stream="compute",
                phase="recompute", duration=a.fwd_s, kernels=a.fwd_kernels,
                alloc=(("activations", a.saved_bytes - a.input_saved_bytes
                        + a.weight_cast_bytes),),
                transient=a.fwd_transient_bytes, layer=layer, micro_batch=mb,
                hw_flops=a.flops_fwd, category="recompute"))
            ops += self.forward(mb, layer, "recompute").ops

        def part(name: str, grads: float = 0.0) -> Op:
            c = b[name]
            return self._compute(f"{label} {name}", c, "bwd", mb, layer, free=c.saved_bytes,
                                 grads=grads)

        resident = self.moe.resident_experts
        experts = part("experts", 0.0 if resident else self.expert_grad_bytes)
        core: list[Op | None] = [part("combine")]
        if "shared" in b:
            core.append(part("shared"))
        combine = self._a2a("combine_bwd", label, mb, layer)
        dispatch = self._a2a("dispatch_bwd", label, mb, layer)
        # The non-expert gradients exist after the norm's backward (the router's under
        # tensor parallelism, where the norm is torchtitan's segment).
        # Resident experts (outside FSDP): autograd adds this micro-batch's gradients into
        # their .grad in place, after the step's first micro-batch.
        acc = Op(name=f"{label} accumulate expert grads", kind="compute", stream="compute",
                 phase="bwd", duration=self.moe.grad_accumulate_s, layer=layer,
                 micro_batch=mb, category="copy") if resident and mb > 0 else None
        core += [combine, experts, acc, dispatch, part("score") if "score" in b else None,
                 part("router", self.grad_bytes if tp is not None else 0.0)]
        mid = [o for o in core if o is not None]
        if self.moe.plan.flex is not None:
            attach_flex(self.moe.plan.flex, mid, True, label)
        if tp is not None:
            ops += tp.backward("mlp", layer, mb, middle=mid)
        else:
            ops += [part("resid"), *mid, part("norm", self.grad_bytes)]
        return MoEStep([o for o in ops if o is not None], combine or experts,
                       dispatch or experts)
