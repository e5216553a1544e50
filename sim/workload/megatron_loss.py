"""Megatron-Core's vocab-parallel cross-entropy on one tensor-parallel rank, three ways.

``GPTModel`` computes the loss of its local ``[s, b, vocab/tp]`` bf16 logits in
``LanguageModule.compute_language_model_loss``
(megatron/core/models/common/language_module/language_module.py); multi-token prediction's
heads call the same method (``multi_token_prediction.py``), so one function serves both.
Which code runs is ``TransformerConfig.cross_entropy_loss_fusion`` (default off) and
``cross_entropy_fusion_impl`` (``model_parallel_config.py``, default ``native``):

``unfused``
    ``tensor_parallel.vocab_parallel_cross_entropy`` (``tensor_parallel/cross_entropy.py``),
    eager: ``.float()`` copy, row max, subtract in place, exp in place, row sum, divide in
    place; the fp32 softmax is saved. Backward (``calculate_gradients``) works in the saved
    softmax itself (``grad_input = softmax``): subtracts one at the targets (an indexed
    update, one element per token), scales by the loss gradient in place (``mul_``), and
    autograd's ``.float()`` node casts the result to a new bf16 gradient. Beyond what was
    saved, the backward holds only that bf16 gradient.
``native``
    ``fused_vocab_parallel_cross_entropy`` (``megatron/core/fusions/fused_cross_entropy.py``):
    the same arithmetic in four functions under ``jit_fuser`` (``torch.compile`` from PyTorch
    2.2, ``megatron/core/jit.py``), so inductor fuses each function's passes: the cast with the
    row max (one reduction kernel reading bf16 and storing the fp32 copy it returns), subtract,
    exp and row sum in one in-place reduction, the divide in place; the fp32 softmax is still
    saved (``ctx.save_for_backward(exp_logits, ...)``). Backward is one compiled function: the
    one-hot scatter (one element per token), then the multiply, whose result inductor writes
    back into the saved fp32 input it mutates (``mul_``) and, cast, into the bf16 gradient it
    returns (``.to(torch.bfloat16)``).
``te``
    Transformer Engine's ``parallel_cross_entropy`` (``transformer_engine/pytorch/
    cross_entropy.py`` and the Triton kernels of ``common/triton/cross_entropy.py``, TE 2.2 to
    2.17): an online-softmax kernel reads the bf16 logits once for each row's max, sum and
    target logit; those three fp32 values per token are all-gathered over the tensor-parallel
    group; a second kernel reads the logits again and writes the gradient ``softmax - onehot``
    into them in place, in bf16. What is saved is that bf16 tensor, nothing of vocabulary size
    in fp32. Backward scales it in place by the loss gradient (``element_mul_kernel``; the
    ``grad_output == 1`` shortcut never applies, Megatron's loss gradient is per token) and hands
    it to the output layer. TE 2.18 (July 2026, "Fix the numerical issue with the Fused CE
    loss") writes the gradient into a new fp32 tensor instead; the NeMo 25.x containers of the
    published runs carry TE 2.x before it, which is what this path models.

The all-reduces (unfused, native) or all-gather (te) of per-token statistics over the
tensor-parallel group move a few bytes per token and are folded in, as before; the small
per-token kernels (target masks, the gather of the target logits) are left out on every path.
"""

from __future__ import annotations

from typing import Literal

from sim.workload.kernels import BF16, FP32, Kernel, Tensor
from sim.workload.layer_builder import _Builder

LossImpl = Literal["unfused", "native", "te"]
"""Which cross-entropy runs: Megatron-Core's default eager one, its ``torch.compile`` fusion,
or Transformer Engine's Triton kernels (``cross_entropy_loss_fusion`` +
``cross_entropy_fusion_impl``)."""

STATS = 3
"""fp32 values per token of TE's online softmax (max, sum of exponentials, target logit)."""


def loss_impl(fusion: bool, impl: Literal["native", "te"]) -> LossImpl:
    """The path ``--cross-entropy-loss-fusion`` and ``--cross-entropy-fusion-impl`` select
    (``LanguageModule.compute_language_model_loss``)."""
    return impl if fusion else "unfused"


def vocab_parallel_loss(b: _Builder, logits: Tensor, tokens: float, vocab: int,
                        impl: LossImpl, grad: Tensor | None = None) -> Tensor:
    """Add the cross-entropy of ``logits`` (``tokens`` x ``vocab`` local columns, bf16) to the
    builder: its forward and backward kernels and what it saves.

    ``grad``: the bf16 gradient tensor the ``unfused`` and ``native`` paths write (the one the
    output layer's backward reads); a new one if None. Returns the gradient of the logits the
    loss leaves (``te``: the logits themselves).
    """
    n = tokens * vocab
    if impl == "te":
        return _te(b, logits, tokens)
    gl = grad if grad is not None else b.t("output.g_out", n, BF16)
    return _unfused(b, logits, n, gl) if impl == "unfused" else _native(b, logits, n, gl)


def _unfused(b: _Builder, logits: Tensor, n: float, gl: Tensor) -> Tensor:
    lf = b.t("logits_fp32", n, FP32)
    b.fwd(Kernel("logits_float", "elementwise", (logits,), (lf,)))
    b.fwd(Kernel("row_max", "elementwise", (lf,), ()))
    b.fwd(Kernel("sub_max", "elementwise", (lf,), (lf,)))
    b.fwd(Kernel("exp", "elementwise", (lf,), (lf,)))
    b.fwd(Kernel("row_sum", "elementwise", (lf,), ()))
    b.fwd(Kernel("div_sum", "elementwise", (lf,), (lf,)))
    b.save(lf)
    # grad_2d[arange, masked_target] -= softmax_update: one element per token (as native's
    # scatter); grad_input.mul_(grad_output): in place in the saved softmax; then the cast.
    b.bwd(Kernel("softmax_minus_onehot", "tiny"),
          Kernel("scale_by_grad", "elementwise", (lf,), (lf,)),
          Kernel("g_logits_half", "elementwise", (lf,), (gl,)))
    return gl


def _native(b: _Builder, logits: Tensor, n: float, gl: Tensor) -> Tensor:
    lf = b.t("logits_fp32", n, FP32)
    # calculate_logits_max: .float() and max in one inductor reduction kernel that also stores
    # the fp32 copy it returns. Then calculate_predicted_logits: the in-place subtract, exp
    # (out=) and sum in one reduction over the row, written back in place; then
    # calculate_cross_entropy_loss's div_ in place (after the all-reduce of the sums).
    b.fwd(Kernel("ce_cast_max", "elementwise", (logits,), (lf,), reduction=True))
    b.fwd(Kernel("ce_sub_exp_sum", "elementwise", (lf,), (lf,), reduction=True))
    b.fwd(Kernel("ce_div", "elementwise", (lf,), (lf,)))
    b.save(lf)
    # calculate_gradients: the scatter at the targets (tokens elements), then the multiply:
    # written back into the saved softmax it mutates and, in bf16, into the returned gradient.
    b.bwd(Kernel("ce_onehot_scatter", "tiny"),
          Kernel("ce_grad", "elementwise", (lf,), (lf, gl)))
    return gl


def _te(b: _Builder, logits: Tensor, tokens: float) -> Tensor:
    stats = b.t("ce_m_d_xy", STATS * tokens, FP32)
    b.fwd(Kernel("te_online_softmax", "elementwise", (logits,), (stats,)))
    # cross_entropy_kernel: every rank's statistics (all-gathered) and the logits in, the
    # gradient out into the logits' own storage.
    b.fwd(Kernel("te_cross_entropy", "elementwise", (logits, stats), (logits,)))
    b.save(logits)
    b.bwd(Kernel("te_element_mul", "elementwise", (logits,), (logits,)))
    return logits
