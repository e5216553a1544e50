"""The kernel rules of a linear layer and a fused norm: one home for each, whoever builds them.

Three builders write linear layers: PyTorch's ``nn.Linear`` in eager or under autocast
(:meth:`sim.workload.layer_builder._Builder.linear`), torchao's ``Float8Linear``
(:meth:`~sim.workload.layer_builder._Builder.float8_linear`) and Megatron-LM's tensor-parallel
linears,
16-bit or FP8 through Transformer Engine (:func:`sim.workload.megatron_ops._linear`). What they
share
is here, and produces the same kernels (names, order, reads, writes, sizes) for all of them:

* the parameters of ``y = x W^T (+ b)``: ``n_in * n_out`` (``+ n_out``);
* its three GEMMs of ``2 * tokens * n_in * n_out`` FLOPs each, forward ``[T, n_in] x [n_in,
  n_out]``, the input gradient (dgrad) and the weight gradient (wgrad), priced by
  :meth:`sim.hardware.compute.ComputeModel.gemm_time` with the shape ``(T, n_in, n_out, pass)``;
* on 16-bit operands, forward reads ``(x, W)`` and autograd saves ``x``; dgrad reads the
  output gradient and ``W``, wgrad the output gradient and ``x``
  (``torch/csrc/autograd/FunctionsManual.cpp``: ``mm_mat1_backward``, ``mm_mat2_backward``);
* a scaled cast to FP8: current (tensorwise) scaling first reduces the tensor's amax in a pass
  of its own, then casts; delayed scaling takes the scale from the amax history and records
  the new amax inside the cast kernel (Transformer Engine ``recipe.py``; torchao
  ``float8/float8_scaling_utils.py``);
* the bias gradient: the output gradient summed over tokens;
* a fused norm's forward (torch ``F.rms_norm``/``native_layer_norm``, apex or Transformer
  Engine): one kernel reading the input and writing the output with per-row statistics, input
  and statistics saved for backward.

What the builders do differently stays with them, because the frameworks do it differently:
which tensor each GEMM reads under FP8 (torchao keeps the bf16 input and casts again in
backward; Transformer Engine saves the transposed FP8 copy), the dtype the weight gradient
lands in (bf16, fp32 under autocast, fp32 ``main_grad`` with Megatron's gradient-accumulation
fusion) and the norms' backward kernels (see :meth:`~sim.workload.layer_builder._Builder.rmsnorm`,
:meth:`~sim.workload.layer_builder._Builder.layernorm` and :func:`sim.workload.megatron_ops._norm`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, TypedDict

from sim.config.base import Fp8Recipe
from sim.workload.kernels import Kernel, Tensor

if TYPE_CHECKING:
    from sim.workload.layer_builder import _Builder

FP8 = 1
"""Bytes per FP8 element (E4M3 or E5M2)."""

BLOCK_SCALED: frozenset[str] = frozenset({"mxfp8", "blockwise"})
"""The recipes (:data:`sim.config.base.Fp8Recipe`) whose scales belong to blocks along a
GEMM's reduction dimension."""

BLOCK_SCALE_BYTES = 1.0 / 32.0
"""Scale bytes per element of each block-scaled layout: one E8M0 byte per 32 elements
(MXFP8, OCP Microscaling Formats spec v1.0) or one fp32 per 128 (``Float8BlockScaling``'s
1x128 blocks): 1/32 either way (the weights' 128x128 blocks keep far less)."""


def fp8_element_bytes(recipe: Fp8Recipe | None) -> float:
    """Bytes an FP8 tensor of ``recipe`` takes per element, its block scales included.

    Examples
    --------
    >>> fp8_element_bytes("tensorwise"), fp8_element_bytes("mxfp8")
    (1, 1.03125)
    """
    return FP8 + BLOCK_SCALE_BYTES if recipe in BLOCK_SCALED else FP8


def fp8_both_layouts(arch: str, recipe: Fp8Recipe | None) -> bool:
    """Whether Transformer Engine's FP8 quantization writes a column-wise copy beside the
    row-wise data for the backward GEMMs (``fp8_transpose`` of the layouts).

    Hopper's FP8 GEMMs take only the TN layout, so every recipe there needs the transposed
    copy. Blackwell's take any layout (``nvte_is_non_tn_fp8_gemm_supported``), so per-tensor
    scales let the row-wise data serve all three GEMMs; block scales run along the reduction
    dimension, which the weight-gradient GEMM (and the input-gradient one, for the weight)
    reduces the other way, so the block recipes quantize both directions on every GPU
    (``MXFP8Quantizer`` / ``Float8BlockQuantizer`` with ``columnwise_usage``, TE
    ``pytorch/csrc/quantizer.cpp``).

    Examples
    --------
    >>> fp8_both_layouts("blackwell", "tensorwise"), fp8_both_layouts("blackwell", "mxfp8")
    (False, True)
    >>> fp8_both_layouts("hopper", "delayed")
    True
    """
    return arch != "blackwell" or recipe in BLOCK_SCALED


def linear_params(n_in: int, n_out: int, bias: bool) -> int:
    """Parameters of ``y = x W^T (+ b)`` with ``W`` of ``n_out x n_in``.

    Examples
    --------
    >>> linear_params(4096, 1024, bias=True)
    4195328
    """
    return n_in * n_out + (n_out if bias else 0)


def linear_gemm(name: str, pass_: str, reads: tuple[Tensor, ...], out: Tensor,
                tokens: float, n_in: int, n_out: int, fp8: bool = False,
                fp8_block: bool = False) -> Kernel:
    """One of a linear layer's three GEMMs (``pass_``: ``fwd``, ``dgrad`` or ``wgrad``), named
    ``{name}.{pass_}``: ``2 * tokens * n_in * n_out`` FLOPs, on FP8 operands if ``fp8``
    (with block scales if ``fp8_block``)."""
    return Kernel(f"{name}.{pass_}", "gemm", reads, (out,), 2.0 * tokens * n_in * n_out,
                  gemm=(tokens, n_in, n_out, pass_), fp8=fp8, fp8_block=fp8 and fp8_block)


def linear16_gemms(b: _Builder, name: str, x: Tensor, w: Tensor, y: Tensor, gy: Tensor,
                   gx: Tensor, gw: Tensor, tokens: float, n_in: int, n_out: int
                   ) -> list[Kernel]:
    """A linear on 16-bit operands: issue its forward GEMM ``y = x W^T``, save ``x``, and
    return its backward GEMMs (dgrad into ``gx``, wgrad into ``gw``) for the caller's
    :meth:`~sim.workload.layer_builder._Builder.bwd` group."""
    b.fwd(linear_gemm(name, "fwd", (x, w), y, tokens, n_in, n_out))
    b.save(x)
    return [linear_gemm(name, "dgrad", (gy, w), gx, tokens, n_in, n_out),
            linear_gemm(name, "wgrad", (gy, x), gw, tokens, n_in, n_out)]


def scaled_cast(name: str, tag: str, src: Tensor, dsts: tuple[Tensor, ...], amax: bool,
                te: bool = False) -> list[Kernel]:
    """Cast ``src`` to FP8 (``dsts``: one or more layouts written by the one kernel): with
    ``amax`` (current scaling) a reduction ``{name}.amax_{tag}`` first, then the cast
    ``{name}.cast_{tag}``. ``te``: Transformer Engine's amax kernel (``amax_kernel``,
    ``common/recipe/current_scaling.cu``: 512-thread blocks over 32-byte vector loads in a
    grid-stride loop, each block's maximum folded in by one ``atomicMax``), which streams its
    input as an elementwise loop does (:attr:`Kernel.streams`), not a row per block."""
    ks = [Kernel(f"{name}.amax_{tag}", "elementwise", (src,), (), streams=te)] if amax else []
    ks.append(Kernel(f"{name}.cast_{tag}", "elementwise", (src,), dsts))
    return ks


def te_scaled_cast(name: str, tag: str, src: Tensor, dsts: tuple[Tensor, ...], amax: bool,
                   pieces: int = 1, amax_in_norm: bool = False, fused_multi: bool = True
                   ) -> list[Kernel]:
    """Transformer Engine's quantization of ``src`` to FP8 (``dsts``: the layouts its cast
    writes), as :func:`scaled_cast` names the kernels, with the launches TE makes.

    Current scaling (``amax``, ``Float8CurrentScalingQuantizer::quantize_impl`` in
    ``transformer_engine/pytorch/csrc/quantizer.cpp``, TE 2.7) runs four GPU operations per
    tensor: ``nvte_compute_amax`` (``common/recipe/current_scaling.cu``: a
    ``cudaMemsetAsync`` of the amax, then the amax kernel), ``nvte_compute_scale_from_amax``
    (a one-thread kernel) and the cast (``nvte_quantize_v2``). They are two kernels here,
    ``{name}.amax_{tag}`` and ``{name}.cast_{tag}``, each standing for two launches per
    piece (:attr:`Kernel.launches`: every launch pays the GPU's fixed kernel time and the
    host's C++ launch cost; the bytes stream once). ``pieces``: tensors quantized one by one,
    each with its own scale: ``GroupedLinear`` quantizes each local expert's rows with its own
    quantizer (``tex.split_quantize``, ``pytorch/csrc/extensions/cast.cpp``, which has a
    fused multi-tensor kernel only for the delayed recipe's ``Float8Quantizer``; a current-
    scaling quantizer is run per split). Delayed scaling casts in one launch and records the
    amax inside the cast kernel; its multi-tensor kernel (``nvte_multi_cast_transpose``) needs
    every split's row-wise and column-wise outputs, so without the transposed copy
    (Blackwell, ``fused_multi`` False) the splits are cast one launch each.

    ``amax_in_norm``: the tensor is a fused norm's output (``LayerNormLinear``'s
    ``with_quantized_norm``): TE runs the norm into a 16-bit tensor whose amax the norm kernel
    records (``create_hp_tensor_with_amax``: ``amax.zero_()`` first), then
    ``quantize_with_amax`` (scale and cast, no amax pass; ``pytorch/csrc/extensions/
    normalization.cpp``): ``{name}.amax_{tag}`` is then the zero fill, reading nothing.

    Examples
    --------
    >>> from sim.workload.kernels import Tensor
    >>> x, y = Tensor("x", 2048.0), Tensor("y", 1024.0)
    >>> [(k.name, k.launches) for k in te_scaled_cast("fc1", "in", x, (y,), True, pieces=16)]
    [('fc1.amax_in', 32), ('fc1.cast_in', 32)]
    >>> [(k.name, k.launches) for k in te_scaled_cast("fc1", "in", x, (y,), False, pieces=16)]
    [('fc1.cast_in', 1)]
    """
    ks = scaled_cast(name, tag, src, dsts, amax, te=True)
    if not amax:
        return ks if fused_multi or pieces <= 1 else [replace(ks[-1], launches=pieces)]
    if amax_in_norm:
        return [Kernel(f"{name}.amax_{tag}", "tiny"), replace(ks[-1], launches=2)]
    return [replace(k, launches=2 * max(1, pieces)) for k in ks]


def bias_grad(name: str, gy: Tensor, gb: Tensor) -> Kernel:
    """``{name}.g_bias``: the bias gradient ``gb``, the output gradient summed over tokens."""
    return Kernel(f"{name}.g_bias", "elementwise", (gy,), (gb,))


def fused_norm_forward(b: _Builder, x: Tensor, y: Tensor, stats: Tensor, name: str) -> None:
    """A fused norm's forward ``{name}.fused``: reads ``x``, writes ``y`` and the per-row
    ``stats`` (rstd, or mean and rstd); autograd saves ``x`` and ``stats``."""
    b.fwd(Kernel(f"{name}.fused", "norm_fused", (x,), (y, stats)))
    b.save(x, stats)


def weight_mul_grad(name: str, g: Tensor, xn: Tensor, prod: Tensor, gw: Tensor
                    ) -> list[Kernel]:
    """The weight's gradient of an eager ``weight * xn`` (Hugging Face ``LlamaRMSNorm``'s
    last op): ``MulBackward`` multiplies the output gradient ``g`` by ``xn`` into ``prod``,
    then ``sum_to_size`` sums it over the tokens into ``gw``."""
    return [Kernel(f"{name}.g_w_prod", "elementwise", (g, xn), (prod,)),
            Kernel(f"{name}.g_w_sum", "elementwise", (prod,), (gw,))]


def cast_kernel(name: str, x: Tensor, y: Tensor, numel: float) -> Kernel:
    """``y = x.to(dtype)`` over ``numel`` contiguous elements. Narrowing fp32 to a 16-bit type
    is PyTorch's special-cased vectorised copy (``bfloat16_copy_kernel_cuda``); widening a
    16-bit tensor to fp32 takes the dynamic-casting loop (``cast_elements``)."""
    widening = y.nbytes > x.nbytes
    return Kernel(name, "elementwise", (x,), (y,), cast_elements=numel if widening else 0.0)


class Loop(TypedDict, total=False):
    """Which of PyTorch's elementwise loops a kernel runs (the :class:`Kernel` fields)."""

    legacy_elements: float
    legacy_operands: int
    cast_elements: float


def rope_loops(n: float) -> dict[str, Loop]:
    """The loops of Hugging Face's rotary embedding on ``n`` elements of a transposed q (or
    k) view with broadcast ``cos``/``sin``, by op: the half's neg and its slice gradients
    (unary), the cat of two strided halves (one element from one input), the products and
    sums (binary), the forward products of a bf16 operand and fp32 ``cos``/``sin`` also
    casting (autocast). Measured on the lent H200 (h200-train-steps-ops.json, ``1b-plain``):
    the rotary embedding's multiplies, adds and neg are all ``elementwise_kernel``, the
    forward products the casting ``gpu_kernel_impl`` one."""
    return {"neg": {"legacy_elements": n / 2},
            "cat": {"legacy_elements": n},
            "mul": {"legacy_elements": n, "legacy_operands": 3},
            "mul_cast": {"legacy_elements": n, "legacy_operands": 3, "cast_elements": n}}
