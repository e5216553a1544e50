"""DeepSpeed-MoE beside ZeRO stages 1 and 2: expert-parallel groups, the MoE layers' ops and
the expert parameter groups (DeepSpeed commit 38327e07).

Groups (``deepspeed/utils/groups.py``, ``_create_expert_and_data_parallel``): with
``ep_size`` = ``parallelism.ep``, the expert-parallel groups are ``ep`` adjacent ranks and the
expert-data-parallel groups the ranks ``ep`` apart (``use_data_before_expert_parallel_``
swaps them); dense parameters keep the whole world as their data-parallel group.

Parameters (``Experts`` marks its parameters ``allreduce=False`` with the group name;
``moe/utils.py`` ``split_params_into_different_moe_groups_for_optimizer``, called by
``engine.configure_moe_param_groups``): the expert parameters leave the dense parameter group
for MoE groups of at most 178,956,971 elements each. ``DeepSpeedZeroOptimizer``
(``zero/stage_1_and_2.py`` ``_configure_moe_settings``) flattens, pads
(``nccl_start_alignment_factor`` x group size) and partitions each MoE group over the
expert-data-parallel group, so expert weights, gradients and Adam states are split
``world / ep`` ways, the dense ones ``world`` ways.

Gradients: the ipg bucket takes dense and expert gradients alike; ``average_tensor`` sorts the
bucket's slices by process group (``use_multi_rank_bucket_allreduce``) and all-reduces the
dense slices over the world and the expert slices over the expert-data-parallel group.
The step: each parameter group's gradient norm is all-reduced over the world
(``get_grad_norm_direct``), each MoE group's once more over its expert-data-parallel group
(``_average_expert_grad_norms``); each group's 16-bit partition is all-gathered over its own
group (``all_gather_into_tensor_dp_groups``).

Layers: :mod:`.moe_blocks` prices the gate, experts and combine of one MoE layer; between
them the two ``_AllToAll`` calls (``all_to_all_single`` on the current stream) move the whole
capacity-padded [e, c, h] buffer, ``(ep - 1) / ep`` of it over the wire, whatever the
routing; their gradients are the same all-to-alls in backward. With ``drop_tokens: false``
the capacity is the busiest expert's load, all-reduced (MAX) over the EP group, and the host
reads it (``one_hot(..., num_classes=capacity)``) before the dispatch; under skewed
``training.routing`` that capacity, hence every buffer and expert GEMM, grows. Either way every EP
rank runs the same padded rows whatever its experts' load, so the ranks stay one class (no
per-load split as :mod:`sim.frameworks.common.moe_ranks` makes for Megatron and torchtitan,
whose grouped GEMMs take each rank's own rows). ZeRO-3 refuses
MoE (``engine.py``: "MoE not supported with Stage 3").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

from sim.frameworks.common.base import JobContext
from sim.frameworks.deepspeed.constants import NCCL_START_ALIGNMENT_FACTOR, W16, _pad
from sim.frameworks.deepspeed.emitter import _Emitter
from sim.frameworks.deepspeed.moe_blocks import STYLE, DsMoELayout, capacity, moe_blocks
from sim.frameworks.deepspeed.options import DeepSpeedMoE
from sim.frameworks.deepspeed.resolve import _Zero
from sim.program.ir import Op, Phase
from sim.program.mesh import Groups, RankMesh
from sim.workload.block_pricing import BlockCost, price_block
from sim.workload.model import ModelSpec
from sim.workload.routing import expert_loads, routing_shares

MOE_GROUP_MAX_ELEMENTS = 178_956_971
"""moe/utils.py split_params_into_different_moe_groups_for_optimizer max_group_size."""

Tensors = list[tuple[str, int, str, int]]


@dataclass(frozen=True)
class ParamGroup:
    """One optimizer parameter group as ``DeepSpeedZeroOptimizer`` holds it."""

    numel: int
    padded: int
    """Flat buffer elements (padded to 2 x the group's size)."""
    part: int
    """This rank's partition."""
    groups: Groups
    """Its data-parallel process groups (every replica's)."""
    expert: bool


def check_moe(ctx: JobContext, z: _Zero) -> None:
    """Refuse what DeepSpeed-MoE does not do, or this model of it does not cover yet."""
    m = ctx.model
    moe = m.moe
    assert moe is not None
    opts = ctx.scenario.framework.moe  # type: ignore[union-attr]
    ep = ctx.scenario.parallelism.ep
    ctx.require(ctx.n_ranks % ep == 0, "parallelism.ep",
                f"{ep} does not divide the {ctx.n_ranks} ranks (groups._ensure_divisibility)")
    ctx.require(z.stage != 3, "framework.zero_stage",
                "DeepSpeed does not support MoE with ZeRO stage 3 (engine.py: "
                "\"MoE not supported with Stage 3\"); use zero_stage 1 or 2")
    ctx.require(z.stage != 0, "framework.zero_stage",
                "DeepSpeed-MoE is modelled with ZeRO stage 1 or 2 (stage 0 not yet)")
    ctx.require(z.offload_opt == "none", "framework.offload_optimizer",
                "DeepSpeed-MoE is modelled without optimizer offload yet")
    ctx.require(z.contiguous, "framework.contiguous_gradients",
                "DeepSpeed asserts contiguous_gradients with MoE (_configure_moe_settings)")
    ctx.require(moe.router == "softmax", "model.router",
                "DeepSpeed's TopKGate is a softmax gate (no sigmoid router with bias)")
    ctx.require(moe.shared == 0, "model.shared_experts",
                "DeepSpeed-MoE has no shared experts (use framework.moe.use_residual for "
                "PR-MoE's dense branch)")
    ctx.require(ctx.scenario.parallelism.expert_tp == 1, "parallelism.etp",
                "DeepSpeed-MoE is modelled without expert tensor parallelism")
    ctx.require(not opts.use_tutel or moe.top_k == 1, "framework.moe.use_tutel",
                f"Tutel is used with top-1 gating only (MOELayer: gate.k == 1); the model "
                f"routes to {moe.top_k}")


def _layer_capacity(ctx: JobContext, opts: DeepSpeedMoE, tokens: int) -> int:
    """``c`` of every MoE layer: the capacity rule, or without ``drop_tokens`` the busiest
    expert's load on any rank of the EP group (every rank's tokens follow the scenario's
    ``training.routing``; top-1 caps it at the tokens)."""
    moe = ctx.model.moe
    assert moe is not None
    if opts.drop_tokens:
        c = capacity(tokens, moe.experts, moe.top_k, opts.capacity_factor, opts.min_capacity)
        # top1gating: torch.topk(mask, k=capacity, dim=0) over the tokens, and its assert.
        ctx.require(moe.top_k != 1 or (c <= tokens and tokens >= opts.min_capacity),
                    "framework.moe.capacity_factor",
                    f"top-1 capacity {c} exceeds the {tokens} tokens of a micro-batch")
        return c
    r = ctx.scenario.training.routing
    hist = r.histogram
    assert not isinstance(hist, str)        # the scenario's validator read the file
    if hist is not None:
        ctx.require(len(hist) == moe.experts, "training.routing.histogram",
                    f"{len(hist)} per-expert loads for the model's {moe.experts} experts")
    seed = r.seed if r.seed is not None else ctx.scenario.seed
    shares = routing_shares(moe.experts, r.distribution, r.s, hist, seed)
    return max(expert_loads(tokens, moe.top_k, shares))


def moe_tensors(m: ModelSpec, local: int, use_residual: bool) -> tuple[Tensors, set[str]]:
    """(name, numel, block, layer) of every parameter on one rank in ``model.parameters()``
    order, and the names of the expert parameters. An MoE layer's gate, residual MLP and
    norm are block ``mlp``; its local experts' weights block ``experts``."""
    assert m.moe is not None
    out: Tensors = []
    experts: set[str] = set()
    moe = m.moe
    for name, numel, block, layer in m.parameter_tensors():
        if layer < moe.first_k_dense or block != "mlp":
            out.append((name, numel, block, layer))
            continue
        if not name.endswith(".norm2"):
            continue       # the dense MLP's projections: replaced by the MoE layer's
        out.append((f"l{layer}.gate.wg", moe.experts * m.hidden, "mlp", layer))
        for i in range(local):
            n = f"l{layer}.experts.{i}"
            out.append((n, m.expert_params, "experts", layer))
            experts.add(n)
        if use_residual:
            out.append((f"l{layer}.residual_mlp", m.expert_params, "mlp", layer))
            out.append((f"l{layer}.coefficient", 2 * m.hidden + 2, "mlp", layer))
        out.append((name, numel, block, layer))
    return out, experts


@dataclass
class DsMoEPlan:
    """The expert layout of a DeepSpeed-MoE job and one MoE layer's priced blocks."""

    model: ModelSpec
    n: int
    ep: int
    lay: DsMoELayout
    drop_tokens: bool
    data_first: bool
    cost: dict[str, BlockCost]
    """``gate``, ``experts``, ``combine`` for one micro-batch."""
    tensors: Tensors
    expert_names: set[str]

    @property
    def edp(self) -> int:
        return self.n // self.ep

    def is_moe(self, layer: int) -> bool:
        assert self.model.moe is not None
        return layer >= self.model.moe.first_k_dense

    @cached_property
    def mesh(self) -> RankMesh:
        """``E + D``: EP peers adjacent (``D + E`` with use_data_before_expert_parallel_)."""
        if self.data_first:
            return RankMesh(("ep", "edp"), (self.ep, self.edp))
        return RankMesh(("edp", "ep"), (self.edp, self.ep))

    @property
    def ep_groups(self) -> Groups:
        return self.mesh.groups(["ep"])

    @property
    def edp_groups(self) -> Groups:
        return self.mesh.groups(["edp"])

    @property
    def a2a_bytes(self) -> float:
        """One rank's whole [e, c, h] send buffer (its own chunk included)."""
        assert self.model.moe is not None
        return float(self.model.moe.experts * self.lay.capacity * self.model.hidden * W16)

    @cached_property
    def param_groups(self) -> list[ParamGroup]:
        """The dense group, then the MoE groups of at most 178,956,971 elements."""
        world = (tuple(range(self.n)),)
        dense = sum(numel for name, numel, _, _ in self.tensors
                    if name not in self.expert_names)
        out = [_group(dense, self.n, world, False)]
        run = 0
        for name, numel, _, _ in self.tensors:
            if name not in self.expert_names:
                continue
            if run and run + numel > MOE_GROUP_MAX_ELEMENTS:
                out.append(_group(run, self.edp, self.edp_groups, True))
                run = 0
            run += numel
        if run:
            out.append(_group(run, self.edp, self.edp_groups, True))
        return out

    # ------------------------------------------------------------------ ops
    def _compute(self, name: str, c: BlockCost, phase: Phase, mb: int, layer: int,
                 model_flops: float, **kw: object) -> Op:
        bwd = phase == "bwd"
        return Op(name=name, kind="compute", stream="compute", phase=phase,
                  duration=c.bwd_s if bwd else c.fwd_s,
                  kernels=c.bwd_kernels if bwd else c.fwd_kernels,
                  hw_flops=c.flops_bwd if bwd else c.flops_fwd, flops=model_flops,
                  micro_batch=mb, layer=layer, category="backward" if bwd else "forward",
                  **kw)  # type: ignore[arg-type]

    def _flops(self, part: str) -> float:
        """Model FLOPs of one part's forward for one micro-batch: 2 x the parameters a token
        multiplies with (the top-k experts, not the capacity padding)."""
        m = self.model
        assert m.moe is not None
        s = self.lay.tokens
        if part == "experts":
            return 2.0 * m.moe.top_k * m.expert_params * s
        return 2.0 * self.cost[part].params * s

    def _a2a(self, e: _Emitter, label: str, mb: int, layer: int) -> None:
        if self.ep > 1:
            e.collective(label, "all_to_all", self.a2a_bytes, "compute",
                         groups=self.ep_groups, micro_batch=mb, layer=layer)

    def forward(self, e: _Emitter, mb: int, layer: int, mode: str = "fwd") -> None:
        """Gate and dispatch, all-to-all, experts, all-to-all, combine. ``mode``: ``fwd``
        (what autograd saves stays), ``ckpt`` (under activation checkpointing: nothing
        stays but the layer input) or ``recompute`` (the checkpoint's re-run before the
        backward, all-to-alls included; non-reentrant, it stops after the last saved
        tensor, the combine's inputs)."""
        label = f"{'recompute' if mode == 'recompute' else 'fwd'} moe L{layer} mb{mb}"
        phase: Phase = "recompute" if mode == "recompute" else "fwd"
        if not self.drop_tokens:
            # top-k gating without drop_tokens: capacity = max count, all-reduce MAX over
            # the EP group, read on the host (before the dispatch's one-hot).
            if self.ep > 1:
                e.collective(f"{label} capacity all_reduce max", "all_reduce", 8, "compute",
                             groups=self.ep_groups, dtype="i64", micro_batch=mb, layer=layer)
            e.host_wait(f"{label} capacity .item()", [e.last.get("compute")], phase=phase)
        for part, a2a in (("gate", "dispatch all_to_all"), ("experts", "combine all_to_all"),
                          ("combine", None)):
            c = self.cost[part]
            ckpt = mode == "ckpt"
            op = self._compute(f"{label} {part}", c, "fwd", mb, layer,
                               0.0 if mode == "recompute" else self._flops(part),
                               alloc=() if ckpt else (("activations", c.saved_bytes),),
                               transient=(c.fwd_transient_unsaved_bytes if ckpt
                                          else c.fwd_transient_bytes))
            if mode == "recompute":
                op.phase, op.category = "recompute", "recompute+backward"
                if part == "combine":
                    op.duration = c.early_stop_fwd_s
            e.add(op)
            if a2a is not None:
                self._a2a(e, f"{label} {a2a}", mb, layer)

    def backward(self, e: _Emitter, mb: int, layer: int, fresh: bool,
                 hook: Callable[[tuple[str, int]], None],
                 attn: BlockCost | None = None) -> None:
        """Combine, the combine all-to-all's gradient, experts (their gradients' hooks),
        the dispatch all-to-all's gradient, gate and norm (their hooks). ``attn``: under
        activation checkpointing, the layer's attention block, recomputed first with the
        MoE forward."""
        if attn is not None:
            e.add(Op(name=f"recompute attn L{layer} mb{mb}", kind="compute",
                     stream="compute", phase="recompute", duration=attn.fwd_s,
                     kernels=attn.fwd_kernels, hw_flops=attn.flops_fwd, micro_batch=mb,
                     layer=layer, category="recompute+backward",
                     alloc=(("activations", attn.saved_bytes - attn.input_saved_bytes
                             + attn.weight_cast_bytes),),
                     transient=attn.fwd_transient_bytes))
            self.forward(e, mb, layer, "recompute")
        label = f"bwd moe L{layer} mb{mb}"
        cm = e.cm
        for part, a2a, key in (("combine", "combine all_to_all", None),
                               ("experts", "dispatch all_to_all", ("experts", layer)),
                               ("gate", None, ("mlp", layer))):
            c = self.cost[part]
            g = W16 * c.params
            extra = 0.0 if fresh else cm.membound_time(3 * g)
            op = self._compute(f"{label} {part}", c, "bwd", mb, layer, 2 * self._flops(part),
                               free=(("activations", c.saved_bytes),),
                               alloc=(("gradients", g),) if fresh and g else (),
                               transient=c.bwd_transient_bytes + (0.0 if fresh else g))
            op.duration += extra
            e.add(op)
            if key is not None:
                hook(key)
            if a2a is not None:
                self._a2a(e, f"{label} {a2a}", mb, layer)

    def recompute_flops(self, attn: BlockCost) -> float:
        """Hardware FLOPs one MoE layer's checkpointed re-run adds per micro-batch: the
        attention's and the MoE blocks' forward (the convention of
        :meth:`~sim.frameworks.common.base.JobContext.layer_recompute_flops`)."""
        return attn.flops_fwd + sum(c.flops_fwd for c in self.cost.values())


def _group(numel: int, size: int, groups: Groups, expert: bool) -> ParamGroup:
    padded = _pad(numel, NCCL_START_ALIGNMENT_FACTOR * size)
    return ParamGroup(numel, padded, padded // size, groups, expert)


def moe_plan(ctx: JobContext, z: _Zero) -> DsMoEPlan:
    """Check the scenario and lay out its DeepSpeed-MoE layers."""
    check_moe(ctx, z)
    m = ctx.model
    assert m.moe is not None
    opts = ctx.scenario.framework.moe  # type: ignore[union-attr]
    ep = ctx.scenario.parallelism.ep
    tokens = ctx.micro_batch * ctx.seq
    lay = DsMoELayout(tokens=tokens, ep=ep, capacity=_layer_capacity(ctx, opts, tokens),
                      use_residual=opts.use_residual, use_tutel=opts.use_tutel)
    cost = {b.name.removeprefix("moe_"): price_block(b, STYLE, ctx.compute)
            for b in moe_blocks(m, lay)}
    tensors, experts = moe_tensors(m, m.moe.experts // ep, opts.use_residual)
    return DsMoEPlan(model=m, n=ctx.n_ranks, ep=ep, lay=lay, drop_tokens=opts.drop_tokens,
                     data_first=opts.use_data_before_expert_parallel, cost=cost,
                     tensors=tensors, expert_names=experts)
