"""torchao's float8 rowwise recipes (``Float8LinearConfig.from_recipe_name``; torchtitan's
``float8.recipe_name: rowwise`` / ``rowwise_with_gw_hp``): a ``Float8Linear`` whose operands
are scaled per row (``ScalingGranularity.AXISWISE``) instead of per tensor.

What differs from the tensorwise linear (:meth:`~sim.workload.layer_builder._Builder.
float8_linear`), from torchao's ``torchao/float8/config.py`` and ``float8_python_api.py``:

* Every operand layout gets its own scales along its own axis, so each FP8 copy is an amax
  reduction and a cast: the output gradient twice (along its rows for dgrad, along the
  tokens for wgrad) where tensorwise reduces it once and casts it twice. Gradients are
  E4M3 too (same bytes).
* The GEMMs: forward with fast accumulation runs PyTorch's rowwise CUTLASS kernel, "most
  shapes within 90-100% of tensor-wise efficiency" (pytorch/pytorch issue 147971): priced as
  the tensorwise FP8 GEMM. The backward GEMMs run without fast accumulation, and for them
  ``addmm_float8_unwrapped`` (torchao PR 1325) calls the tensorwise cuBLAS kernel with unit
  scales and multiplies the output by the outer product of the row and column scales
  afterwards ("the rowwise CUTLASS-based kernel is so slow without fast-accum"): an extra
  elementwise pass over each backward GEMM's bf16 output, which Inductor may fuse.
* ``rowwise_with_gw_hp``: the weight-gradient GEMM stays in bf16 (``cast_config_input_for_
  grad_weight`` and ``cast_config_grad_output_for_grad_weight`` disabled): no casts for it;
  the weight for dgrad is scaled tensorwise (still an amax and a cast).
* torchtitan applies plain tensor parallelism with these recipes ("For rowwise recipes, we
  use regular TP and all-gather happens in high precision", ``apply_tp``) and refuses FSDP's
  float8 all-gather with them: bf16 inputs reach the linears, which cast them locally.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sim.workload.kernels import BF16, Kernel, Tensor
from sim.workload.layer_rules import FP8, linear_gemm, scaled_cast

if TYPE_CHECKING:
    from sim.workload.layer_builder import _Builder

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
"""torchao's float8 training recipes (``Float8LinearRecipeName``)."""


def rescale(name: str, out: Tensor) -> Kernel:
    """``output *= a_scale * b_scale`` after a backward GEMM run with unit scales."""
    return Kernel(f"{name}_rescale", "elementwise", (out,), (out,))


def rowwise_linear(b: _Builder, x: Tensor, tokens: float, n_in: int, n_out: int, name: str,
                   bias: bool, gw_hp: bool) -> Tensor:
    """``y = x W^T`` as torchao's rowwise (``gw_hp``: ``rowwise_with_gw_hp``) Float8Linear
    runs it (see the module doc). Returns the bf16 output; autograd keeps the bf16 input."""
    # The forward is tensorwise's (FSDP2's float8 all-gather is refused with these recipes,
    # so the weight is always cast here).
    w, y = b.float8_forward(x, tokens, n_in, n_out, name, bias)
    gy = b.t(f"{name}.g_out", tokens * n_out, BF16)
    g8a = b.t(f"{name}.g_out_fp8", tokens * n_out, FP8)
    w8b = b.t(f"{name}.w_fp8_bwd", n_in * n_out, FP8)
    gx = b.t(f"{name}.g_in", tokens * n_in, BF16)
    gw = b.t(f"{name}.g_w", n_in * n_out, BF16)
    dgrad = linear_gemm(name, "dgrad", (g8a, w8b), gx, tokens, n_in, n_out, fp8=True)
    ks = [*scaled_cast(name, "g", gy, (g8a,), amax=True),
          *scaled_cast(name, "w_bwd", w, (w8b,), amax=True),
          dgrad, rescale(dgrad.name, gx)]
    if gw_hp:
        ks.append(linear_gemm(name, "wgrad", (gy, x), gw, tokens, n_in, n_out))
    else:
        g8b = b.t(f"{name}.g_out_fp8_t", tokens * n_out, FP8)
        x8b = b.t(f"{name}.in_fp8_bwd", tokens * n_in, FP8)
        wgrad = linear_gemm(name, "wgrad", (g8b, x8b), gw, tokens, n_in, n_out, fp8=True)
        ks += [*scaled_cast(name, "g_t", gy, (g8b,), amax=True),
               *scaled_cast(name, "in_bwd", x, (x8b,), amax=True),
               wgrad, rescale(wgrad.name, gw)]
    b.low_precision_backward(ks, name, gy, gw, n_out, bias)
    return y
