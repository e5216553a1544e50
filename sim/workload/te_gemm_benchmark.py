"""Transformer Engine's GEMM benchmark as the simulator prices it: a check of the FP8 linear's
kernels (quantization and FP8 GEMM) against TE's published per-layer GEMM times.

TE's ``benchmarks/gemm/benchmark_gemm.py`` (model-config mode; measurements in
``sim/catalog/reference/te_gemm_profiling.yaml``, whose header says what the tool does) times
twelve GEMM shapes of one transformer layer, each as its own forward GEMM. In *autocast* mode
every FP8 call is one ``te.Linear`` forward under ``te.autocast`` that quantizes its input and
its weight again (``is_first_microbatch`` None, no cached FP8 weight) before the GEMM; in
*pre-quantized* mode only the GEMM runs. This module builds those calls from the same kernels
:func:`sim.workload.megatron_ops._linear` emits for a training step
(:func:`~sim.workload.layer_rules.te_scaled_cast`, :func:`~sim.workload.layer_rules.linear_gemm`)
and prices them with :func:`~sim.workload.block_pricing.kernel_time`, so the comparison checks
the step's own pricing, not a copy of it.

What one benchmark call quantizes (``transformer_engine/pytorch/module/linear.py`` at TE
1609c890e, ``_linear_forward_impl``): the input row-wise and column-wise (the weight requires
grad, so ``backward_needs_input``; on Hopper the column-wise copy is the transpose the wgrad
GEMM needs, written by the same cast kernel; Blackwell writes row-wise data only,
``nvte_is_non_tn_fp8_gemm_supported``), and the weight row-wise only (the input does not
require grad, so no dgrad copy). A training step quantizes less: the weight once per step
(``is_first_microbatch``) or never (FP8 primary weights), the input once for the forward and
the wgrad, the output gradient once for the dgrad and the wgrad; :func:`training_quantizations`
counts both.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from sim import catalog
from sim.hardware.compute import ComputeModel
from sim.workload.block_pricing import kernel_time
from sim.workload.kernels import BF16, Kernel, Tensor
from sim.workload.layer_rules import (
    fp8_both_layouts,
    fp8_element_bytes,
    linear_gemm,
    te_scaled_cast,
)
from sim.workload.mx_swizzle import ALL, NONE, WEIGHT, scale_swizzles

FP8 = 1
Recipe = Literal["BF16", "FP8Current", "FP8Delayed", "MXFP8", "FP8Block"]
BLOCK_RECIPES: dict[str, str] = {"MXFP8": "mxfp8", "FP8Block": "blockwise"}
"""The tables' block-scaled recipes (``MXFP8BlockScaling``, ``Float8BlockScaling``) and
Megatron's names for them (:data:`sim.config.base.Fp8Recipe`)."""
Pass = Literal["fprop", "dgrad", "wgrad"]
PASSES: tuple[Pass, ...] = ("fprop", "dgrad", "wgrad")


Shape = tuple[int, int, int]


def layer_shapes(hidden: int, intermediate: int, tokens: int) -> dict[Pass, list[Shape]]:
    """The benchmark's twelve ``(M, K, N)`` GEMMs of one layer (``compute_gemm_shapes``): QKV
    (``N = 3 x hidden``), attention output, MLP up and MLP down, forward; the same with K and
    N swapped (dgrad); with the tokens moved to the reduction (wgrad)."""
    h, i, m = hidden, intermediate, tokens
    fprop = [(m, h, 3 * h), (m, h, h), (m, h, i), (m, i, h)]
    return {"fprop": fprop,
            "dgrad": [(mm, n, k) for mm, k, n in fprop],
            "wgrad": [(k, mm, n) for mm, k, n in fprop]}


def call_kernels(m: int, k: int, n: int, recipe: Recipe, transpose: bool,
                 prequantized: bool = False) -> list[Kernel]:
    """The kernels of one timed call on ``A[m,k] B[k,n]``.

    ``BF16``: ``torch.matmul``, one 16-bit GEMM. ``FP8Current`` / ``FP8Delayed``: a
    ``te.Linear(k, n)`` forward under autocast (current or delayed scaling): the input's
    quantization (with the column-wise copy when ``transpose``: Hopper, or a block recipe), the
    weight's (row-wise), then the FP8 GEMM; ``prequantized``: the GEMM alone
    (``tex.generic_gemm`` on tensors quantized before the loop). Every GEMM is a forward GEMM
    (the fprop recipe's fast accumulation, ``use_split_accumulator`` False, in both modes).
    ``MXFP8`` / ``FP8Block``: the same call under a block-scaled recipe: no amax pass, the input
    quantized into both layouts on every GPU (its scales run along the reduction dimension),
    block scales with every FP8 tensor (:func:`~sim.workload.layer_rules.fp8_element_bytes`), a
    block-scaled GEMM.
    """
    x = Tensor("x", m * k * BF16)
    y = Tensor("y", m * n * BF16)
    if recipe == "BF16":
        return [linear_gemm("mm", "fwd", (x, Tensor("w", k * n * BF16)), y, m, k, n)]
    block = recipe in BLOCK_RECIPES
    e8 = fp8_element_bytes(BLOCK_RECIPES.get(recipe))  # type: ignore[arg-type]
    x8 = Tensor("x8", m * k * e8)
    w8 = Tensor("w8", k * n * e8)
    gemm = linear_gemm("mm", "fwd", (x8, w8), y, m, k, n, fp8=True, fp8_block=block)
    # MXFP8 scales are swizzled for cuBLAS at the call (sim.workload.mx_swizzle): both
    # operands' when they were quantized before the loop by stand-alone quantizers, the
    # weight's alone under autocast, whose module quantizes its input into the GEMM's layout
    # (TE 1609c890e, between 2.12 and 2.18).
    swizzled = (ALL if prequantized else WEIGHT) if recipe == "MXFP8" else NONE
    swizzles = scale_swizzles("mm", "fwd", (("in", float(m * k)), ("w", float(k * n))),
                              swizzled)
    if prequantized:
        return [*swizzles, gemm]
    amax = recipe == "FP8Current"
    xs = (x8, Tensor("x8t", m * k * e8)) if transpose else (x8,)
    return [*te_scaled_cast("mm", "in", x, xs, amax),
            *te_scaled_cast("mm", "w", Tensor("w", k * n * BF16), (w8,), amax),
            *swizzles, gemm]


def layer_ms(cm: ComputeModel, recipe: Recipe, prequantized: bool = False,
             hidden: int = 4096, intermediate: int = 16384, tokens: int = 15872
             ) -> dict[str, float]:
    """Simulated per-layer milliseconds of each pass (the sum of its four calls) and their
    ``total``, as the benchmark prints them; the defaults are the tutorial's model."""
    # The input's column-wise copy: Hopper's TN-only GEMMs, or block scales anywhere.
    transpose = fp8_both_layouts(cm.gpu.arch, BLOCK_RECIPES.get(recipe))  # type: ignore[arg-type]
    out: dict[str, float] = {p: 1e3 * sum(kernel_time(cm, kk) for m, k, n in shapes
                                        for kk in call_kernels(m, k, n, recipe, transpose,
                                                               prequantized))
                             for p, shapes in layer_shapes(hidden, intermediate, tokens).items()}
    out["total"] = sum(out[p] for p in PASSES)
    return out


@dataclass(frozen=True)
class Quantizations:
    """Tensors of one layer's linears quantized per call (or micro-batch), by what is read."""

    activations: float
    """Elements of inputs and output gradients quantized."""
    weights: float
    """Elements of weights quantized."""


def benchmark_quantizations(hidden: int = 4096, intermediate: int = 16384,
                            tokens: int = 15872) -> Quantizations:
    """What the benchmark's twelve autocast calls quantize: every call its ``A`` and ``B``."""
    shapes = [s for ss in layer_shapes(hidden, intermediate, tokens).values() for s in ss]
    return Quantizations(float(sum(m * k for m, k, _ in shapes)),
                         float(sum(k * n for _, k, n in shapes)))


def training_quantizations(hidden: int = 4096, intermediate: int = 16384, tokens: int = 15872,
                           weight_share: float = 1.0) -> Quantizations:
    """What a training micro-batch quantizes for the same four linears as TE runs them
    (:func:`sim.workload.megatron_ops._linear`): each input once (the forward's copy serves
    the wgrad), each output gradient once (dgrad and wgrad), each weight ``weight_share`` times
    (``1 / micro-batches`` with ``is_first_microbatch``; 0 with FP8 primary weights)."""
    shapes = layer_shapes(hidden, intermediate, tokens)["fprop"]
    acts = sum(m * k + m * n for m, k, n in shapes)
    return Quantizations(float(acts), weight_share * float(sum(k * n for _, k, n in shapes)))


@lru_cache(maxsize=1)
def reference() -> dict[str, Any]:
    """TE's published tables (``sim/catalog/reference/te_gemm_profiling.yaml``)."""
    path = Path(catalog.__file__).parent / "reference" / "te_gemm_profiling.yaml"
    data = catalog.load_yaml(path.read_text())
    assert isinstance(data, dict)
    return data
