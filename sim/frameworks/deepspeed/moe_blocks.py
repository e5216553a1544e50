"""The kernels of one DeepSpeed-MoE layer on one rank (``deepspeed/moe/sharded_moe.py`` and
``experts.py`` at commit 38327e07), in three blocks around its two all-to-alls.

``MOELayer.forward`` on the ``s`` tokens of a micro-batch (``reshaped_input``, [s, h]):

1. **gate** (``TopKGate.forward``): ``input.float()`` and ``wg.weight.float()``, the fp32
   gate GEMM, then ``top1gating`` / ``top2gating`` / ``topkgating`` in fp32: softmax,
   argmax (top-2: Gumbel noise and a second argmax; top-k: ``torch.topk``), one-hot masks,
   ``cumsum`` locations, the capacity mask, the aux loss; per route a one-hot of the
   location over the capacity ([s, c]) and ``einsum("se,sc->sec")`` into the fp32
   ``combine_weights`` [s, e, c]; ``dispatch_mask = combine_weights.bool()``. Then the
   dispatch ``einsum("sec,sm->ecm", dispatch_mask.type_as(input), input)``: a GEMM of
   [e x c, s] by [s, h] into the capacity-padded [e, c, h] buffer (16-bit);
2. **experts** (``Experts.forward``), after the first all-to-all: the [ep, local, c, h]
   buffer is cut into one chunk per local expert (``chunk(dim=1)``: each [ep, 1, c, h], not
   contiguous when there are several local experts, so ``nn.Linear`` copies it), each run
   through its own expert module (``nn.Linear`` layers, one GEMM each over ep x c rows, one
   expert after another on one stream: no grouped GEMM), ``torch.cat`` of the outputs;
3. **combine**, after the second all-to-all: ``einsum("sec,ecm->sm",
   combine_weights.type_as(input), expert_output)``, a GEMM of [s, e x c] by [e x c, h];
   with ``use_residual`` (``MoE.forward``) the dense MLP on every token, the 2-way
   ``coefficient`` linear, its softmax and the weighted sum; then the block's residual add.

With ``use_tutel`` (top-1 only) ``top1gating`` returns indices, locations and gates and
Tutel's ``fast_dispatcher`` encodes and decodes with gather/scatter kernels: no [s, e, c]
tensors and no einsum GEMMs. The expert GEMMs always run over the full capacity, padding
rows included: that is what the capacity factor costs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sim.workload.kernels import BF16, FP32, IDX, Block, Kernel, Style, Tensor
from sim.workload.layer_builder import _Builder
from sim.workload.layer_ops import mlp_projections
from sim.workload.model import ModelSpec

STYLE = Style("bf16")
"""DeepSpeed casts the module to 16-bit (see :mod:`sim.frameworks.deepspeed`)."""
MASK = 1
"""Bytes of a bool element (``dispatch_mask``)."""


def capacity(tokens: int, experts: int, k: int, capacity_factor: float,
             min_capacity: int) -> int:
    """Tokens each expert takes per micro-batch with ``drop_tokens`` (``_capacity``):
    ``ceil(tokens / experts x capacity_factor')`` in float32, at least ``min_capacity``,
    where top-2 and top-k gating pass ``capacity_factor x k`` (top-1: ``x 1``).

    Examples
    --------
    >>> capacity(4096, 8, 2, 1.0, 4)          # Mixtral: top-2 over 8 experts
    1024
    >>> capacity(2048, 128, 1, 1.25, 4)       # DeepSpeed-MoE 128 experts, top-1
    20
    >>> capacity(16, 128, 1, 1.0, 4)          # min_capacity floor
    4
    """
    cf = np.float32(capacity_factor * k)
    c = int(np.ceil(np.float32(tokens / experts) * cf))
    return max(c, min_capacity)


@dataclass(frozen=True)
class DsMoELayout:
    """What shapes one DeepSpeed-MoE layer's kernels on one rank."""

    tokens: int
    """Tokens of the micro-batch entering the layer (``s``)."""
    ep: int
    capacity: int
    """``c``: rows per expert of the capacity-padded dispatch buffer."""
    use_residual: bool = False
    use_tutel: bool = False


def _norm_in(b: _Builder, m: ModelSpec, s: int, readers: int) -> Tensor:
    """The block's input and its pre-MLP norm, the norm output read by ``readers`` ops."""
    h = m.hidden
    x = b.t("in", s * h, STYLE.act_bytes)
    b.block.inputs.append(x)
    b.sum_grads(2, s * h, STYLE.act_bytes, "resid_in")
    y = b.norm(m, x, s, "norm")
    b.sum_grads(readers, s * h, BF16, "norm_out")
    return y


def gate_block(m: ModelSpec, lay: DsMoELayout) -> Block:
    """Norm, fp32 gate, gating, dispatch (the forward up to the first all-to-all)."""
    assert m.moe is not None
    e, k, h, s, c = m.moe.experts, m.moe.top_k, m.hidden, lay.tokens, lay.capacity
    b = _Builder("moe_gate", STYLE)
    y = _norm_in(b, m, s, 3 if lay.use_residual else 2)
    # TopKGate.forward: input.float(), wg.weight.float(), fp32 linear (TF32 off by default:
    # priced at the 16-bit rate as Megatron's router is, an s x h x e GEMM).
    x32 = b.cast(y, s * h, FP32, "in_fp32")
    w = b.t("wg.w", e * h, BF16)
    w32 = b.cast(w, e * h, FP32, "wg.w_fp32")
    b.block.params += e * h
    logits = b.t("logits", s * e, FP32)
    fl = 2.0 * s * h * e
    b.fwd(Kernel("wg.fwd", "gemm", (x32, w32), (logits,), fl, gemm=(s, h, e, "fwd")))
    b.save(x32, w32)
    glog = b.t("g_logits", s * e, FP32)
    gx32, gw = b.t("wg.g_in", s * h, FP32), b.t("wg.g_w", e * h, FP32)
    gy = b.t("wg.g_in_bf16", s * h, BF16)
    gwb = b.t("wg.g_w_bf16", e * h, BF16)
    b.bwd(Kernel("wg.dgrad", "gemm", (glog, w32), (gx32,), fl, gemm=(s, h, e, "dgrad")),
          Kernel("wg.wgrad", "gemm", (glog, x32), (gw,), fl, gemm=(s, h, e, "wgrad")),
          Kernel("wg.g_in_to_bf16", "elementwise", (gx32,), (gy,)),
          Kernel("wg.g_w_to_bf16", "elementwise", (gw,), (gwb,)))
    b.block.weight_grads.append(gwb)
    # Gating on [s, e] (fp32; int64 masks and locations): softmax, per route an argmax or
    # topk, a one-hot mask and its cumsum, the capacity compare; aux loss and counts.
    se64 = s * e * IDX
    gates = b.t("gates", s * e, FP32)
    b.fwd(Kernel("softmax", "elementwise", (logits,), (gates,)))
    b.save(gates)
    routes = min(k, 2) if k <= 2 else 1          # top-k runs one topk + one mask
    for r in range(routes):
        mask = Tensor(f"moe_gate.mask{r}", se64)
        loc = Tensor(f"moe_gate.loc{r}", se64)
        b.fwd(Kernel(f"route{r}", "elementwise", (gates,), (mask,)))
        b.fwd(Kernel(f"cumsum{r}", "elementwise", (mask,), (loc,)))
        b.fwd(Kernel(f"capacity_mask{r}", "elementwise", (mask, loc), (mask,)))
    b.fwd(Kernel("aux_loss", "elementwise", (gates, Tensor("moe_gate.mask0", se64)), ()))
    gg = b.t("g_gates", s * e, FP32)
    b.bwd(Kernel("softmax.bwd", "elementwise", (gg, gates), (glog,)))
    if lay.use_tutel:
        # fast_dispatcher.encode: each kept token copied into its [e x c] slot.
        src = b.t("encode.rows", s * h, BF16)
        out = b.t("dispatched", e * c * h, BF16)
        b.fwd(Kernel("tutel_encode", "elementwise", (src,), (out,)))
        g = b.t("g_dispatched", e * c * h, BF16)
        b.bwd(Kernel("tutel_encode.bwd", "elementwise", (g,), (b.t("g_rows", s * h, BF16),)))
        b.block.outputs.append(out)
        return b.finish()
    sec32 = b.t("combine_weights", s * e * c, FP32)
    per_route = k if k <= 2 else 1
    for r in range(per_route):
        # one-hot of the location over the capacity, then einsum("se,sc->sec"); top-k
        # (k > 2) one-hots the [s, e] locations straight into [s, e, c].
        width = s * c if k <= 2 else s * e * c
        lsc = b.t(f"loc_sc{r}", width, FP32)
        part = b.t(f"combine{r}", s * e * c, FP32)
        b.fwd(Kernel(f"one_hot_loc{r}", "elementwise", (Tensor("moe_gate.loc", se64),),
                     (lsc,)))
        b.fwd(Kernel(f"einsum_sec{r}", "elementwise", (gates, lsc), (part,)))
        b.save(lsc)
        # Backward of einsum("se,sc->sec") for the gates: the [s, e, c] gradient summed over c.
        b.bwd(Kernel(f"einsum_sec{r}.bwd", "elementwise",
                     (b.t("g_combine", s * e * c, FP32), lsc), (gg,)))
    if k == 2:
        b.fwd(Kernel("combine_sum", "elementwise", (sec32, sec32), (sec32,)))
    mask = b.t("dispatch_mask", s * e * c, MASK)
    maskb = b.t("dispatch_mask_bf16", s * e * c, BF16)
    b.fwd(Kernel("bool", "elementwise", (sec32,), (mask,)))
    b.fwd(Kernel("type_as", "elementwise", (mask,), (maskb,)))
    b.save(sec32, maskb)
    out = b.t("dispatched", e * c * h, BF16)
    fl = 2.0 * e * c * s * h
    # einsum("sec,sm->ecm"): [e c, s] x [s, h]; the mask needs no gradient, the tokens'
    # is [s, e c] x [e c, h] (the "wgrad" shape of this product).
    b.fwd(Kernel("dispatch_einsum", "gemm", (maskb, y), (out,), fl, gemm=(e * c, s, h, "fwd")))
    g = b.t("g_dispatched", e * c * h, BF16)
    b.bwd(Kernel("dispatch_einsum.bwd", "gemm", (g, maskb), (b.t("g_y", s * h, BF16),), fl,
                 gemm=(e * c, s, h, "wgrad")))
    b.block.outputs.append(out)
    return b.finish()


def experts_block(m: ModelSpec, lay: DsMoELayout) -> Block:
    """``Experts.forward``: each local expert's MLP over its ep x c rows, one after another
    (``nn.Linear``: one GEMM per projection), and ``torch.cat`` of the outputs."""
    assert m.moe is not None
    local = m.moe.experts // lay.ep
    h = m.hidden
    rows = lay.ep * lay.capacity
    b = _Builder("moe_experts", STYLE)
    x = b.t("in", local * rows * h, BF16)
    b.block.inputs.append(x)
    outs = []
    for i in range(local):
        chunk = x
        if local > 1:
            # chunk(dim=1) of [ep, local, c, h] is a strided view: matmul's reshape copies.
            chunk = b.cast(b.t(f"e{i}.view", rows * h, BF16), rows * h, BF16, f"e{i}.chunk")
            b.bwd(Kernel(f"e{i}.chunk.bwd", "elementwise", (b.t(f"e{i}.g_chunk", rows * h,
                                                                  BF16),),
                         (b.t(f"e{i}.g_view", rows * h, BF16),)))
        outs.append(mlp_projections(b, m, chunk, rows, m.moe.ffn_hidden,
                                    (f"e{i}.gate", f"e{i}.up", f"e{i}.down")))
    out = b.t("cat", local * rows * h, BF16)
    b.fwd(Kernel("cat", "elementwise", tuple(outs), (out,)))
    b.bwd(Kernel("cat.bwd", "elementwise", (b.t("g_cat", local * rows * h, BF16),),
                 tuple(b.t(f"g_out{i}", rows * h, BF16) for i in range(local))))
    b.block.outputs.append(out)
    return b.finish()


def combine_block(m: ModelSpec, lay: DsMoELayout) -> Block:
    """Combine einsum (or Tutel's decode), the Residual-MoE dense MLP and mix, the residual
    add."""
    assert m.moe is not None
    e, h, s, c = m.moe.experts, m.hidden, lay.tokens, lay.capacity
    b = _Builder("moe_combine", STYLE)
    xo = b.t("in", e * c * h, BF16)
    b.block.inputs.append(xo)
    res_in = b.t("resid_stream", s * h, BF16)
    moe_out = b.t("combined", s * h, BF16)
    if lay.use_tutel:
        b.fwd(Kernel("tutel_decode", "elementwise", (xo,), (moe_out,)))
        b.bwd(Kernel("tutel_decode.bwd", "elementwise", (b.t("g_combined", s * h, BF16),),
                     (b.t("g_in", e * c * h, BF16),)))
    else:
        sec32 = b.t("combine_weights", s * e * c, FP32)
        cw = b.t("combine_weights_bf16", s * e * c, BF16)
        b.fwd(Kernel("type_as", "elementwise", (sec32,), (cw,)))
        fl = 2.0 * s * e * c * h
        b.fwd(Kernel("combine_einsum", "gemm", (cw, xo), (moe_out,), fl,
                     gemm=(s, e * c, h, "fwd")))
        b.save(cw, xo)
        gout = b.t("g_combined", s * h, BF16)
        gcw = b.t("g_combine_weights", s * e * c, BF16)
        b.bwd(Kernel("combine_einsum.dgrad_w", "gemm", (gout, xo), (gcw,), fl,
                     gemm=(s, e * c, h, "dgrad")),
              Kernel("combine_einsum.dgrad_x", "gemm", (gout, cw), (b.t("g_in", e * c * h,
                                                                         BF16),), fl,
                     gemm=(s, e * c, h, "wgrad")),
              Kernel("type_as.bwd", "elementwise", (gcw,), (b.t("g_cw32", s * e * c, FP32),)))
    out = moe_out
    if lay.use_residual:
        # MoE.forward (Residual MoE): output_mlp = mlp(x); coef = softmax(coefficient(x));
        # output * coef[..., 0:1] + output_mlp * coef[..., 1:].
        y = b.t("norm_out", s * h, BF16)
        mlp = mlp_projections(b, m, y, s, m.moe.ffn_hidden, ("res.gate", "res.up", "res.down"))
        coef = b.linear(y, s, h, 2, "coefficient", bias=True)
        sm = b.t("coef_softmax", s * 2, BF16)
        b.fwd(Kernel("coef_softmax", "elementwise", (coef,), (sm,)))
        b.save(sm, moe_out, mlp)
        mixed = b.t("mixed", s * h, BF16)
        b.fwd(Kernel("mix", "elementwise", (moe_out, mlp, sm), (mixed,)))
        gm = b.t("g_mixed", s * h, BF16)
        b.bwd(Kernel("mix.bwd", "elementwise", (gm, moe_out, mlp, sm),
                     (b.t("g_moe", s * h, BF16), b.t("g_mlp", s * h, BF16))),
              Kernel("coef_softmax.bwd", "elementwise", (b.t("g_sm", s * 2, BF16), sm),
                     (b.t("g_coef", s * 2, BF16),)))
        out = mixed
    b.block.outputs.append(b.residual_add(res_in, out, s, h, "resid"))
    return b.finish()


def moe_blocks(m: ModelSpec, lay: DsMoELayout) -> tuple[Block, Block, Block]:
    """(gate, experts, combine) of one DeepSpeed-MoE layer on one rank."""
    return gate_block(m, lay), experts_block(m, lay), combine_block(m, lay)
