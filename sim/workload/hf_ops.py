"""Hugging Face ``LlamaForCausalLM`` kernels in bf16, as FSDP2 runs the model (style ``hf_bf16``).

Under FSDP2's ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` the
gathered parameters are bf16 and nothing is under autocast, so the Hugging Face modules run
their eager code on bf16 tensors (``transformers/models/llama/modeling_llama.py``):

``LlamaRMSNorm.forward``
    ``hidden_states.to(torch.float32)``, ``.pow(2).mean(-1, keepdim=True)``,
    ``* torch.rsqrt(variance + eps)``, ``.to(input_dtype)`` and ``self.weight * ...``: eight
    eager kernels (two casts, pow, mean, add, rsqrt, mul, weight mul), against torchtitan's
    one fused ``F.rms_norm`` kernel. Autograd saves the fp32 copy of the input (pow and mul
    read it), the per-row ``rsqrt`` and the bf16 normalised tensor (the weight mul's other
    operand).
``apply_rotary_pos_emb`` with ``rotate_half``
    ``q * cos + rotate_half(q) * sin``, ``rotate_half(x) = cat((-x2, x1))`` of the two halves
    of the head dimension: neg, cat, two muls and an add, all in bf16 (``cos`` and ``sin``
    are cast to the hidden states' dtype by ``LlamaRotaryEmbedding``). Backward: the muls'
    gradients, the neg's, and ``SliceBackward`` of each half (a zero-filled full-size
    gradient with the half copied in: ``slice_backward`` in
    ``torch/csrc/autograd/FunctionsManual.cpp``), summed into q's gradient.

Each function adds its kernels to a :class:`sim.workload.layer_builder._Builder` and returns the
output
tensor, like the builder's own ops.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sim.workload.kernels import BF16, FP32, Kernel, Tensor
from sim.workload.layer_rules import cast_kernel, rope_loops, weight_mul_grad

if TYPE_CHECKING:
    from sim.workload.layer_builder import _Builder


def hf_rmsnorm_bf16(b: _Builder, x: Tensor, tokens: float, h: int, name: str) -> Tensor:
    """``LlamaRMSNorm`` on a bf16 input with a bf16 weight.

    Forward bytes for ``n = tokens * h`` elements and ``T = tokens`` rows: to fp32 ``6n``,
    pow ``8n``, mean ``4n + 4T``, add and rsqrt ``8T`` each, mul ``8n + 4T``, to bf16 ``6n``,
    weight mul ``4n + 2h``: ``36n + 24T + 2h`` in eight kernels.
    """
    b.block.params += h
    n = tokens * h
    x32 = b.t(f"{name}.x_fp32", n, FP32)
    b.fwd(cast_kernel(f"{name}.to_fp32", x, x32, n))
    r, xn = b.rms_core_forward(x32, tokens, h, name)
    xnb = b.t(f"{name}.xn_bf16", n, BF16)
    w = b.t(f"{name}.w", h, BF16)
    y = b.t(f"{name}.out", n, BF16)
    b.fwd(Kernel(f"{name}.to_bf16", "elementwise", (xn,), (xnb,)))
    # The weight broadcast over the tokens: the non-vectorised loop.
    b.fwd(Kernel(f"{name}.mul_w", "elementwise", (w, xnb), (y,), legacy_elements=n,
                 legacy_operands=3))
    b.save(x32, r, xnb)
    gy = b.t(f"{name}.g_out", n, BF16)
    gb = {k: b.t(f"{name}.g_{k}", n, BF16) for k in ("xnb", "wprod")}
    g_xn = b.t(f"{name}.g_xn", n, FP32)
    gw = b.t(f"{name}.g_w", h, BF16)
    core, g_x32 = b.rms_core_backward(g_xn, x32, r, tokens, h, name, f"{name}.g_x32")
    gx = b.t(f"{name}.g_in", n, BF16)
    b.bwd(
        # MulBackward of weight * xn_bf16: both operands' gradients, the weight's summed
        # over tokens (sum_to_size).
        Kernel(f"{name}.g_mul_w", "elementwise", (gy, w), (gb["xnb"],), legacy_elements=n,
               legacy_operands=3),
        *weight_mul_grad(name, gy, xnb, gb["wprod"], gw),
        # ToCopyBackward of the cast to bf16: back to fp32.
        cast_kernel(f"{name}.g_to_fp32", gb["xnb"], g_xn, n),
        *core,
        # ToCopyBackward of the cast to fp32: the input's gradient in bf16.
        Kernel(f"{name}.g_to_bf16", "elementwise", (g_x32,), (gx,)),
    )
    b.block.weight_grads.append(gw)
    b.reads_grad(y, gy)
    b.writes_grad(x, gx)
    return y


def hf_rope_bf16(b: _Builder, q: Tensor, tokens: float, width: int, name: str) -> Tensor:
    """``q * cos + rotate_half(q) * sin`` on bf16 q (or k) of ``width`` channels per token.

    Forward bytes for ``n = tokens * width`` elements (cos and sin, ``seq x head_dim``, are
    not counted): neg ``2n``, cat ``4n``, two muls ``4n`` each, add ``6n``: ``20n`` in five
    kernels.
    """
    n = tokens * width
    half = b.t(f"{name}.half", n / 2, BF16)      # a view of q: counted as the half it reads
    neg = b.t(f"{name}.neg", n / 2, BF16)
    rot = b.t(f"{name}.rot", n, BF16)
    a = b.t(f"{name}.qcos", n, BF16)
    s = b.t(f"{name}.rsin", n, BF16)
    out = b.t(f"{name}.out", n, BF16)
    loops = rope_loops(n)     # all bf16: no casts
    b.fwd(Kernel(f"{name}.neg", "elementwise", (half,), (neg,), **loops["neg"]))
    b.fwd(Kernel(f"{name}.cat", "elementwise", (neg, half), (rot,), **loops["cat"]))
    b.fwd(Kernel(f"{name}.mul_cos", "elementwise", (q,), (a,), **loops["mul"]))
    b.fwd(Kernel(f"{name}.mul_sin", "elementwise", (rot,), (s,), **loops["mul"]))
    b.fwd(Kernel(f"{name}.add", "elementwise", (a, s), (out,), **loops["mul"]))
    g = {k: b.t(f"{name}.g_{k}", n, BF16) for k in ("out", "a", "rot", "za", "zb", "s1", "in")}
    # gh_x2: CatBackward's narrow view of g_rot (no copy); NegBackward writes a new tensor.
    gh = {k: b.t(f"{name}.gh_{k}", n / 2, BF16) for k in ("neg", "x2")}
    b.bwd(
        Kernel(f"{name}.g_mul_cos", "elementwise", (g["out"],), (g["a"],), **loops["mul"]),
        Kernel(f"{name}.g_mul_sin", "elementwise", (g["out"],), (g["rot"],), **loops["mul"]),
        # CatBackward gives narrow views; NegBackward negates the x2 half.
        Kernel(f"{name}.g_neg", "elementwise", (gh["x2"],), (gh["neg"],), **loops["neg"]),
        # SliceBackward of x1 and of x2: zero-filled full-size gradient, then the half.
        Kernel(f"{name}.g_slice_a_zero", "elementwise", (), (g["za"],)),
        Kernel(f"{name}.g_slice_a_copy", "elementwise", (gh["neg"],), (gh["neg"],),
               **loops["neg"]),
        Kernel(f"{name}.g_slice_b_zero", "elementwise", (), (g["zb"],)),
        Kernel(f"{name}.g_slice_b_copy", "elementwise", (gh["neg"],), (gh["neg"],),
               **loops["neg"]),
        # Autograd sums the three gradients of q (the first in q's transposed layout).
        Kernel(f"{name}.g_sum_a", "elementwise", (g["a"], g["za"]), (g["s1"],),
               **loops["mul"]),
        Kernel(f"{name}.g_sum_b", "elementwise", (g["s1"], g["zb"]), (g["in"],)),
    )
    b.reads_grad(out, g["out"])
    b.writes_grad(q, g["in"])
    return out
