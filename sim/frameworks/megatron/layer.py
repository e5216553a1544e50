"""Megatron-LM's units: the ops of one (virtual stage, micro-batch, pass).

:func:`layer_costs` prices, once per job, what each layer's ops need: GPU and host seconds
per block, the activations a layer holds, the overlapped GEMM spans of Transformer Engine's
userbuffers and the context-parallel ring's steps. :class:`UnitBuilder` then lays out each
unit as Megatron-Core runs it: the embedding and its tensor-parallel reduce on the first
virtual stage, each layer's attention and MLP blocks with their tensor-parallel collectives
(:mod:`sim.frameworks.megatron.overlap` for the overlapped forms), recomputation under
activation checkpointing, and the output layer with the loss on the last virtual stage.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from sim.frameworks.megatron.activation_offload import OffloadPlan
from sim.frameworks.megatron.moe import MoEOps
from sim.frameworks.megatron.mtp import MTPOps
from sim.frameworks.megatron.overlap import (
    TE_AMAX_BYTES,
    TE_PIPELINE_SPLITS,
    amax_reductions,
    column_linear_backward,
    cp_ring,
    pipelined_scatter,
    ring_exchange_gather,
    te_sp_gather_bytes,
    userbuffer_gemm_spans,
)
from sim.frameworks.megatron.recompute import Recompute, recompute_plan
from sim.frameworks.megatron.shape import MegatronShape
from sim.frameworks.megatron.unit_ops import BlockSpec, KeySeq, UnitKey, UnitOps, compute
from sim.frameworks.megatron.unit_ops import op_category as _cat
from sim.hardware.compute import ComputeModel
from sim.program.ir import Op
from sim.workload.layer_ops import kernel_time
from sim.workload.megatron_host_ops import (
    CHECKPOINT_OPS,
    backward_host_s,
    fp8_linear_host_s,
    python_ops,
    te_function_bwd,
    te_linears,
)
from sim.workload.megatron_mla import mla_gather_width
from sim.workload.megatron_ops import WINDOWED, attention_key

"""(F|B, virtual stage, micro-batch)."""

CORE_FWD = frozenset({"qk_bmm", "softmax", "attn_dropout", "pv_bmm", "flash_fwd",
                      "core_attn"})
"""Core attention's forward kernels (what selective recomputation re-runs; ``core_attn.*``:
the quantization of its inputs under FP8 attention)."""
CORE_BWD = frozenset({"flash_bwd", "qk_bmm", "softmax", "attn_dropout", "pv_bmm"})


@dataclass(frozen=True)
class LayerCosts:
    """Per-job price tables of the units' ops (see :func:`layer_costs`)."""

    fwd_s: dict[str, float]
    """GPU seconds of each block's forward kernels."""
    bwd_s: dict[str, float]
    fwd_cpu: dict[str, float]
    """Host seconds Megatron's Python needs to issue each block's forward."""
    bwd_cpu: dict[str, float]
    cpu_call: float
    """Host seconds of one Python-level torch call (a collective's issue)."""
    ckpt_cpu: float
    """Host seconds of a checkpointed layer's recompute bookkeeping."""
    core_fwd_s: float
    """GPU seconds of core attention's forward (re-run under selective recomputation)."""
    col_gemm_s: dict[str, tuple[float, float]]
    """(dgrad, wgrad) GPU seconds of each column-parallel linear (with its FP8 grad cast)."""
    gemm_spans: dict[tuple[str, str], tuple[float, float, float, float]]
    """:func:`userbuffer_gemm_spans` of the job's blocks."""
    layer_saved: float
    """Activation bytes one layer's blocks save for backward."""
    layer_hold: float
    """Of them, those held until backward under the job's activation checkpointing."""
    ring_bytes: dict[str, list[float]]
    """Context-parallel ring: bytes of each forward / backward K/V exchange step."""
    ring_s: dict[str, tuple[float, float]]
    """Context-parallel ring: (GPU seconds before core attention, of core attention)."""
    moe_saved_delta: float = 0.0
    """A layer with experts: its MoE blocks' saved bytes less the dense MLP's (which
    ``layer_saved`` counts)."""
    core_fwd_by_block: dict[str, float] = field(default_factory=dict)
    """GPU seconds of core attention's forward in each attention block (``attn_main`` and, for
    a sliding-window model, :data:`~sim.workload.megatron_ops.WINDOWED`)."""
    rec: Recompute = field(default_factory=Recompute)
    """What ``recompute_modules`` beyond ``core_attn`` drop and re-run
    (:mod:`sim.frameworks.megatron.recompute`); ``layer_hold`` and ``moe_saved_delta`` are
    already net of what they drop."""


def layer_costs(s: MegatronShape, cm: ComputeModel, cpu_s_per_op: float) -> LayerCosts:
    """Price the units' ops: GPU time of each block's kernels, and the host time Megatron's
    Python needs to issue them (PYTHON_OPS x ``cpu_s_per_op``; backward autograd nodes cost
    half, Transformer Engine's Function bodies more: :func:`backward_host_s`): the engine
    starts an op only once the host has issued it."""
    cost, blocks = s.cost, s.blocks
    py_ops = python_ops(s.model, s.legacy, s.lay.rope_fusion)
    # Selective recomputation drops what core attention saves beyond its inputs: the
    # softmax output and the dropout mask and output (the 5as^2b term; Korthikanti et al.).
    core_saved = float(sum(tn.nbytes for tn in blocks["attn_main"].saved
                           if tn.name.endswith((".probs", "attn_dropout.mask",
                                                "attn_dropout.out"))))
    core_fwd = {key: sum(kernel_time(cm, k) for k in blocks[key].forward
                         if k.name.split(".")[0] in CORE_FWD)
                for key in ("attn_main", WINDOWED) if key in blocks}
    core_fwd_s = core_fwd["attn_main"]
    layer_saved = sum(cost[k].saved_bytes for k in ("attn_pre", "attn_main", "mlp_pre",
                                                    "mlp_main"))
    layer_hold: float
    if s.ac == "full":
        layer_hold = float(s.act * s.local_tokens * s.h)   # the layer input only
    elif "core_attn" in s.recompute:
        layer_hold = layer_saved - core_saved
    else:
        layer_hold = layer_saved
    rec = recompute_plan(s, cm, cpu_s_per_op)[0] if s.recompute - {"core_attn"} \
        else Recompute(s.recompute)
    if s.recompute - {"core_attn"}:
        layer_hold -= rec.dense_freed
    # Context parallelism: Transformer Engine's ring (sim.frameworks.megatron.overlap.cp_ring)
    # passes each rank's K and V (2 x tokens x kv width) to the next rank once per step.
    kv_bytes = 2.0 * s.act * s.tokens * max(1, s.model.kv_heads // s.t) * s.model.head_dim
    fwd_ks = blocks["attn_main"].forward
    first_core = next((i for i, k in enumerate(fwd_ks) if k.name.split(".")[0] in CORE_FWD),
                      len(fwd_ks))
    moe_delta = (s.moe.saved_bytes - cost["mlp_main"].saved_bytes) if s.moe else 0.0
    # FP8 Transformer Engine linears cost the host more than 16-bit ones (TE PR 3523).
    fp8_te = s.lay.fp8 is not None and not s.legacy
    fp8_host = {k: fp8_linear_host_s(te_linears(s.model, k) if fp8_te else 0, cpu_s_per_op)
                for k in cost}
    if s.moe and s.recompute - {"core_attn"}:
        moe_delta += rec.dense_freed - rec.moe_layer_freed
    return LayerCosts(
        moe_saved_delta=moe_delta, core_fwd_by_block=core_fwd, rec=rec,
        fwd_s={k: c.fwd_gpu_s for k, c in cost.items()},
        bwd_s={k: c.bwd_gpu_s for k, c in cost.items()},
        fwd_cpu={k: py_ops[k][0] * cpu_s_per_op + fp8_host[k][0] for k in cost},
        bwd_cpu={k: backward_host_s(py_ops[k][1], 0 if s.legacy else te_function_bwd(s.model, k),
                                    cpu_s_per_op) + fp8_host[k][1] for k in cost},
        cpu_call=cpu_s_per_op, ckpt_cpu=CHECKPOINT_OPS * cpu_s_per_op, core_fwd_s=core_fwd_s,
        col_gemm_s={lin: (sum(kernel_time(cm, k) for k in blocks[blk].backward
                              for n in _column_linears(s, lin)
                              if k.name in {f"{n}.dgrad", f"{n}.cast_g", f"{n}.amax_g"}),
                          sum(kernel_time(cm, k) for k in blocks[blk].backward
                              for n in _column_linears(s, lin) if k.name == f"{n}.wgrad"))
                    for lin, blk in (("qkv", "attn_main"), ("fc1", "mlp_main"))},
        # Only an overlapped tensor-parallel layout reads them (MLA's block has no QKV GEMM).
        gemm_spans=userbuffer_gemm_spans(blocks, lambda k: kernel_time(cm, k))
        if s.opts.tp_comm_overlap and s.t > 1 else {},
        layer_saved=layer_saved, layer_hold=layer_hold,
        ring_bytes={"fwd": [kv_bytes] * (s.cp - 1),
                    "bwd": [kv_bytes] + [2 * kv_bytes] * (s.cp - 2) + [kv_bytes]},
        ring_s={"fwd": (sum(kernel_time(cm, k) for k in fwd_ks[:first_core]), core_fwd_s),
                "bwd": (sum(kernel_time(cm, k) for k in blocks["attn_main"].backward
                            if k.name.split(".")[0] in ("proj", "bda")),
                        sum(kernel_time(cm, k) for k in blocks["attn_main"].backward
                            if k.name.split(".")[0] in CORE_BWD))})


def _column_linears(s: MegatronShape, lin: str) -> tuple[str, ...]:
    """The column-parallel linears a block's backward ends with: the fused QKV (``qkv``) or
    MLA's q (or q up) and kv up projections, fc1."""
    mla = s.model.mla
    if lin == "qkv" and mla is not None:
        return ("q_up" if mla.q_lora_rank else "q_proj", "kv_up")
    return (lin,)


class UnitBuilder:
    """Lays out the ops of Megatron's units for one job, keyed by :class:`KeySeq`."""

    def __init__(self, shape: MegatronShape, costs: LayerCosts, keys: KeySeq,
                 cm: ComputeModel | None = None) -> None:
        self.s = shape
        self.c = costs
        self.keys = keys
        self.full = shape.act * shape.tokens * shape.h
        """Bytes of a gathered [s, b, h] activation."""
        self.attn_in = self.full if shape.model.mla is None else \
            shape.act * shape.tokens * mla_gather_width(shape.model)
        """Bytes the attention's column-parallel linears gather under sequence parallelism
        (MLA: its latents and shared rotary key, :func:`mla_gather_width`)."""
        mla = shape.model.mla
        self.attn_hp = 0.0 if mla is None else shape.act * shape.tokens * mla.qk_rope_head_dim
        """Of them, MLA's rotary key: Megatron's own gather, 16-bit under FP8 too."""
        self.overlap = shape.opts.tp_comm_overlap and shape.t > 1
        self.tp_groups = [shape.tp_groups(st) for st in range(shape.p)]
        """Each stage's tensor-parallel groups (built once: every collective names them)."""
        self.moe = [MoEOps(shape.moe, st, keys, costs.cpu_call, self.tp_groups[st], shape.t)
                    for st in range(shape.p)] if shape.moe is not None else []
        """Each stage's MoE layer op makers (models with experts)."""
        self.mtp = MTPOps(self, shape.mtp) if shape.mtp is not None else None
        """The multi-token prediction modules' op maker (the last virtual stage's units)."""
        self.offload = OffloadPlan(shape, cm) if (
            cm is not None and shape.opts.fine_grained_activation_offloading) else None
        """Fine-grained activation offloading's groups and copies, or None."""

    def is_moe(self, layer: int) -> bool:
        return self.s.moe is not None and self.s.moe.is_moe(layer)

    def _moe_ops(self, unit: UnitOps, ops: list[Op]) -> None:
        """Append an MoE layer's ops (no tensor-parallel exchange closes them: with sequence
        parallelism the dispatcher takes and returns the sequence shard)."""
        ops[0].deps = list(ops[0].deps) + unit.carry
        unit.carry = []
        unit.ops.extend(ops)

    def build_units(self) -> dict[UnitKey, UnitOps]:
        """Every unit of the step, built in (virtual stage, micro-batch, pass) order."""
        return {(kind, v, mb): self.build_unit(kind, v, mb) for v in range(self.s.n_virtual)
                for mb in range(self.s.chunk_micro_batches) for kind in ("F", "B")}

    # ------------------------------------------------------------------ op makers
    def tp_comm(self, st: int, op: str, nbytes: float, name: str, mb: int,
                layer: int | None, side: bool = False) -> Op:
        """A tensor-parallel collective: on the compute stream (blocking it), or on the
        ``tp`` stream beside the GEMMs (``tp_comm_overlap``, or a ``side`` exchange)."""
        groups = self.tp_groups[st]
        stream = "tp" if (self.s.opts.tp_comm_overlap or side) else "compute"
        return Op(name=name, kind="collective", stream=stream, phase="comm", collective=op,  # type: ignore[arg-type]
                  group=groups[0], groups=groups,
                  nbytes=nbytes, dtype=self.s.act_dtype, key=self.keys(f"tp/{st}"),
                  category=op, micro_batch=mb,
                  layer=layer, cpu_s=self.c.cpu_call)

    def fp8_gather(self, gather: Op, hp: float = 0.0) -> None:
        """Under FP8 a Transformer Engine linear's sequence-parallel all-gather moves FP8,
        through NCCL or userbuffers alike (:func:`te_sp_gather_bytes`)."""
        if self.s.precision == "fp8":
            gather.nbytes = te_sp_gather_bytes(gather.nbytes, self.s.act, True, hp)
            gather.dtype = "u8"

    def amax_ops(self, st: int, label: str, mb: int, layer: int | None, n: int = 1
                 ) -> list[Op]:
        """The ``n`` amax all-reduces current scaling runs before a quantize-then-gather
        (:func:`amax_reductions`); the cast waits for them on the compute stream."""
        if not (self.s.precision == "fp8" and amax_reductions(self.s.opts.fp8_recipe, True)):
            return []
        ops = [self.tp_comm(st, "all_reduce", TE_AMAX_BYTES, f"amax all_reduce {label}",
                            mb, layer) for _ in range(n)]
        for op in ops:
            op.stream, op.dtype = "compute", "f32"
        return ops

    def cp_transfer(self, st: int, mb: int, layer: int, label: str
                    ) -> Callable[[float, int], Op]:
        """The context-parallel ring's step i transfer of ``nbytes`` (to the next rank)."""
        pairs = self.s.cp_ring_pairs(st)
        return lambda nbytes, i: Op(
            name=f"cp ring {label} step {i}", kind="send", stream="cp", phase="comm",
            pairs=pairs, nbytes=nbytes, dtype=self.s.act_dtype, key=self.keys(f"cp/{st}"),
            category="send_recv",
            micro_batch=mb, layer=layer, cpu_s=self.c.cpu_call)

    # ------------------------------------------------------------------ blocks and layers
    def block_ops(self, st: int, unit: UnitOps, b: BlockSpec) -> None:
        """One block's ops: [pre] [all-gather] main [reduce], chained on the stream."""
        s = self.s

        def make(name: str, d: float, **kw: object) -> Op:
            return compute(name, d, phase=b.phase, micro_batch=b.mb, layer=b.layer,
                           category=_cat(b.phase), **kw)

        ops, consumed = self._block_front(st, b, make)
        if s.cp > 1 and b.ring:
            before, core = self.c.ring_s[b.ring]
            if b.ring == "fwd" and len(ops) == 1:
                before += b.dur_pre           # the norm ran first in the merged op
            ops[-1:] = cp_ring(ops[-1], max(0.0, before - consumed), core, s.cp,
                               self.c.ring_bytes[b.ring],
                               self.cp_transfer(st, b.mb, b.layer, b.label), make)
        if b.alloc:
            ops[0].alloc = (("activations", b.alloc),)
        if b.free:
            ops[-1].free = (("activations", b.free),)
        carry = self._block_back(st, b, ops, make)
        ops[0].deps = list(ops[0].deps) + unit.carry
        unit.carry = carry
        unit.ops.extend(ops)

    def _block_front(self, st: int, b: BlockSpec, make: Callable[..., Op]
                     ) -> tuple[list[Op], float]:
        """[pre] [all-gather] main, and the seconds of main already split off before its
        core (by the all-gather's ring exchange)."""
        cat = _cat(b.phase)
        if not (self.s.t > 1 and self.s.sp):
            return [compute(f"{b.label}", b.dur_pre + b.dur_main, phase=b.phase,
                            micro_batch=b.mb, layer=b.layer, category=cat, flops=b.flops,
                            cpu_s=b.cpu_pre + b.cpu_main)], 0.0
        ops = [compute(f"{b.label} {b.names[0]}", b.dur_pre, phase=b.phase, micro_batch=b.mb,
                       layer=b.layer, category=cat, cpu_s=b.cpu_pre)]
        attn = b.names == ("norm", "attention")
        # Forward: QKV's (MLA: its two up projections') or fc1's input; backward: proj's or
        # fc2's output gradient.
        ops += self.amax_ops(st, b.label, b.mb, b.layer,
                             len(_column_linears(self.s, "qkv")) if attn else 1)
        gather = self.tp_comm(st, "all_gather", self.attn_in if attn else self.full,
                              f"all_gather {b.label}", b.mb, b.layer)
        self.fp8_gather(gather, self.attn_hp if attn else 0.0)
        main = compute(f"{b.label} {b.names[1]}", b.dur_main, phase=b.phase, micro_batch=b.mb,
                       layer=b.layer, category=cat, flops=b.flops, cpu_s=b.cpu_main)
        if not self.overlap:
            return ops + [gather, main], 0.0
        before_s, gemm_s = self.c.gemm_spans[b.names][:2]
        ops += ring_exchange_gather(main, before_s, gemm_s, self.s.t, gather, ops[-1], make)
        return ops, ops[-2].duration

    def _block_back(self, st: int, b: BlockSpec, ops: list[Op], make: Callable[..., Op]
                    ) -> list[Op]:
        """Append the block's closing tensor-parallel exchange to ``ops``; return what the
        next block's first op waits for."""
        s, full = self.s, self.full
        if s.t > 1 and s.sp and b.column:
            full = self.attn_in if b.column == "qkv" else full
            gather = self.tp_comm(st, "all_gather", full, f"all_gather input {b.label}", b.mb,
                                  b.layer, side=True)
            scatter = self.tp_comm(st, "reduce_scatter", full, f"reduce_scatter {b.label}",
                                   b.mb, b.layer, side=True)
            self.fp8_gather(gather, self.attn_hp if b.column == "qkv" else 0.0)
            dgrad_s, wgrad_s = self.c.col_gemm_s[b.column]
            ops[-1:] = column_linear_backward(ops[-1], dgrad_s, wgrad_s, gather, scatter, make)
            return [scatter]
        if s.t > 1:
            red = s.row_reduce
            comm = self.tp_comm(st, red, full, f"{red} {b.label}", b.mb, b.layer)
            if self.overlap:
                gemm_s, after_s = self.c.gemm_spans[b.names][2:]
                splits = TE_PIPELINE_SPLITS
                comm.nbytes = full * (splits - 1) / splits
                tail = self.tp_comm(st, red, full / splits, f"{red} {b.label} (last)", b.mb,
                                    b.layer)
                ops[-1:] = pipelined_scatter(ops[-1], gemm_s, after_s, comm, tail, make,
                                             f"wait {red} {b.label}", splits)
            else:
                ops.append(comm)
        return []

    def layer_forward(self, st: int, unit: UnitOps, mb: int, layer: int,
                      recompute: bool) -> None:
        """A layer's forward (or its recomputation under full checkpointing)."""
        s, c = self.s, self.c
        phase = "recompute" if recompute else "fwd"
        moe = self.is_moe(layer)
        attn = attention_key(s.model, layer, s.blocks)
        hold = c.layer_hold + (c.moe_saved_delta if moe and s.ac != "full" else 0.0)
        carrier = len(unit.ops)       # the attention block's first op allocates ``hold``
        self.block_ops(st, unit, BlockSpec(
            ("norm", "attention"), c.fwd_s["attn_pre"], c.fwd_s[attn],
            f"{phase} attn L{layer} mb{mb}", mb, layer, phase,
            alloc=0.0 if recompute else hold,
            flops=0.0 if recompute else s.blocks[attn].flops_fwd, ring="fwd",
            cpu_pre=c.fwd_cpu["attn_pre"] + (c.ckpt_cpu if recompute else 0.0),
            cpu_main=c.fwd_cpu[attn] + c.rec.attn_cpu_fwd))
        key = unit.key
        off = self.offload if not recompute and key is not None else None
        v = key[1] if key is not None else -1
        if off is not None and off.attn_modules:    # tp 1: the attention is one op
            d2h = off.forward_copy(v, mb, layer, unit.ops[carrier], unit.ops[carrier],
                                   moe=False)
            if d2h is not None:
                unit.ops.append(d2h)
        if moe:
            ops = self.moe[st].forward(phase, mb, layer, c.fwd_s["mlp_pre"],
                                       c.fwd_cpu["mlp_pre"] + c.rec.norm_cpu_fwd)
            experts = next((o for o in ops if o.name == f"{phase} moe L{layer} mb{mb} experts"),
                           None)
            if experts is not None:
                # moe_act's checkpoint bookkeeping (sim.workload.checkpoint_without_output).
                experts.cpu_s += c.rec.act_cpu_fwd
                if off is not None and off.moe_modules:
                    d2h = off.forward_copy(v, mb, layer, experts, unit.ops[carrier],
                                           moe=True)
                    if d2h is not None:
                        ops.insert(ops.index(experts) + 1, d2h)
            self._moe_ops(unit, ops)
            return
        self.block_ops(st, unit, BlockSpec(
            ("norm", "mlp"), c.fwd_s["mlp_pre"], c.fwd_s["mlp_main"],
            f"{phase} mlp L{layer} mb{mb}", mb, layer, phase,
            flops=0.0 if recompute else s.blocks["mlp_main"].flops_fwd,
            cpu_pre=c.fwd_cpu["mlp_pre"], cpu_main=c.fwd_cpu["mlp_main"]))

    def layer_backward(self, st: int, unit: UnitOps, mb: int, layer: int) -> None:
        """A layer's backward, after its recomputation under full checkpointing."""
        s, c = self.s, self.c
        moe = self.is_moe(layer)
        delta = c.moe_saved_delta if moe else 0.0
        if s.ac == "full":
            self.layer_forward(st, unit, mb, layer, recompute=True)
            # The recomputed layer's activations live until its backward ends.
            unit.ops[-1].alloc = unit.ops[-1].alloc + (("activations", c.layer_saved + delta),)
        r = c.rec
        if moe:
            self._moe_backward(st, unit, mb, layer)
        else:
            if "mlp" in r.modules:
                self._mlp_recompute(st, unit, mb, layer)
            self.block_ops(st, unit, BlockSpec(
                ("mlp", "norm"), c.bwd_s["mlp_pre"], c.bwd_s["mlp_main"] + r.norm_s_dense,
                f"bwd mlp L{layer} mb{mb}", mb, layer, "bwd", alloc=r.norm_freed_dense,
                free=r.norm_freed_dense + r.mlp_freed,
                flops=s.blocks["mlp_main"].flops_bwd, cpu_pre=c.bwd_cpu["mlp_pre"],
                cpu_main=c.bwd_cpu["mlp_main"], column="fc1"))
        attn = attention_key(s.model, layer, s.blocks)
        extra = c.core_fwd_by_block.get(attn, c.core_fwd_s) if "core_attn" in s.recompute \
            else 0.0
        free = c.layer_hold + delta + (c.layer_saved if s.ac == "full" else 0.0)
        if r.attn_gather and s.sp:
            self._mla_regather(st, unit, mb, layer)
        self.block_ops(st, unit, BlockSpec(
            ("attention", "norm"), c.bwd_s["attn_pre"], c.bwd_s[attn] + extra + r.attn_s,
            f"bwd attn L{layer} mb{mb}", mb, layer, "bwd",
            alloc=r.attn_freed + r.attn_transient, free=free + r.attn_freed + r.attn_transient,
            flops=s.blocks[attn].flops_bwd, cpu_pre=c.bwd_cpu["attn_pre"],
            cpu_main=c.bwd_cpu[attn] + r.attn_cpu_bwd, column="qkv", ring="bwd"))
        if self.offload is not None and unit.key is not None:
            self.offload.backward_frees(unit.key[1], mb, layer, unit.ops[-1])
        unit.layer_bwd[layer] = unit.ops[-1]
        unit.part_op[layer] = unit.ops[-1]

    # ------------------------------------------------------------------ module recomputation
    def _mlp_recompute(self, st: int, unit: UnitOps, mb: int, layer: int) -> None:
        """``mlp``: the dense MLP's forward again (``tensor_parallel.checkpoint``), its
        collectives included; with Transformer Engine the pre-MLP norm is fused into fc1
        and re-runs with it. What it saves lives until the MLP's backward ends."""
        s, c = self.s, self.c
        te = not s.legacy
        self.block_ops(st, unit, BlockSpec(
            ("norm", "mlp"), c.fwd_s["mlp_pre"] if te else 0.0, c.fwd_s["mlp_main"],
            f"recompute mlp L{layer} mb{mb}", mb, layer, "recompute", alloc=c.rec.mlp_freed,
            cpu_pre=(c.fwd_cpu["mlp_pre"] if te else 0.0) + c.ckpt_cpu,
            cpu_main=c.fwd_cpu["mlp_main"]))

    def _mla_regather(self, st: int, unit: UnitOps, mb: int, layer: int) -> None:
        """``mla_up_proj`` under sequence parallelism: the up projections' column-parallel
        linears gather their latent inputs again when the checkpoint re-runs them (before the
        attention's backward here; Megatron's hook fires at core attention's)."""
        g = self.tp_comm(st, "all_gather", self.c.rec.attn_gather,
                         f"all_gather recompute mla up L{layer} mb{mb}", mb, layer)
        self.fp8_gather(g)
        g.deps = list(g.deps) + unit.carry
        unit.carry = [g] if g.stream != "compute" else []
        unit.ops.append(g)

    def _moe_backward(self, st: int, unit: UnitOps, mb: int, layer: int) -> None:
        """An MoE layer's backward with its modules' recomputation: ``moe`` re-runs the whole
        layer's forward first, ``shared_experts`` the shared experts' (their collectives
        included); the pre-MLP norm (``layernorm``) re-runs at the start of the backward and
        its output lives until the router's backward; the activation (``moe_act``) inside
        the experts' backward."""
        c, r = self.c, self.c.rec
        mo = self.moe[st]
        held = 0.0
        if "moe" in r.modules:
            ops = mo.forward("recompute", mb, layer, 0.0, 0.0)
            held = r.moe_freed
        elif r.shared_freed:
            ops = mo._shared("recompute", f"recompute moe L{layer} mb{mb}", mb, layer, False)
            held = r.shared_freed
        else:
            ops = []
        if ops:
            first = next(o for o in ops if o.kind == "compute")
            first.cpu_s += c.ckpt_cpu
            first.alloc = (*first.alloc, ("activations", held))
            self._moe_ops(unit, ops)
        ops = mo.backward(mb, layer, c.bwd_s["mlp_pre"], c.bwd_cpu["mlp_pre"])
        if r.norm_freed_moe:
            # The recomputed norm output (norm_transient) is held with the restored one until
            # the checkpoint's backward, after the router's: to the layer's end.
            first = next(o for o in ops if o.kind == "compute")
            first.duration += r.norm_s_moe
            first.cpu_s += r.norm_cpu_bwd
            first.alloc = (*first.alloc, ("activations", r.norm_freed_moe + r.norm_transient))
            held += r.norm_freed_moe + r.norm_transient
        if r.act_freed:
            experts = next(o for o in ops if o.name == f"bwd moe L{layer} mb{mb} experts")
            experts.duration += r.act_s
            experts.cpu_s += r.act_cpu_bwd
            act = r.act_freed + r.act_transient
            experts.alloc = (*experts.alloc, ("activations", act))
            experts.free = (*experts.free, ("activations", act))
        if held:
            ops[-1].free = (*ops[-1].free, ("activations", held))
        self._moe_ops(unit, ops)

    # ------------------------------------------------------------------ units
    def build_unit(self, kind: str, v: int, mb: int) -> UnitOps:
        """The forward (``F``) or backward (``B``) of virtual stage ``v``, micro-batch mb."""
        s = self.s
        st = s.place.stage(v)
        unit = UnitOps(key=(kind, v, mb))
        receives = not (s.place.is_first(v) if kind == "F" else s.place.is_last(v))
        if receives and s.p2p_split > 1:
            # The received 1/tp slices are all-gathered in the tensor-parallel group
            # (gather_split_1d_tensor after the recv in Megatron's _communicate).
            unit.ops.append(self.tp_comm(st, "all_gather", self.full,
                                         f"gather received {'act' if kind == 'F' else 'grad'} "
                                         f"mb{mb}", mb, None))
        if kind == "F":
            self._forward(unit, st, v, mb)
        else:
            self._backward(unit, st, v, mb)
        if not unit.ops:
            # A virtual stage without layers (a custom layout's empty entry): its
            # TransformerBlock passes the tensor on, no kernel.
            phase = "fwd" if kind == "F" else "bwd"
            unit.ops.append(compute(f"{phase} empty stage v{v} mb{mb}", 0.0, phase=phase,
                                    micro_batch=mb, category=_cat(phase), kernels=0))
        if unit.carry:      # the last linear's reduce-scatter, before the send
            unit.ops.append(compute(f"wait {unit.carry[0].name}", 0.0, phase="bwd",
                                    micro_batch=mb, category="backward", deps=unit.carry,
                                    kernels=0))
            unit.carry = []
        unit.first, unit.last = unit.ops[0], unit.ops[-1]
        if s.legacy:
            unit.last.host_sync = True
        return unit

    def _forward(self, unit: UnitOps, st: int, v: int, mb: int) -> None:
        s, c = self.s, self.c
        if s.place.is_first(v):
            unit.ops.append(compute(f"fwd embed mb{mb}", c.fwd_s["embed"], phase="fwd",
                                    micro_batch=mb, category="forward",
                                    cpu_s=c.fwd_cpu["embed"],
                                    alloc=(("activations", s.cost["embed"].saved_bytes),)))
            unit.part_op["embed"] = unit.ops[-1]
            if s.t > 1:
                unit.ops.append(self.tp_comm(st, s.row_reduce, self.full,
                                             f"embed reduce mb{mb}", mb, None))
        for layer in s.chunks[v]:
            n_before = len(unit.ops)
            self.layer_forward(st, unit, mb, layer, recompute=False)
            unit.part_op[layer] = unit.ops[n_before]
        if s.place.is_last(v):
            n_before = len(unit.ops)
            if self.mtp is not None:
                self.mtp.forward(unit, mb, st)
            head = s.cost["head"]
            unit.ops.append(compute(f"fwd head+loss mb{mb}", c.fwd_s["head"], phase="fwd",
                                    micro_batch=mb, category="forward",
                                    cpu_s=c.fwd_cpu["head"],
                                    alloc=(("activations", head.saved_bytes),),
                                    transient=head.fwd_transient_bytes,
                                    transient_parts=head.fwd_transient_parts,
                                    flops=s.blocks["head"].flops_fwd))
            # The modules' parameters are the head part's (MegatronShape.head_params).
            unit.part_op["head"] = unit.ops[n_before]

    def _backward(self, unit: UnitOps, st: int, v: int, mb: int) -> None:
        s, c = self.s, self.c
        if s.place.is_last(v):
            head = s.cost["head"]
            unit.ops.append(compute(f"bwd head+loss mb{mb}", c.bwd_s["head"], phase="bwd",
                                    micro_batch=mb, category="backward",
                                    cpu_s=c.bwd_cpu["head"],
                                    free=(("activations", head.saved_bytes),),
                                    transient=head.bwd_transient_bytes,
                                    transient_parts=head.bwd_transient_parts,
                                    flops=s.blocks["head"].flops_bwd))
            if self.mtp is not None:
                self.mtp.backward(unit, mb, st)
            unit.part_op["head"] = unit.ops[-1]
        for layer in reversed(s.chunks[v]):
            self.layer_backward(st, unit, mb, layer)
        if s.place.is_first(v):
            unit.ops.append(compute(f"bwd embed mb{mb}", c.bwd_s["embed"], phase="bwd",
                                    micro_batch=mb, category="backward",
                                    cpu_s=c.bwd_cpu["embed"],
                                    free=(("activations", s.cost["embed"].saved_bytes),),
                                    deps=unit.carry))
            unit.part_op["embed"] = unit.ops[-1]
            unit.carry = []
