"""The ops of one micro-batch's blocks under torchtitan's tensor and context parallelism: each
segment of :mod:`.tp` as a compute op, with the tensor-parallel collectives between them and
context parallelism's key/value ring (:mod:`.cp`) around the attention steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sim.frameworks.common.steps import ordered_forward_allocs
from sim.frameworks.fsdp2.async_tp import AsyncTp
from sim.frameworks.fsdp2.float8 import tp_all_gather_bytes_per_element
from sim.frameworks.fsdp2.tp import TitanBlocks
from sim.program.ir import Op, Phase
from sim.workload.layer_ops import BF16, FP32

# ---------------------------------------------------------------------- ops of a pass


@dataclass
class Comms:
    """How the builder makes the collectives of one pipeline stage (rank class)."""

    tp: Callable[[str, float, str, int, int | None], Op]
    """(collective, nbytes, name, micro-batch, layer) -> a tensor-parallel collective on the
    compute stream."""
    cp_gather: Callable[[float, str, int, int | None], Op]
    """(nbytes, name, micro-batch, layer) -> a context-parallel all-gather on its stream."""
    cp_shift: Callable[[float, str, int, int | None], Op]
    """(bytes per rank, name, micro-batch, layer) -> the ring shift (each rank to the next)."""


class TitanPass:
    """Compute and collective ops of the blocks of one micro-batch under torchtitan's TP/CP.

    :meth:`forward` and :meth:`backward` return, for one block (embed, attn, mlp, head) of
    one layer, its ops in issue order. Memory effects follow :mod:`sim.frameworks.common.steps`:
    forward allocates what autograd saves, backward frees it and allocates the bf16 weight
    gradients (``grad_alloc``); with ``recompute`` a layer keeps only its input and the
    backward of its MLP block starts by recomputing the whole layer, collectives included
    (torchtitan's full activation checkpointing wraps each TransformerBlock). With the
    blocks' ``sac`` (op-level selective checkpointing) a layer keeps its input, the outputs
    the policy saves and its reduce-scatters' outputs, and its backward starts by re-running
    the rest and the tensor-parallel all-gathers (:func:`layer_sac_costs`).
    """

    def __init__(self, tb: TitanBlocks, comms: Comms, recompute: bool,
                 async_tp: AsyncTp | None = None) -> None:
        self.tb = tb
        self.c = comms
        self.atp = async_tp
        """AsyncTP (:mod:`.async_tp`): the layers' exchanges fused with their matmuls."""
        self.sac = tb.sac
        self.recompute = recompute and tb.sac is None
        self.recompute_layers = self.recompute or tb.sac is not None
        """Each layer checkpointed (full or selective): it keeps its input."""
        self._scoped = 0.0

    # ------------------------------------------------------------------ helpers
    def _seg(self, key: str, label: str, mb: int, layer: int | None, phase: Phase,
             backward: bool, alloc_saved: bool = True) -> Op:
        c = self.tb.cost[key]
        blk = self.tb.seg[key]
        if backward:
            held = 0.0
            if key == "attn_norm" and self.recompute_layers:
                # The checkpoint's own hold on the layer input, where no op saved it.
                held = c.checkpoint_only_input_bytes
            free = (("activations", c.saved_bytes + held),) if c.saved_bytes + held else ()
            return Op(name=f"bwd {label} mb{mb}", kind="compute", stream="compute",
                      phase=phase, duration=c.bwd_s, free=free,
                      transient=c.bwd_transient_bytes,
                      transient_parts=c.bwd_transient_parts, layer=layer, micro_batch=mb,
                      hw_flops=blk.flops_bwd, category="backward")
        allocs: list[tuple[str, float]] = []
        transient = c.fwd_transient_bytes
        ordered = ordered_forward_allocs(c) if alloc_saved and phase == "fwd" else None
        if ordered is not None:
            self._scoped += c.forward_scoped_bytes
            return Op(name=f"fwd {label} mb{mb}", kind="compute", stream="compute",
                      phase=phase, duration=c.fwd_s, alloc=ordered[0], free=ordered[1],
                      layer=layer, micro_batch=mb, hw_flops=blk.flops_fwd,
                      category="forward")
        if alloc_saved and c.saved_bytes:
            allocs.append(("activations", c.saved_bytes))
        parts = c.fwd_transient_parts
        if not alloc_saved:
            transient = c.fwd_transient_unsaved_bytes
            parts = c.fwd_transient_unsaved_parts
        if c.forward_scoped_bytes and phase == "fwd":
            allocs.append(("buffers", c.forward_scoped_bytes))
            self._scoped += c.forward_scoped_bytes
        return Op(name=f"{'fwd' if phase == 'fwd' else phase} {label} mb{mb}",
                  kind="compute", stream="compute", phase=phase, duration=c.fwd_s,
                  alloc=tuple(allocs), transient=transient, transient_parts=parts,
                  layer=layer, micro_batch=mb,
                  hw_flops=blk.flops_fwd,
                  category="forward" if phase == "fwd" else "recompute")

    def _gathered(self, what: str = "") -> float:
        """Bytes of a tensor-parallel all-gather's output (or reduce-scatter's input) of
        ``what``: float8 for a layer's all-gathers under float8 TP, else bf16."""
        per = BF16 if not what else tp_all_gather_bytes_per_element(self.tb.fp8_tp, what)
        return float(self.tb.tokens * self.tb.hidden * per)

    def _fp8(self, op: Op, what: str) -> Op:
        """Label a float8 all-gather of ``what`` (:meth:`_gathered`) uint8, as NCCL moves
        float8 data (:func:`sim.frameworks.common.nccl_dtype.element_type`); the comms builder
        labels the rest 16-bit."""
        if op.collective == "all_gather" and what and \
                tp_all_gather_bytes_per_element(self.tb.fp8_tp, what) == 1:
            op.dtype = "u8"
        return op

    def _rs_out(self) -> float:
        return float(self.tb.local_tokens * self.tb.hidden * BF16)

    def _free_rs_out(self, op: Op) -> None:
        # The saved reduce-scatter output goes with the residual add's backward.
        if self.sac is not None and self.tb.tp > 1:
            op.free = op.free + (("activations", self._rs_out()),)

    def _sac_recompute(self, layer: int, mb: int) -> list[Op]:
        """Before a layer's backward: re-run, in forward order, what the selective policy did
        not save, with the tensor-parallel all-gathers feeding the re-run matmuls; each
        segment re-creates the tensors autograd holds for its backward beyond the saved ones
        (the layer input stays held from the forward)."""
        tb, sac = self.tb, self.sac
        assert sac is not None
        ops: list[Op] = []
        tags: dict[int, tuple[str, str]] = {}
        for key in tb.layer_segments():
            if key in ("attn_main", "attn_qkv", "mlp_main") and tb.tp > 1:
                what = "attn" if key.startswith("attn") else "mlp"
                ops.append(self.c.tp("all_gather", self._gathered(what),
                                     f"tp all_gather {what} (recompute) L{layer} mb{mb}",
                                     mb, layer))
                self._fp8(ops[-1], what)
                tags[id(ops[-1])] = ("ag", what)
            c = tb.cost[key]
            regen = c.saved_bytes - sac[key].cached_bytes
            if key == "attn_norm":
                regen -= c.input_saved_bytes
            regen = max(0.0, regen)
            if sac[key].recompute_s <= 0 and regen <= 0:
                continue
            ops.append(Op(name=f"recompute {key} L{layer} mb{mb}", kind="compute",
                          stream="compute", phase="recompute", duration=sac[key].recompute_s,
                          alloc=(("activations", regen),) if regen else (),
                          transient=c.fwd_transient_unsaved_bytes, layer=layer,
                          micro_batch=mb, hw_flops=sac[key].recompute_flops,
                          category="recompute"))
            tags[id(ops[-1])] = ("seg", key)
        return self.atp.fuse_recompute(ops, tags) if self.atp is not None else ops

    # ------------------------------------------------------------------ forward
    def forward(self, block: str, layer: int, mb: int, phase: Phase = "fwd",
                middle: list[Op] | None = None) -> list[Op]:
        """A block's ops; ``middle``: an MoE layer's ops in place of the MLP's matmuls
        (torchtitan ``apply_moe_ep_tp``: the ``moe`` module's input all-gathered from
        Shard(1) to Replicate and its Partial output reduce-scattered back, like the MLP's)."""
        tp, lay = self.tb.tp, (layer if layer >= 0 else None)
        layered = block in ("attn", "mlp")
        sac = self.sac if layered and phase == "fwd" else None
        ckpt = (self.recompute or sac is not None) and layered and phase == "fwd"
        ops: list[Op] = []
        tags: dict[int, tuple[str, str]] = {}

        def seg(key: str, saved: bool = True) -> Op:
            lbl = f"{key}{'' if lay is None else f' L{layer}'}"
            op = self._seg(key, lbl, mb, lay, phase, backward=False,
                           alloc_saved=saved and not ckpt)
            tags[id(op)] = ("seg", key)
            if sac is not None and sac[key].cached_bytes:
                op.alloc = op.alloc + (("activations", sac[key].cached_bytes),)
            ops.append(op)
            return op

        def tp_comm(kind: str, what: str) -> None:
            if tp > 1:
                nbytes = self._gathered(what if kind == "all_gather" else "")
                op = self._fp8(self.c.tp(kind, nbytes, f"tp {kind} {what}"
                               f"{'' if lay is None else f' L{layer}'} mb{mb}", mb, lay), what)
                if sac is not None and kind == "reduce_scatter":
                    # The policy saves reduce-scatter outputs (the local tokens' branch).
                    op.alloc = (("activations", self._rs_out()),)
                if layered:
                    tags[id(op)] = ("ag" if kind == "all_gather" else "rs", what)
                ops.append(op)

        if block == "embed":
            seg("embed")
            tp_comm("reduce_scatter", "embed")
        elif block == "head":
            seg("head_norm")
            tp_comm("all_gather", "head")
            seg("head_main")
            if tp > 1:
                # Loss parallelism: all-reduces of the per-token max, sum of exponentials and
                # target logit over the vocabulary shards (torch loss_parallel).
                for what in ("max", "sumexp", "target"):
                    ops.append(self.c.tp("all_reduce", float(self.tb.tokens * FP32),
                                         f"tp all_reduce loss {what} mb{mb}", mb, None))
                    ops[-1].dtype = "f32"   # fp32 statistics, FP32 bytes above
            if phase == "fwd" and self._scoped:
                # The forward returns after the loss: the logits are released.
                ops[-1].free = ops[-1].free + (("buffers", self._scoped),)
                self._scoped = 0.0
        elif block == "attn":
            first = seg("attn_norm")
            if ckpt:
                c = self.tb.cost["attn_norm"]
                first.alloc = first.alloc + (("activations", c.input_bytes),)
            tp_comm("all_gather", "attn")
            if self.tb.mla_latent_bytes:
                seg("attn_latent")
                seg("attn_heads")
            elif self.tb.cp == 1:
                seg("attn_main")
            else:
                self._ring_forward(ops, seg, mb, lay)
            tp_comm("reduce_scatter", "attn")
            seg("attn_resid")
        else:
            seg("mlp_norm")
            tp_comm("all_gather", "mlp")
            if middle is None:
                seg("mlp_main")
            else:
                ops.extend(middle)
            tp_comm("reduce_scatter", "mlp")
            seg("mlp_resid")
        if phase == "recompute" and block == "attn":
            # The layer input is still held from the forward: recompute re-saves the rest.
            c = self.tb.cost["attn_norm"]
            op = ops[0]
            op.alloc = tuple((k, v - c.input_saved_bytes) if k == "activations" else (k, v)
                             for k, v in op.alloc)
        if self.atp is not None:
            ops = self.atp.fuse(ops, tags, backward=False)
        return [o for o in ops if o.duration > 0 or o.kind != "compute" or o.alloc or o.free]

    def _ring_forward(self, ops: list[Op], seg: Callable[..., Op], mb: int,
                      lay: int | None) -> None:
        seg("attn_qkv")
        self._kv_ring(ops, mb, lay, ops[-1].phase, lambda i: seg(f"attn_ring{i}"))
        seg("attn_o")

    def _kv_ring(self, ops: list[Op], mb: int, lay: int | None, phase: Phase,
                 step: Callable[[int], Op]) -> None:
        """The key/value exchanges of one ring pass around its cp steps (``step(i)`` appends
        step i's ops and returns the one that needs the keys), as ``_templated_ring_attention
        [_backward]`` issues them: the concatenation and first exchange before step 0; for
        1 <= i < cp-1 a concatenation (dead with the all-gather rotater: eager runs it,
        inductor drops it) and, all-to-all, the next shift. Eager, step i waits for the keys
        it uses; compiled, also for the exchange issued in it (:mod:`.cp`)."""
        tb, cp = self.tb, self.tb.cp
        tag = " (bwd)" if phase == "bwd" else ""
        where = f"{'' if lay is None else f' L{lay}'} mb{mb}"
        live = self._rotater_bytes()
        ops.append(self._cat(mb, lay, phase))
        if tb.rotate == "allgather":
            first = self.c.cp_gather(tb.kv_bytes * cp, f"cp all_gather K/V{tag}{where}", mb,
                                     lay)
        else:
            first = self.c.cp_shift(tb.kv_bytes, f"cp shift K/V 0{tag}{where}", mb, lay)
        first.deps = [ops[-1]]
        ops.append(first)
        arrived = first
        for i in range(cp):
            issued: Op | None = first if i == 0 else None
            if 0 < i < cp - 1:
                cat = self._cat(mb, lay, phase)
                if tb.rotate == "alltoall":
                    cat.deps = [arrived]
                    ops.append(cat)
                    issued = self.c.cp_shift(tb.kv_bytes, f"cp shift K/V {i}{tag}{where}", mb,
                                             lay)
                    issued.deps = [cat]
                    ops.append(issued)
                elif not tb.compiled:
                    ops.append(cat)
            start = len(ops)
            op = step(i)                      # appends the step's ops, this one among them
            for o in ops[start:]:
                if o.kind == "compute":
                    _hold(o, live)
            deps = [arrived] if i > 0 else []
            if tb.compiled and issued is not None:
                deps.append(issued)
            op.deps = op.deps + deps
            if i > 0 and issued is not None:
                arrived = issued

    def _rotater_bytes(self) -> float:
        """What the key/value rotater holds while a ring pass runs, to the function's return:
        the all-gather's output, every rank's keys and values
        (``_AllGatherRotater._aggregated_buffer``); with all-to-all the buffer in flight and
        the concatenation sent on."""
        tb = self.tb
        return tb.kv_bytes * (tb.cp if tb.rotate == "allgather" else 2)

    def _cat(self, mb: int, lay: int | None, phase: Phase) -> Op:
        c = self.tb.cost["attn_kv_cat"]
        return Op(name=f"cp cat K/V{'' if lay is None else f' L{lay}'} mb{mb}", kind="compute",
                  stream="compute", phase=phase, duration=c.fwd_s, layer=lay, micro_batch=mb,
                  category="forward" if phase == "fwd" else "backward")

    # ------------------------------------------------------------------ backward
    def backward(self, block: str, layer: int, mb: int, middle: list[Op] | None = None
                 ) -> list[Op]:
        """A block's backward ops; ``middle``: an MoE layer's backward in place of the MLP's
        matmuls (its caller then issues the layer's recomputation itself)."""
        tp, lay = self.tb.tp, (layer if layer >= 0 else None)
        ops: list[Op] = []
        if middle is not None:
            pass
        elif block == "mlp" and self.recompute:
            ops += self.forward("attn", layer, mb, phase="recompute")
            ops += self.forward("mlp", layer, mb, phase="recompute")
        elif block == "mlp" and self.sac is not None:
            ops += self._sac_recompute(layer, mb)

        tags: dict[int, tuple[str, str]] = {}

        def seg(key: str) -> Op:
            lbl = f"{key}{'' if lay is None else f' L{layer}'}"
            op = self._seg(key, lbl, mb, lay, "bwd", backward=True)
            tags[id(op)] = ("seg", key)
            ops.append(op)
            return op

        def tp_comm(kind: str, what: str) -> None:
            if tp > 1:
                nbytes = self._gathered(what if kind == "all_gather" else "")
                ops.append(self._fp8(self.c.tp(kind, nbytes, f"tp {kind} grad {what}"
                                     f"{'' if lay is None else f' L{layer}'} mb{mb}", mb, lay),
                                     what))
                if what in ("attn", "mlp"):
                    tags[id(ops[-1])] = ("ag" if kind == "all_gather" else "rs", what)

        if block == "head":
            seg("head_main")
            tp_comm("reduce_scatter", "head")
            seg("head_norm")
        elif block == "embed":
            tp_comm("all_gather", "embed")
            # Tied embeddings: the shared leaf's two gradients summed before AccumulateGrad.
            seg("embed").duration += self.tb.tied_sum_s
        elif block == "mlp":
            self._free_rs_out(seg("mlp_resid"))
            tp_comm("all_gather", "mlp")
            if middle is None:
                seg("mlp_main")
            else:
                ops.extend(middle)
            tp_comm("reduce_scatter", "mlp")
            seg("mlp_norm")
        else:
            self._free_rs_out(seg("attn_resid"))
            tp_comm("all_gather", "attn")
            if self.tb.mla_latent_bytes:
                self._mla_backward(ops, seg, mb, lay)
            elif self.tb.cp == 1:
                seg("attn_main")
            else:
                self._ring_backward(ops, seg, mb, lay)
                seg("attn_qkv")
            if not self.tb.mla_latent_bytes:
                tp_comm("reduce_scatter", "attn")
            seg("attn_norm")
        if self.atp is not None:
            ops = self.atp.fuse(ops, tags, backward=True)
        return [o for o in ops if o.duration > 0 or o.kind != "compute" or o.alloc or o.free]

    def _mla_backward(self, ops: list[Op], seg: Callable[[str], Op], mb: int,
                      lay: int | None) -> None:
        """Multi-head Latent Attention's backward under tensor parallelism: the heads, then
        an all-reduce of each latent's partial gradient (``wq_b`` and ``wkv_b`` are colwise,
        their input gradients sums over the ranks' heads; DTensor redistributes them to the
        ``NoParallel`` modules' Replicate), then the replicated latent projections. Their
        input gradient is then the same on every rank, so the all-gather's backward is each
        rank's slice of it: no reduce-scatter, unlike the colwise q/k/v of ``attn_main``."""
        seg("attn_heads")
        where = f"{'' if lay is None else f' L{lay}'} mb{mb}"
        # titan_blocks exists for MLA only with tp > 1 (MLA refuses cp): always reduced here.
        for what, nbytes in zip(("q", "kv"), self.tb.mla_latent_bytes, strict=True):
            ops.append(self.c.tp("all_reduce", nbytes, f"tp all_reduce grad {what} latent{where}",
                                 mb, lay))
        seg("attn_latent")

    def _ring_backward(self, ops: list[Op], seg: Callable[[str], Op], mb: int,
                       lay: int | None) -> None:
        tb = self.tb
        where = f"{'' if lay is None else f' L{lay}'} mb{mb}"
        seg("attn_o")
        dkv: list[Op] = []
        grad_kv_bytes = 2.0 * tb.kv_bytes     # fp32 gradients of the local keys and values

        def step(i: int) -> Op:
            op = seg(f"attn_ring{i}_bwd")
            if tb.compiled and dkv:
                op.deps = [dkv[-1]]           # compiled: the last shift was waited for at once
            _hold(op, tb.attn_acc_bytes)
            # The ring's saved tensors (local q, k, v, lse) are freed with the whole node.
            op.free = ()
            acc = seg(f"attn_ring{i}_acc")
            if dkv:
                acc.deps = [dkv[-1]]
            _hold(acc, tb.attn_acc_bytes)
            shift = self.c.cp_shift(grad_kv_bytes, f"cp shift dK/dV {i}{where}", mb, lay)
            shift.deps = [acc]
            ops.append(shift)
            dkv.append(shift)
            return op

        self._kv_ring(ops, mb, lay, "bwd", step)
        final = seg("attn_ring_final")
        _hold(final, self._rotater_bytes())    # the casts run before the backward returns
        final.deps = dkv[-1:]
        saved = sum(tb.cost[f"attn_ring{i}"].saved_bytes for i in range(tb.cp))
        final.free = (("activations", saved),)


def _hold(op: Op, nbytes: float) -> None:
    """Add one more tensor of ``nbytes`` to what ``op`` holds while it runs."""
    op.transient += nbytes
    if op.transient_parts:
        op.transient_parts = (*op.transient_parts, nbytes)
