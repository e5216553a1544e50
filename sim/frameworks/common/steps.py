"""Compute ops of the forward and backward passes, shared by the schedule builders.

A micro-batch runs: embedding, then per layer an attention block and an MLP block, then the
final norm, LM head and loss; backward in reverse. This module turns the priced blocks of
:mod:`sim.workload.layer_ops` into compute ops with their memory effects:

* forward allocates what autograd saves (activations; under autocast also the bf16 weight
  copies) and what lives until the forward returns (KV cache, logits; freed by the loss op);
* with full activation checkpointing a layer saves only its input; its backward first
  recomputes the layer's forward and holds the recomputed tensors until they are used.
  Non-reentrant ``torch.utils.checkpoint`` (torchtitan's ``checkpoint_wrapper``; Hugging
  Face's default since transformers PR #43203, 2026) stops the recomputation once the last
  saved tensor exists again (``_checkpoint_early_stop``); the reentrant variant
  (``use_reentrant=True``, transformers' default from PR #28538 in 4.36 until then) re-runs
  the whole layer forward under ``torch.enable_grad()`` in ``CheckpointFunction.backward``;
* backward frees each block's saved tensors and allocates its weight gradients.

The framework decides the gradient and parameter memory (``grad_alloc``) and adds its own
ops (collectives, bucket copies) around these.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from sim.program.ir import Op, Phase
from sim.workload.layer_ops import BlockCost, SacCost

BLOCKS = ("embed", "attn", "mlp", "head")


@dataclass
class PassOps:
    """The compute ops of one micro-batch, by (block, layer)."""

    forward: list[Op] = field(default_factory=list)
    backward: list[Op] = field(default_factory=list)
    fwd_of: dict[tuple[str, int], Op] = field(default_factory=dict)
    bwd_of: dict[tuple[str, int], Op] = field(default_factory=dict)


def unit_order(layers: int) -> list[tuple[str, int]]:
    """(block, layer) in forward order."""
    order: list[tuple[str, int]] = [("embed", -1)]
    for layer in range(layers):
        order += [("attn", layer), ("mlp", layer)]
    order.append(("head", -1))
    return order


def micro_batch_ops(costs: dict[str, BlockCost], layers: int, mb: int, recompute: bool,
                    autocast: bool, grad_alloc: Mapping[str, float],
                    extra_bwd_s: Mapping[str, float],
                    model_flops: Mapping[str, tuple[float, float]], stream: str = "compute",
                    sac: Mapping[str, SacCost] | None = None, reentrant: bool = False,
                    attn_key: Callable[[int], str] | None = None) -> PassOps:
    """Compute ops of one micro-batch (not yet added to a program).

    ``grad_alloc[block]``: gradient bytes the block's backward allocates (0 when they are
    accumulated into existing buffers). ``extra_bwd_s[block]``: framework work appended to the
    block's backward (gradient accumulation adds, bucket copies). ``model_flops[block]``:
    (forward, backward) FLOPs counted as model FLOPs. ``sac``: op-level selective
    checkpointing of each layer (:func:`sim.workload.layer_ops.op_sac_costs`): the forward keeps the
    layer input and the policy's cached outputs; the backward re-runs the rest of the layer
    and holds what the backward needs, as full checkpointing does. ``reentrant``: full
    checkpointing re-runs each layer's whole forward (no early stop). ``attn_key``: the
    key in ``costs`` of each layer's attention block (a sliding-window layer's own), else
    ``attn`` for every layer.
    """

    def key(block: str, layer: int) -> str:
        return attn_key(layer) if block == "attn" and attn_key is not None else block

    def cost(block: str, layer: int) -> BlockCost:
        return costs[key(block, layer)]

    recompute = recompute or sac is not None
    ops = PassOps()
    scoped_total = 0.0
    for block, layer in unit_order(layers):
        c = cost(block, layer)
        layered = block in ("attn", "mlp")
        ckpt = recompute and layered
        alloc: list[tuple[str, float]] = []
        saved_parts: tuple[float, ...] = ()
        if ckpt:
            # Only the layer input is kept (the attention block's input, the residual stream),
            # with selective checkpointing also the outputs its policy caches.
            if block == "attn":
                alloc.append(("activations", c.input_bytes))
            if sac is not None:
                alloc.append(("activations", sac[block].cached_bytes))
            scoped = c.forward_scoped_bytes + (c.weight_cast_bytes if autocast else 0.0)
            transient = c.fwd_transient_unsaved_bytes
            parts = c.fwd_transient_unsaved_parts
        else:
            alloc.append(("activations", c.saved_bytes + c.weight_cast_bytes))
            saved_parts = c.saved_parts
            scoped = c.forward_scoped_bytes
            transient = c.fwd_transient_bytes
            parts = c.fwd_transient_parts
        if scoped:
            alloc.append(("buffers", scoped))
            scoped_total += scoped
        ff, _ = model_flops[key(block, layer)]
        ordered = None if ckpt or c.weight_cast_bytes else ordered_forward_allocs(c)
        end_free: tuple[tuple[str, float], ...] = ()
        if ordered is not None:
            alloc, end_free = list(ordered[0]), ordered[1]
            transient, parts, saved_parts = 0.0, (), ()
        op = Op(name=f"fwd {block}{'' if layer < 0 else f' L{layer}'} mb{mb}", kind="compute",
                stream=stream, phase="fwd", duration=c.fwd_s, kernels=c.fwd_kernels,
                alloc=tuple(alloc), free=end_free,
                transient=transient, transient_parts=parts, alloc_parts=saved_parts,
                layer=layer if layer >= 0 else None, micro_batch=mb, flops=ff,
                hw_flops=c.flops_fwd, category="forward")
        if block == "head":
            # The forward returns after the loss: KV cache, logits and (checkpointed) weight
            # casts of the whole pass are released.
            op.free = op.free + (("buffers", scoped_total),)
        ops.forward.append(op)
        ops.fwd_of[(block, layer)] = op

    for block, layer in reversed(unit_order(layers)):
        c = cost(block, layer)
        layered = block in ("attn", "mlp")
        ckpt = recompute and layered
        duration = c.bwd_s + extra_bwd_s.get(block, 0.0)
        kernels = c.bwd_kernels
        alloc = []
        hw = c.flops_bwd
        phase: Phase = "bwd"
        saved_here = c.saved_bytes + c.weight_cast_bytes
        transient = c.bwd_transient_bytes
        parts = c.bwd_transient_parts
        if ckpt and block == "mlp":
            # Recompute the whole layer (attention block, then the MLP block up to its last
            # saved tensor) before the MLP's backward; hold what it saves again. Under
            # selective checkpointing only what the policy did not cache runs again.
            a = cost("attn", layer)
            kernels += a.fwd_kernels + c.fwd_kernels
            if sac is not None:
                duration += sac["attn"].recompute_s + sac["mlp"].recompute_s
                hw += sac["attn"].recompute_flops + sac["mlp"].recompute_flops
            else:
                duration += a.fwd_s + (c.fwd_s if reentrant else c.early_stop_fwd_s)
                hw += a.flops_fwd + c.flops_fwd
            recomputed = _non_input_saved(a) + a.weight_cast_bytes + saved_here
            alloc.append(("activations", recomputed))
            transient, parts = max((transient, parts), (a.fwd_transient_bytes,
                                   a.fwd_transient_parts), (c.fwd_transient_bytes,
                                   c.fwd_transient_parts))
            phase = "recompute"
        if grad_alloc.get(block):
            alloc.append(("gradients", grad_alloc[block]))
        cached = sac[block].cached_bytes if (sac is not None and layered) else 0.0
        # The checkpoint's own hold on the layer input, where no op's saved set has it.
        held = c.checkpoint_only_input_bytes if (ckpt and block == "attn") else 0.0
        free = (("activations", saved_here + cached + held),)
        fb = model_flops[key(block, layer)][1]
        name = f"bwd {block}{'' if layer < 0 else f' L{layer}'} mb{mb}"
        op = Op(name=name, kind="compute", stream=stream, phase=phase, duration=duration,
                kernels=kernels, alloc=tuple(alloc), free=free, transient=transient,
                transient_parts=parts,
                layer=layer if layer >= 0 else None, micro_batch=mb, flops=fb, hw_flops=hw,
                category="recompute+backward" if phase == "recompute" else "backward")
        ops.backward.append(op)
        ops.bwd_of[(block, layer)] = op
    return ops


def ordered_forward_allocs(c: BlockCost
                           ) -> tuple[tuple[tuple[str, float], ...],
                                      tuple[tuple[str, float], ...]] | None:
    """An eager block whose saved tensors come partly after its forward-scoped ones (the
    loss: ``log_softmax``'s output after the bf16 logits and their fp32 copy), as the
    tensors reach the caching allocator in forward order: (allocations, frees at the op's
    end) replacing its saved/scoped/transient requests; None for any other block.

    Order matters for the reserved peak: torchtitan's train loop frees the logits
    (``del pred`` before ``loss.backward()``, train.py) and the fp32 copy dies with the
    forward, leaving a hole *below* the saved ``log_softmax`` output that the backward's
    first fp32 gradient fills while the second one grows the segment.
    """
    if not c.late_saved_parts:
        return None
    early = list(c.saved_parts)
    for p in c.late_saved_parts:
        early.remove(p)
    alloc = [("activations", p) for p in early if p > 0]
    if c.forward_scoped_bytes:
        alloc.append(("buffers", c.forward_scoped_bytes))
    alloc += [("buffers", p) for p in c.fwd_transient_parts]
    alloc += [("activations", p) for p in c.late_saved_parts]
    return tuple(alloc), tuple(("buffers", p) for p in c.fwd_transient_parts)


def _non_input_saved(c: BlockCost) -> float:
    """Saved bytes of a block other than its input (the residual stream it reads)."""
    return c.saved_bytes - c.input_saved_bytes
