"""The kernels torchtitan's ``MoE.forward`` runs around the routed experts that differ from
Megatron-Core's (:mod:`sim.workload.moe_ops` prices the router, the permutation and the
grouped GEMMs for both): where the routing scores are applied, and the unsort and top-k
reduction of the combined tokens (torchtitan v0.2.2 ``torchtitan/models/moe/moe.py``).

* ``score_before_experts`` (``MoEArgs`` default True; Qwen3's configs set it False):
  ``(routed_input.to(float32) * top_scores_experts_sorted.reshape(-1, 1)).to(x.dtype)``
  on this rank's ``tokens x top_k`` routed rows before the dispatch; the fp32 product keeps
  its fp32 input for backward.
* After the combine all-to-all: ``routed_output_unsorted = torch.zeros((bs * slen * top_k,
  dim))`` over every token of the micro-batch on this rank (all of them under tensor
  parallelism: the unsort is not sequence-parallel), ``[token_indices_experts_sorted] =
  routed_output`` (an ``index_put`` of this rank's rows), then either ``.sum(dim=1)`` over the
  top-k copies (scores applied before) or ``torch.bmm(top_scores, routed_output_unsorted
  .float())`` in fp32, which keeps the fp32 copy for backward, cast back to bf16; then the
  shared experts' output is added.
"""

from __future__ import annotations

from sim.workload.kernels import BF16, FP32, Block, Kernel
from sim.workload.layer_builder import _Builder
from sim.workload.model import ModelSpec
from sim.workload.moe_ops import STYLE, finish_with_shared

IDX = 8     # int64 token indices (torch.argsort)


def score_block(m: ModelSpec, tokens: float) -> Block:
    """The routing scores applied to this rank's routed rows before the dispatch (fp32
    multiply, cast back to bf16): ``score_before_experts``."""
    assert m.moe is not None
    rows = tokens * m.moe.top_k
    h = m.hidden
    b = _Builder("moe_score", STYLE)
    x = b.t("in", rows * h, BF16)
    b.block.inputs.append(x)
    x32 = b.t("in_fp32", rows * h, FP32)
    sc = b.t("scores", rows, FP32)
    y32 = b.t("scaled_fp32", rows * h, FP32)
    y = b.t("out", rows * h, BF16)
    b.fwd(Kernel("to_fp32", "elementwise", (x,), (x32,)))
    b.fwd(Kernel("mul_scores", "elementwise", (x32, sc), (y32,)))
    b.fwd(Kernel("to_bf16", "elementwise", (y32,), (y,)))
    b.save(x32, sc)
    gy = b.t("g_out", rows * h, BF16)
    gy32 = b.t("g_scaled_fp32", rows * h, FP32)
    gx32 = b.t("g_in_fp32", rows * h, FP32)
    gsc = b.t("g_scores", rows, FP32)
    gx = b.t("g_in", rows * h, BF16)
    b.bwd(Kernel("to_bf16.bwd", "elementwise", (gy,), (gy32,)),
          Kernel("mul_scores.bwd_in", "elementwise", (gy32, sc), (gx32,)),
          Kernel("mul_scores.bwd_scores", "elementwise", (gy32, x32), (gsc,)),
          Kernel("to_fp32.bwd", "elementwise", (gx32,), (gx,)))
    b.block.outputs.append(y)
    return b.finish()


def combine_block(m: ModelSpec, routed: float, tokens: float, score_before: bool) -> Block:
    """Unsort and top-k reduction of the combined tokens: the copies of this rank's
    ``routed`` tokens (x top_k rows) come back, scattered into a zeroed buffer of all
    ``tokens`` x top_k rows, then summed (scores applied before) or weighted by the scores
    in an fp32 ``bmm``; plus the shared experts' output when the model has them."""
    assert m.moe is not None
    k, h = m.moe.top_k, m.hidden
    rows = tokens * k
    b = _Builder("moe_combine", STYLE)
    x = b.t("in", routed * k * h, BF16)
    b.block.inputs.append(x)
    z = b.t("unsorted", rows * h, BF16)
    idx = b.t("token_indices", routed * k, IDX)
    b.fwd(Kernel("zeros", "elementwise", (), (z,)))
    b.fwd(Kernel("index_put", "elementwise", (x, idx), (z,)))
    b.save(idx)
    gz = b.t("g_unsorted", rows * h, BF16)
    gx = b.t("g_in", routed * k * h, BF16)
    # Backward kernels are listed in forward order and run reversed: this one runs last.
    b.bwd(Kernel("index_put.bwd", "elementwise", (gz, idx), (gx,)))
    out = b.t("out", tokens * h, BF16)
    gout = b.t("g_out", tokens * h, BF16)
    if score_before:
        b.fwd(Kernel("sum_topk", "elementwise", (z,), (out,)))
        b.bwd(Kernel("sum_topk.bwd", "elementwise", (gout,), (gz,)))
    else:
        z32 = b.t("unsorted_fp32", rows * h, FP32)
        sc = b.t("top_scores", rows, FP32)
        o32 = b.t("out_fp32", tokens * h, FP32)
        b.fwd(Kernel("to_fp32", "elementwise", (z,), (z32,)))
        b.fwd(Kernel("bmm_scores", "elementwise", (sc, z32), (o32,)))
        b.fwd(Kernel("to_bf16", "elementwise", (o32,), (out,)))
        b.save(sc, z32)
        g32 = b.t("g_out_fp32", tokens * h, FP32)
        gz32 = b.t("g_unsorted_fp32", rows * h, FP32)
        gsc = b.t("g_top_scores", rows, FP32)
        b.bwd(Kernel("to_bf16.bwd", "elementwise", (gout,), (g32,)),
              Kernel("bmm_scores.bwd_in", "elementwise", (g32, sc), (gz32,)),
              Kernel("bmm_scores.bwd_scores", "elementwise", (g32, z32), (gsc,)),
              Kernel("to_fp32.bwd", "elementwise", (gz32,), (gz,)))
    return finish_with_shared(b, out, tokens * h, bool(m.moe.shared))
