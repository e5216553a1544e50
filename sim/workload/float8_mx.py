"""torchao's MXFP8 linear (``MXLinear``, ``torchao/prototype/mx_formats/mx_linear.py``;
torchtitan's ``mx`` model converter with ``mx.recipe_name: mxfp8_cublas``), as
``float8_recipe: mxfp8`` runs it on Blackwell.

What differs from the tensorwise ``Float8Linear`` (:meth:`~sim.workload.layer_builder.
_Builder.float8_linear`), from the ``mx_mm`` autograd function at torchao 0.13-0.15:

* Every operand is cast to MXFP8 (E4M3 data, one E8M0 scale per 32 elements along the GEMM's
  reduction dimension) by a kernel of its own that computes its block scales as it casts: no
  amax pass. Forward casts the input and the weight along dim 0; backward casts the output
  gradient along dim 0 (dgrad) and dim 1 (wgrad), the weight along dim 1 (dgrad) and the
  input along dim 1 (wgrad): six casts a linear, each reading 16 bits and writing one byte
  plus 1/32 of scales (:func:`sim.workload.layer_rules.fp8_element_bytes`).
* ``ctx.save_for_backward(input_hp, weight_hp)``: autograd keeps the bf16 input, as the
  float8 recipes do, and backward casts again.
* The three GEMMs are ``torch._scaled_mm`` with block scales (cuBLAS): Blackwell's tensor
  cores apply them at the FP8 rate (:attr:`~sim.workload.kernels.Kernel.fp8_block`).
* torchtitan's ``mx`` converter has no FSDP float8 all-gather: the weights are gathered in
  bf16 and cast in every forward (the checks refuse ``float8_all_gather`` with it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sim.workload.kernels import BF16, Kernel, Tensor
from sim.workload.layer_rules import fp8_element_bytes, linear_gemm, linear_params

if TYPE_CHECKING:
    from sim.workload.layer_builder import _Builder

MX8 = fp8_element_bytes("mxfp8")
"""Bytes per MXFP8 element, its share of the block scale included."""


def mx_cast(name: str, tag: str, src: Tensor, numel: float, b: _Builder) -> tuple[Kernel, Tensor]:
    """``{name}.cast_{tag}``: one MXFP8 cast of ``src`` (scales computed in the kernel)."""
    out = b.t(f"{name}.{tag}_mx", numel, MX8)
    return Kernel(f"{name}.cast_{tag}", "elementwise", (src,), (out,)), out


def mx_linear(b: _Builder, x: Tensor, tokens: float, n_in: int, n_out: int, name: str,
              bias: bool) -> Tensor:
    """``y = x W^T`` as torchao's ``MXLinear`` runs it (see the module doc). Returns the bf16
    output; autograd keeps the bf16 input."""
    b.block.params += linear_params(n_in, n_out, bias)
    w = b.t(f"{name}.w", n_in * n_out, BF16)
    y = b.t(f"{name}.out", tokens * n_out, BF16)
    kx, x0 = mx_cast(name, "in", x, tokens * n_in, b)
    kw, w0 = mx_cast(name, "w", w, n_in * n_out, b)
    for k in (kx, kw, linear_gemm(name, "fwd", (x0, w0), y, tokens, n_in, n_out, fp8=True,
                                  fp8_block=True)):
        b.fwd(k)
    b.save(x)
    gy = b.t(f"{name}.g_out", tokens * n_out, BF16)
    gx = b.t(f"{name}.g_in", tokens * n_in, BF16)
    gw = b.t(f"{name}.g_w", n_in * n_out, BF16)
    kg0, g0 = mx_cast(name, "g", gy, tokens * n_out, b)
    kw1, w1 = mx_cast(name, "w_bwd", w, n_in * n_out, b)
    kg1, g1 = mx_cast(name, "g_t", gy, tokens * n_out, b)
    kx1, x1 = mx_cast(name, "in_bwd", x, tokens * n_in, b)
    ks = [kg0, kw1,
          linear_gemm(name, "dgrad", (g0, w1), gx, tokens, n_in, n_out, fp8=True,
                      fp8_block=True),
          kg1, kx1,
          linear_gemm(name, "wgrad", (g1, x1), gw, tokens, n_in, n_out, fp8=True,
                      fp8_block=True)]
    b.low_precision_backward(ks, name, gy, gw, n_out, bias)
    return y
