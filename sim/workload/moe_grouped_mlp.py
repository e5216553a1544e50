"""Transformer Engine's grouped linears over an MoE layer's local experts, as Megatron-Core's
``TEGroupedMLP`` runs them (:func:`grouped_linear`), and the fused grouped MLP of Transformer
Engine's operation fuser on Blackwell (:func:`fused_glu_mlp`); the experts' block around them
is :mod:`sim.workload.moe_ops`'s."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from sim.workload.kernels import BF16, FP32, Kernel, Tensor, accumulating
from sim.workload.layer_builder import _Builder
from sim.workload.layer_rules import (
    BLOCK_SCALED,
    fp8_element_bytes,
    linear_params,
    scaled_cast,
    te_scaled_cast,
)
from sim.workload.mx_grouped_mm import mx_grouped_linear
from sim.workload.mx_swizzle import scale_swizzles

if TYPE_CHECKING:
    from sim.workload.moe_ops import MoELayout


@dataclass(frozen=True)
class FusedEnds:
    """What a grouped linear of the fused grouped MLP (:attr:`MoELayout.fused_glu`) shares
    with its neighbours: its quantized input (both layouts) written by the kernel before it,
    its quantized output gradient written by the kernel after it (in backward), and what its
    own forward GEMM and dgrad GEMM write and read beyond their operands."""

    inputs: tuple[Tensor, Tensor] | None = None
    grads: tuple[Tensor, Tensor] | None = None
    fwd_writes: tuple[Tensor, ...] = ()
    dgrad_reads: tuple[Tensor, ...] = ()
    dgrad_writes: tuple[Tensor, ...] = ()


def grouped_linear(b: _Builder, x: Tensor, counts: tuple[float, ...], n_in: int, n_out: int,
                    name: str, lay: MoELayout, bias: bool, bias_grad_kernel: bool = True,
                    fused: FusedEnds | None = None, model_rows: float | None = None,
                    input_calls: int = 1) -> Tensor:
    """TE ``GroupedLinear`` over the local experts (``TEColumnParallelGroupedLinear`` /
    ``TERowParallelGroupedLinear``): one forward, dgrad and wgrad grouped GEMM, each priced
    as its per-expert GEMMs (:func:`sim.workload.grouped_gemm.grouped_gemm_time`), or on the
    GroupedTensor path (``lay.te_ops``) as one GEMM of all the rows; the weight
    gradients accumulate into ``main_grad`` (gradient-accumulation fusion; fp32 unless
    ``lay.main_grad_bytes`` says 16 bits). With FP8 the
    input, weights and output gradient are cast as in :func:`sim.workload.megatron_ops._linear`
    (TE's multi-tensor casts do every expert in one launch). ``fused``: the quantized
    input and output gradient come from the neighbouring fused kernels (:class:`FusedEnds`).
    ``model_rows``: the routed rows before alignment padding, whose FLOPs are the model's
    (the GEMMs run ``counts``; default their sum). With ``lay.torchao_mx`` the linear is
    torchao's MXFP8 grouped GEMM instead, ``input_calls`` calls of it sharing the input
    (:func:`sim.workload.mx_grouped_mm.mx_grouped_linear`)."""
    if lay.torchao_mx:
        assert not bias and fused is None, "torchtitan's experts have no bias, no fused MLP"
        return mx_grouped_linear(b, x, counts, n_in, n_out, name, lay, input_calls, model_rows)
    rows = sum(counts)
    experts = len(counts)
    b.block.params += experts * linear_params(n_in, n_out, bias)
    fl = 2.0 * (rows if model_rows is None else model_rows) * n_in * n_out
    y = b.t(f"{name}.out", rows * n_out, BF16)
    gy = b.t(f"{name}.g_out", rows * n_out, BF16)
    gx = b.t(f"{name}.g_in", rows * n_in, BF16)
    gw = b.t(f"{name}.main_grad", experts * n_in * n_out, lay.main_grad_bytes)

    ends = fused or FusedEnds()

    def gemm(pass_: str, reads: tuple[Tensor, ...], out: Tensor, fp8: bool,
             more: tuple[Tensor, ...] = (), extra: tuple[Tensor, ...] = ()) -> Kernel:
        # The GroupedTensor path is one kernel over all experts' tiles: one GEMM of the rows.
        return Kernel(f"{name}.{pass_}", "gemm", reads + more, (out, *extra), fl,
                      gemm=(rows, n_in, n_out, pass_), fp8=fp8,
                      group=() if lay.te_ops else counts, launches=n_launch,
                      grouped_impl="torch" if lay.torch_grouped_mm else "cublas",
                      fp8_block=fp8 and lay.fp8 in BLOCK_SCALED)

    n_launch = sum(1 for c in counts if c > 0) \
        if lay.gemm_per_expert and not lay.te_ops else 1

    if lay.fp8 is None:
        w = b.t(f"{name}.w", experts * n_in * n_out, BF16)
        b.fwd(gemm("fwd", (x, w), y, False))
        b.save(x)
        ks = [gemm("dgrad", (gy, w), gx, False), gemm("wgrad", (gy, x), gw, False)]
    else:
        amax = lay.fp8 == "tensorwise"
        tr = lay.fp8_transpose
        e8 = fp8_element_bytes(lay.fp8)
        numel_w = experts * n_in * n_out
        w16 = b.t(f"{name}.w_bf16_share", numel_w * lay.weight_cast_share, BF16)
        w8s = b.t(f"{name}.w_fp8_share", (2 if tr else 1) * numel_w * lay.weight_cast_share,
                  e8)
        w8 = b.t(f"{name}.w_fp8", numel_w, e8)
        # The saved copy keeps its name (in_fp8_t, which recomputation looks up) when the
        # one row-wise copy serves both GEMMs.
        x8 = b.t(f"{name}.in_fp8" if tr else f"{name}.in_fp8_t", rows * n_in, e8)
        x8t = b.t(f"{name}.in_fp8_t", rows * n_in, e8) if tr else x8
        if ends.inputs:
            x8, x8t = ends.inputs
        # tex.split_quantize: each non-empty expert's rows quantized on their own
        # (te_scaled_cast); the weights' casts run on the first micro-batch only. Its fused
        # multi-tensor cast is delayed scaling's and needs both layouts (per expert on
        # Blackwell); the block recipes quantize each split in a launch of its own
        # (multi_tensor_quantize_impl, TE pytorch/csrc/extensions/cast.cpp).
        pieces = 1 if lay.te_ops else sum(1 for c in counts if c > 0)
        multi = tr and lay.fp8 == "delayed"
        casts = scaled_cast(name, "w", w16, (w8s,), amax, te=True)
        if not ends.inputs:
            casts += te_scaled_cast(name, "in", x, (x8, x8t) if tr else (x8,), amax, pieces,
                                    fused_multi=multi)
        for k in casts:
            b.fwd(k)
        # TE swizzles the MXFP8 scales each grouped GEMM call needs, one multi-tensor kernel
        # an operand over all the experts (mx_swizzle).
        sw = lay.mx_swizzled if lay.fp8 == "mxfp8" else frozenset()
        nx, ng = rows * n_in, rows * n_out
        for k in scale_swizzles(name, "fwd", (("in", nx), ("w", numel_w)), sw):
            b.fwd(k)
        b.fwd(gemm("fwd", (x8, w8), y, True, extra=ends.fwd_writes))
        b.save(x8t)
        g8 = b.t(f"{name}.g_out_fp8", rows * n_out, e8)
        g8t = b.t(f"{name}.g_out_fp8_t", rows * n_out, e8) if tr else g8
        if ends.grads:
            g8, g8t = ends.grads
        ks = [] if ends.grads else te_scaled_cast(name, "g", gy, (g8, g8t) if tr else (g8,),
                                                   amax, pieces, fused_multi=multi)
        ks += [*scale_swizzles(name, "dgrad", (("g", ng), ("w", numel_w)), sw),
               gemm("dgrad", (g8, w8), gx, True, ends.dgrad_reads, ends.dgrad_writes),
               *scale_swizzles(name, "wgrad", (("g", ng), ("in", nx)), sw),
               gemm("wgrad", (g8t, x8t), gw, True)]
    if bias and bias_grad_kernel:
        gb = b.t(f"{name}.g_b", experts * n_out, FP32)
        ks.append(Kernel(f"{name}.g_bias", "elementwise", (gy,), (gb,)))
    # TE GroupedLinear's fuse_wgrad_accumulation: each expert's wgrad adds into its main_grad.
    b.bwd(*(accumulating(k, gw) if k.name == f"{name}.wgrad" else k for k in ks))
    b.block.weight_grads.append(gw)
    return y


def fused_glu_mlp(b: _Builder, x: Tensor, probs: Tensor, counts: tuple[float, ...], h: int,
                   f: int, lay: MoELayout, bias: bool = False,
                   model_rows: float | None = None) -> Tensor:
    """fc1 -> SwiGLU x prob -> fc2 as the fused grouped MLP runs them
    (:attr:`MoELayout.fused_glu`): fc1's forward GEMM also writes fc2's MXFP8 input (both
    layouts) from its 16-bit output, which it keeps for the backward with the probs; fc2's
    dgrad GEMM reads them back and writes fc1's MXFP8 output gradient and the probs'
    gradient. ``bias``: both linears' biases ride in the epilogues; their gradients are one
    reduction kernel each (TE's grouped dbias)."""
    prow = sum(counts)
    e8 = fp8_element_bytes("mxfp8")
    tr = lay.fp8_transpose
    a8 = b.t("fc2.in_fp8", prow * f, e8)
    a8t = b.t("fc2.in_fp8_t", prow * f, e8) if tr else a8
    g8 = b.t("fc1.g_out_fp8", prow * 2 * f, e8)
    g8t = b.t("fc1.g_out_fp8_t", prow * 2 * f, e8) if tr else g8
    gp = b.t("g_probs", prow, lay.router_bytes)
    fc1 = grouped_linear(b, x, counts, h, 2 * f, "fc1", lay, bias, fused=FusedEnds(
        grads=(g8, g8t), fwd_writes=(a8, a8t) if tr else (a8,)), model_rows=model_rows)
    b.save(fc1, probs)
    return grouped_linear(b, a8, counts, f, h, "fc2", lay, bias, fused=FusedEnds(
        inputs=(a8, a8t), dgrad_reads=(fc1, probs),
        dgrad_writes=(g8, g8t, gp) if tr else (g8, gp)), model_rows=model_rows)
