"""Transformer Engine's swizzle of MXFP8 scale factors at each GEMM call.

cuBLASLt reads MXFP8 block scales (one E8M0 byte per 32 elements) in a tiled, swizzled
layout, not the row-major one Transformer Engine's quantize kernels write. TE's GEMM call
(``transformer_engine/pytorch/csrc/extensions/gemm.cpp``) therefore swizzles the scales of
every MXFP8 operand that does not already carry GEMM-swizzled ones: one small kernel per
operand into a freshly allocated buffer, at every call (``swizzle_scaling_factors``, TE 2.7-2.11;
``swizzle_scales_for_gemm``, 2.12 on); a grouped GEMM (``GroupedLinear``) launches one
multi-tensor kernel per operand over all its experts (``multi_tensor_swizzle_scaling_factors``).
Which operands arrive unswizzled is the release's:

* before 2.12 every one: the forward GEMM's input and weight, the dgrad GEMM's output
  gradient and weight, the wgrad GEMM's output gradient and input;
* from 2.12 (PR #2486, 2026-01-16, "Add logic for block-scaled tensors with GEMM swizzled
  scales") the modules quantize inputs and output gradients straight into the GEMM layout
  (``optimize_for_gemm`` on their quantizers, ``linear.py`` / ``grouped_linear.py``
  ``_get_quantizers``), and only the weight is swizzled at each call (its quantized copy is
  cached across micro-batches, its swizzled scales are not); not a sequence-parallel column
  linear's input nor a row linear's output gradient, which are quantized before their gather
  and still swizzled at the call (:func:`sp_swizzled`);
* from 2.18 (PR #3093, 2026-06-23; PR #3232) weights are swizzled once, as they are
  quantized, unless the primary weights are already FP8 (``primary_weights_in_fp8``:
  Megatron's ``fp8_param_gather``), whose dequantization and all-gathers want the plain layout.

Megatron-Bridge pins (its ``uv.lock`` at each release): 25.09 TE 2.7, 25.11 TE 2.9, 26.02 TE
5671fd36 (2.12), 26.04 TE 71bbefbf (2.13-2.14). A scenario names the release with
``training.transformer_engine_version``; without it the newest behaviour is priced. Each swizzle
kernel reads and writes the operand's scales (1/32 byte an element), so on the GPU it costs the
fixed time of a small kernel, and on the host a C++ launch
(:data:`sim.workload.block_pricing.CPP_LAUNCH_CPU_S`).
"""

from __future__ import annotations

from typing import Literal

from sim.workload.kernels import Kernel, Tensor
from sim.workload.layer_rules import BLOCK_SCALE_BYTES

Operand = Literal["in", "g", "w"]
"""A GEMM operand of a linear: its input, its output gradient, its weight."""

PREQUANTIZED_ACTIVATIONS = (2, 12)
"""First TE release whose modules quantize inputs and output gradients into the GEMM's
swizzled scale layout (PR #2486)."""

PRESWIZZLED_WEIGHTS = (2, 18)
"""First TE release that swizzles a weight's scales once, when it is quantized (PR #3093)."""

ALL: frozenset[Operand] = frozenset(("in", "g", "w"))
WEIGHT: frozenset[Operand] = frozenset(("w",))
NONE: frozenset[Operand] = frozenset()


def swizzled_operands(release: tuple[int, ...] | None, fp8_primary_weights: bool
                      ) -> frozenset[Operand]:
    """The MXFP8 operands whose scales TE swizzles at every GEMM call, under TE ``release``
    (None: the newest) with or without FP8 primary weights.

    Examples
    --------
    >>> sorted(swizzled_operands((2, 9), False))
    ['g', 'in', 'w']
    >>> sorted(swizzled_operands((2, 12), False)), sorted(swizzled_operands(None, True))
    (['w'], ['w'])
    >>> sorted(swizzled_operands(None, False))
    []
    """
    if release is not None and release < PREQUANTIZED_ACTIVATIONS:
        return ALL
    if fp8_primary_weights or (release is not None and release < PRESWIZZLED_WEIGHTS):
        return WEIGHT
    return NONE


def scale_swizzles(name: str, pass_: str, operands: tuple[tuple[Operand, float], ...],
                   swizzled: frozenset[Operand]) -> list[Kernel]:
    """The swizzle kernels TE launches before MXFP8 GEMM ``{name}.{pass_}``: one per operand
    of ``operands`` (kind and element count) that is in ``swizzled``, each reading and writing
    its scales.

    Examples
    --------
    >>> ks = scale_swizzles("fc1", "fwd", (("in", 64.0), ("w", 128.0)), WEIGHT)
    >>> [(k.name, k.nbytes) for k in ks]
    [('fc1.swizzle_fwd_w', 8.0)]
    """
    out = []
    for kind, numel in operands:
        if kind not in swizzled:
            continue
        tag = f"{name}.swizzle_{pass_}_{kind}"
        scales = numel * BLOCK_SCALE_BYTES
        out.append(Kernel(tag, "elementwise", (Tensor(f"{tag}.scales", scales),),
                          (Tensor(f"{tag}.swizzled", scales),)))
    return out


def sp_swizzled(swizzled: frozenset[Operand], parallel: Literal["column", "row"]
                ) -> frozenset[Operand]:
    """``swizzled`` for a sequence-parallel linear: from TE 2.12 on (a set that is not
    :data:`ALL`) a column-parallel linear's input and a row-parallel linear's output gradient
    are quantized before their all-gather without ``optimize_for_gemm`` (``linear.py``
    ``_get_quantizers``: ``not (parallel_mode == "column" and sequence_parallel)``), so their
    scales are swizzled at the GEMM call too.

    Examples
    --------
    >>> sorted(sp_swizzled(WEIGHT, "column")), sorted(sp_swizzled(NONE, "row"))
    (['in', 'w'], ['g'])
    >>> sp_swizzled(ALL, "row") == ALL
    True
    """
    return swizzled | {"in" if parallel == "column" else "g"}
