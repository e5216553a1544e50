"""Megatron-Core's multi-token prediction (MTP) modules on the last pipeline stage.

DeepSeek-V3 (arXiv:2412.19437 section 2.2) predicts, besides the next token, the token
``k + 1`` places ahead with ``D`` sequential modules; Megatron-Core runs them as
``MultiTokenPredictionBlock`` (megatron/core/transformer/multi_token_prediction.py, the
``model.mtp_layers`` of a scenario = ``mtp_num_layers``). Without a custom pipeline layout
every module sits on the last pipeline stage and on its last model chunk
(``mtp_on_this_rank``, ``get_mtp_num_layers_to_build``). Per depth k and micro-batch:

* ``_get_embeddings``: the input ids rolled by one more place (``roll_tensor``; with context
  parallelism one token crosses to the neighbour rank: bytes, not modelled), looked up in the
  model's own embedding (``GPTModel`` builds ``self.embedding`` on the MTP stage too, so with
  pp > 1 the last stage holds a copy of the vocab-parallel table) and reduced over the
  tensor-parallel group like the first stage's embedding;
* ``_concat_embeddings``: ``enorm`` and ``hnorm`` (RMSNorms), the concatenation, ``eh_proj``
  (column-parallel 2h -> h: with sequence parallelism its 2h-wide input is gathered, and its
  h/tp output slices are all-gathered by ``gather_from_tensor_model_parallel_region``, then
  scattered back to the sequence shard; :func:`sim.workload.megatron_mtp.mtp_proj_block`);
* ``mtp_model_layer``: one transformer layer built from the decoder's layer spec (DeepSeek-V3:
  MLA and an MoE layer, so its router, dispatch and combine all-to-alls too), run here by the
  unit builder's own layer ops under layer number ``layers + k``;
* ``final_layernorm``, then ``process_mtp_loss``: the shared output layer and the
  vocab-parallel cross-entropy once more per depth (the ``head`` block again), whose loss
  ``MTPLossAutoScaler`` attaches to the main hidden state so one backward runs them all.

Backward runs the main head, the MTP heads, then each depth's layer and projection in reverse,
then the embedding copy's gradient; with full recomputation (``recompute_granularity full``,
``uniform``) ``_checkpointed_forward`` re-runs the projection and the layer before their
backward, and selective recomputation applies inside the layer as in the decoder's. The
embedding copy's gradient is all-reduced with the first stage's once per step
(``finalize_model_grads._allreduce_word_embedding_grads``: "If use Multi-Token Prediction
(MTP), we also need to maintain duplicated embedding weights in mtp process stage").
Parameters: the projection, the layer (its routed experts with the other experts, over the
expert-data-parallel group), the final norm and the embedding copy join the last stage's
``head`` part; its optimizer state, gradients and activations are counted there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from sim.hardware.compute import ComputeModel
from sim.program.ir import Op
from sim.workload.block_pricing import BlockCost, price_block
from sim.workload.megatron_mtp import mtp_proj_block
from sim.workload.megatron_ops import STYLE, MegatronLayout
from sim.workload.model import ModelSpec

if TYPE_CHECKING:
    from sim.frameworks.megatron.layer import UnitBuilder, UnitOps

# Python-level calls of one depth's projection (``_concat_embeddings``): enorm, hnorm, two
# make_viewless_tensor, cat, eh_proj, the tensor-parallel gather and the sequence scatter;
# as many autograd nodes in backward. The embedding and head calls are PYTHON_OPS' own.
PROJ_OPS = 8


@dataclass(frozen=True)
class MTPPlan:
    """The multi-token prediction modules of a Megatron job (see :func:`mtp_plan`)."""

    depths: int
    """``mtp_num_layers``: modules run one after another on the last stage."""
    first_layer: int
    """Layer number of the first module's transformer layer (the decoder's layer count)."""
    proj: BlockCost
    """One depth's enorm, hnorm, concatenation and ``eh_proj`` on one rank."""
    proj_flops: tuple[float, float]
    """(forward, backward) FLOPs of :attr:`proj`."""
    dense_params: float
    """One module's parameters on one tensor-parallel rank, routed experts excepted: the
    projection, the layer (attention, norms, router, shared experts or dense MLP) and the
    final norm."""
    expert_params: float
    """One module's routed-expert parameters on one rank (0 for a dense layer)."""
    embedding_copy: float
    """The vocab-parallel embedding table the last stage holds for the modules (pp > 1)."""

    @property
    def layers(self) -> range:
        """Layer numbers of the modules' transformer layers."""
        return range(self.first_layer, self.first_layer + self.depths)

    @property
    def stage_params(self) -> float:
        """What the modules add to the last stage's parameters (routed experts excepted)."""
        return self.depths * self.dense_params + self.embedding_copy


def mtp_plan(m: ModelSpec, lay: MegatronLayout, micro_batch: int, seq: int, cm: ComputeModel,
             p: int, layer_params: float, expert_params: float, emb_params: float
             ) -> MTPPlan | None:
    """The modules of ``m`` (None without any): ``layer_params`` and ``expert_params`` are
    one transformer layer's like the model's last (an MoE layer when it has experts), on one
    rank; ``emb_params`` the first stage's embedding on one rank."""
    if not m.mtp_layers:
        return None
    block = mtp_proj_block(m, lay, micro_batch, seq)
    return MTPPlan(depths=m.mtp_layers, first_layer=m.layers,
                   proj=price_block(block, STYLE, cm),
                   proj_flops=(block.flops_fwd, block.flops_bwd),
                   dense_params=block.params + layer_params + m.norm_params,
                   expert_params=expert_params,
                   embedding_copy=emb_params if p > 1 else 0.0)


def _chain(unit: UnitOps, ops: list[Op]) -> None:
    """Append ``ops`` to the unit, each after the one before when they run on different
    streams (a collective on the ``tp`` stream and the compute around it), the first after
    what the unit carries; a last op off the compute stream is carried to the next."""
    ops[0].deps = list(ops[0].deps) + unit.carry
    unit.carry = []
    for prev, op in zip(ops, ops[1:], strict=False):
        if op.stream != prev.stream:
            op.deps = list(op.deps) + [prev]
    unit.ops.extend(ops)
    if ops[-1].stream != "compute":
        unit.carry = [ops[-1]]


class MTPOps:
    """Lays out the modules' ops in the last virtual stage's units (``ub``: the job's unit
    builder, whose layer ops and collectives the modules share); each call names the stage
    (``st``) whose tensor-parallel groups the ops use (DualPipe has two last stages)."""

    def __init__(self, ub: UnitBuilder, plan: MTPPlan) -> None:
        self.ub = ub
        self.plan = plan
        s = ub.s
        self.sp = s.t > 1 and s.sp
        # Under full recomputation the checkpoint keeps its two inputs (the hidden state and
        # the embedding, sequence shards) instead of what the projection saves.
        self.proj_hold = (2.0 * s.act * s.local_tokens * s.h if s.ac == "full"
                          else plan.proj.saved_bytes)

    def _compute(self, name: str, dur: float, phase: str, mb: int, layer: int | None,
                 cpu_s: float, **kw: object) -> Op:
        cat = {"fwd": "forward", "bwd": "backward"}.get(phase, phase)
        return Op(name=name, kind="compute", stream="compute", phase=phase,  # type: ignore[arg-type]
                  duration=dur, micro_batch=mb, layer=layer, category=cat, cpu_s=cpu_s,
                  **kw)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ forward
    def _proj_forward(self, unit: UnitOps, st: int, mb: int, layer: int, phase: str) -> None:
        """[gather the 2h input] enorm, hnorm, cat, eh_proj [gather its output slices]."""
        ub, s, pl = self.ub, self.ub.s, self.plan
        rec = phase == "recompute"
        ops = []
        if self.sp:
            # eh_proj is a TE column-parallel linear: under FP8 it quantizes its [h, h] input
            # (after an amax all-reduce under current scaling) and gathers FP8.
            ops += ub.amax_ops(st, f"{phase} mtp proj L{layer} mb{mb}", mb, layer)
            gather = ub.tp_comm(st, "all_gather", 2.0 * ub.full,
                                f"all_gather {phase} mtp proj L{layer} mb{mb}", mb, layer)
            ub.fp8_gather(gather)
            ops.append(gather)
        ops.append(self._compute(
            f"{phase} mtp proj L{layer} mb{mb}", pl.proj.fwd_gpu_s, phase, mb, layer,
            PROJ_OPS * ub.c.cpu_call, flops=0.0 if rec else pl.proj_flops[0],
            alloc=(("activations", pl.proj.saved_bytes if rec else self.proj_hold),)))
        if s.t > 1:
            ops.append(ub.tp_comm(st, "all_gather", ub.full,
                                  f"all_gather {phase} mtp proj out L{layer} mb{mb}", mb,
                                  layer))
        _chain(unit, ops)

    def forward(self, unit: UnitOps, mb: int, st: int) -> None:
        """Every depth's embedding, projection and layer, then every depth's head and loss
        (``GPTModel._postprocess``: the MTP block, then ``process_mtp_loss``), on stage
        ``st``."""
        ub, s, c = self.ub, self.ub.s, self.ub.c
        for layer in self.plan.layers:
            ops = [self._compute(f"fwd mtp embed L{layer} mb{mb}", c.fwd_s["embed"], "fwd", mb,
                                 layer, c.fwd_cpu["embed"],
                                 alloc=(("activations", s.cost["embed"].saved_bytes),))]
            if s.t > 1:
                ops.append(ub.tp_comm(st, s.row_reduce, ub.full,
                                      f"mtp embed reduce L{layer} mb{mb}", mb, layer))
            _chain(unit, ops)
            unit.part_op[layer] = ops[0]
            self._proj_forward(unit, st, mb, layer, "fwd")
            ub.layer_forward(st, unit, mb, layer, recompute=False)
        head = s.cost["head"]
        for layer in self.plan.layers:
            _chain(unit, [self._compute(
                f"fwd mtp head+loss L{layer} mb{mb}", c.fwd_s["head"], "fwd", mb, layer,
                c.fwd_cpu["head"], alloc=(("activations", head.saved_bytes),),
                transient=head.fwd_transient_bytes, transient_parts=head.fwd_transient_parts,
                flops=s.blocks["head"].flops_fwd)])

    # ------------------------------------------------------------------ backward
    def backward(self, unit: UnitOps, mb: int, st: int) -> None:
        """The heads' backward, then each depth's layer (recomputed with its projection
        under full recomputation), projection and embedding, the last depth first, on stage
        ``st``."""
        ub, s, c, pl = self.ub, self.ub.s, self.ub.c, self.plan
        head = s.cost["head"]
        for layer in reversed(pl.layers):
            _chain(unit, [self._compute(
                f"bwd mtp head+loss L{layer} mb{mb}", c.bwd_s["head"], "bwd", mb, layer,
                c.bwd_cpu["head"], free=(("activations", head.saved_bytes),),
                transient=head.bwd_transient_bytes, transient_parts=head.bwd_transient_parts,
                flops=s.blocks["head"].flops_bwd)])
        for layer in reversed(pl.layers):
            if s.ac == "full":
                self._proj_forward(unit, st, mb, layer, "recompute")
            ub.layer_backward(st, unit, mb, layer)
            self._proj_backward(unit, st, mb, layer)
            _chain(unit, [self._compute(
                f"bwd mtp embed L{layer} mb{mb}", c.bwd_s["embed"], "bwd", mb, layer,
                c.bwd_cpu["embed"], free=(("activations", s.cost["embed"].saved_bytes),))])

    def _proj_backward(self, unit: UnitOps, st: int, mb: int, layer: int) -> None:
        """The sequence scatter's backward (an all-gather of the gradient), ``eh_proj``'s
        backward with its input re-gathered and its input gradient reduce-scattered
        (all-reduced without sequence parallelism), the norms and the split."""
        ub, s, pl = self.ub, self.ub.s, self.plan
        ops = []
        if self.sp:
            ops.append(ub.tp_comm(st, "all_gather", ub.full,
                                  f"all_gather bwd mtp proj grad L{layer} mb{mb}", mb, layer))
            regather = ub.tp_comm(st, "all_gather", 2.0 * ub.full,
                                  f"all_gather input bwd mtp proj L{layer} mb{mb}", mb, layer)
            ub.fp8_gather(regather)   # TE re-gathers the saved FP8 input for wgrad
            ops.append(regather)
        held = self.proj_hold + (pl.proj.saved_bytes if s.ac == "full" else 0.0)
        ops.append(self._compute(f"bwd mtp proj L{layer} mb{mb}", pl.proj.bwd_gpu_s, "bwd", mb,
                                 layer, PROJ_OPS * ub.c.cpu_call / 2, flops=pl.proj_flops[1],
                                 free=(("activations", held),)))
        if s.t > 1:
            ops.append(ub.tp_comm(st, s.row_reduce, 2.0 * ub.full,
                                  f"{s.row_reduce} bwd mtp proj L{layer} mb{mb}", mb, layer))
        _chain(unit, ops)
