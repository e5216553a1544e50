"""The router and the first permutation of a Megatron-Core MoE layer, kernel by kernel.

Split from :mod:`sim.workload.moe_ops` (which assembles the whole layer): the gate GEMM,
routing (softmax or sigmoid top-k, node-limited groups, z-loss, aux losses), Megatron's
router token dropping and TE's fused permutation with its row-id map. Each function adds its
kernels to the layer's builder; their sources are cited where they are written.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sim.workload.kernels import BF16, BOOL, FP32, Kernel, Style, Tensor
from sim.workload.layer_builder import _Builder
from sim.workload.model import ModelSpec
from sim.workload.moe_torch_permute import torch_permute_kernels

if TYPE_CHECKING:
    from sim.workload.moe_ops import MoELayout

STYLE = Style("bf16")
"""How the MoE layer's kernels are priced (bf16 activations; FP8 GEMMs say so per kernel)."""
INT32 = 4   # TE's row_id_map of the fused permutation
MASK = BOOL    # the boolean routing map


def router_dtype_bytes(router_dtype: str | None) -> int:
    """Bytes of one routing element under ``moe_router_dtype``: Megatron-Core's
    ``TopKRouter.gating`` (core_v0.14.0 ``router.py``) runs the gate as
    ``router_gating_linear(input, weight, router_dtype)`` with ``router_dtype = input.dtype``
    unless ``moe_router_dtype`` is ``fp32`` (or ``fp64``); the logits come out in that dtype
    (``te_general_gemm(weight, inp, router_dtype)``) and everything the router makes of them
    keeps it: TE's fused top-k and aux-loss scores allocate their outputs in the logits' dtype
    (TE 2.7 ``pytorch/csrc/extensions/router.cpp``), the unfused ``topk_softmax`` casts its
    fp32 softmax back with ``type_as(logits)``, and ``moe_permute_with_probs`` writes the
    permuted probs in the probs' dtype (``pytorch/triton/permutation.py``).

    >>> router_dtype_bytes("fp32"), router_dtype_bytes(None)
    (4, 2)
    """
    return FP32 if router_dtype == "fp32" else BF16


def router_kernels(m: ModelSpec, lay: MoELayout, tokens: float
            ) -> tuple[_Builder, Tensor, Tensor, Tensor]:
    """Gate GEMM, routing, aux losses, count of tokens per expert: the builder, the layer's
    input, the dense probs and their gradient (for :func:`permute_kernels`). Routing tensors
    are ``lay.router_bytes`` an element (:func:`router_dtype_bytes`)."""
    assert m.moe is not None
    e, h, k = m.moe.experts, m.hidden, m.moe.top_k
    r = lay.router_bytes
    b = _Builder("moe_router", STYLE)
    x = b.t("in", tokens * h, BF16)
    b.block.inputs.append(x)
    b.block.params += m.moe.router_params(h, m.bias) - (e if m.moe.router == "sigmoid" else 0)
    w = b.t("gate.w", e * h, BF16)
    logits = b.t("logits", tokens * e, r)
    # RouterGatingLinearFunction.forward: te_general_gemm(weight, inp, router_dtype): bf16
    # operands, output in the router dtype. With fp32 its backward casts the weight to fp32
    # and runs both GEMMs in fp32 (TF32 on Hopper: TE cublaslt_gemm.cu "Use TF32 only for pure
    # FP32 GEMM"); priced here at the 16-bit rate (ComputeModel has no TF32 GEMM; E x h is a
    # small GEMM). With bf16 the weight's .to(router_dtype) is a no-op: no cast kernel.
    fl = 2.0 * tokens * h * e
    b.fwd(Kernel("gate.fwd", "gemm", (x, w), (logits,), fl, gemm=(tokens, h, e, "fwd")))
    b.save(x)
    glog = b.t("g_logits", tokens * e, r)
    gx = b.t("gate.g_in", tokens * h, BF16)
    gw = b.t("gate.main_grad", e * h, lay.main_grad_bytes)
    wr = w
    cast: list[Kernel] = []
    if r != BF16:
        wr = b.t("gate.w_fp32", e * h, r)
        cast.append(Kernel("gate.w_to_fp32", "elementwise", (w,), (wr,)))
    b.bwd(*cast,
          Kernel("gate.dgrad", "gemm", (glog, wr), (gx,), fl, gemm=(tokens, h, e, "dgrad")),
          Kernel("gate.wgrad", "gemm", (glog, x), (gw,), fl, gemm=(tokens, h, e, "wgrad")))
    b.block.weight_grads.append(gw)
    if lay.z_loss:
        # z_loss_func: mean of logsumexp(logits)^2, a row reduction; its gradient is dense.
        b.fwd(Kernel("z_loss", "elementwise", (logits, logits), ()))
        b.bwd(Kernel("z_loss.bwd", "elementwise", (logits,), (glog,)))
    probs = b.t("probs", tokens * e, r)
    rmap = b.t("routing_map", tokens * e, MASK)
    gprobs = b.t("g_probs", tokens * e, r)
    # With the aux loss, autograd runs its branch first (its nodes were made last) and the
    # routing branch's gradient is then accumulated into the logits' gradient it made: read
    # and written in place (torch/csrc/autograd/input_buffer.cpp, accumulate).
    acc = (glog,) if lay.aux_loss else ()
    if lay.router_fusion:
        # TE fused_topk_with_score_function: scores, top-k, (sigmoid: bias, normalise),
        # scatter into dense probs and map; saves what its backward reads.
        b.fwd(Kernel("topk_fused", "elementwise", (logits,), (probs, rmap)))
        b.save(probs, rmap)
        b.bwd(Kernel("topk_fused.bwd", "elementwise", (gprobs, probs, rmap) + acc, (glog,)))
    else:
        scores = b.t("scores", tokens * e, r)
        idx = b.t("topk_idx", tokens * k, 8)
        val = b.t("topk_val", tokens * k, r)
        b.fwd(Kernel("score_fn", "elementwise", (logits,), (scores,)))
        b.fwd(Kernel("topk", "elementwise", (scores, scores), (idx, val)))
        b.fwd(Kernel("scatter_probs", "elementwise", (idx, val), (probs,)))
        b.fwd(Kernel("scatter_map", "elementwise", (idx,), (rmap,)))
        b.save(scores, idx)
        gval = b.t("g_topk_val", tokens * k, r)
        gsc = b.t("g_scores", tokens * e, r)
        b.bwd(Kernel("scatter_probs.bwd", "elementwise", (gprobs, idx), (gval,)),
              Kernel("topk.bwd", "elementwise", (gval, idx), (gsc,)),
              Kernel("score_fn.bwd", "elementwise", (gsc, scores) + acc, (glog,)))
    if lay.token_drop is not None:
        probs, rmap, gprobs = token_drop_kernels(b, m, lay, tokens, probs, rmap, gprobs)
    if lay.aux_loss:
        # compute_routing_scores_for_aux_loss (scores of every expert, its own top-k map),
        # then switch_load_balancing_loss_func: the scores summed over tokens, times the
        # per-expert token counts (an all-reduce of E numbers, folded in). Backward: the
        # loss gradient spread over every score (MoEAuxLossAutoScaler), then the score
        # function's backward into the logits' gradient.
        sc = b.t("aux.scores", tokens * e, r)
        amap = b.t("aux.map", tokens * e, MASK)
        b.fwd(Kernel("aux.scores", "elementwise", (logits,), (sc, amap)))
        b.fwd(Kernel("aux.loss", "elementwise", (sc, amap), ()))
        b.save(sc)
        gsc2 = b.t("aux.g_scores", tokens * e, r)
        b.bwd(Kernel("aux.loss.bwd", "elementwise", (), (gsc2,)),
              Kernel("aux.scores.bwd", "elementwise", (gsc2, sc), (glog,)))
    if lay.token_drop != "pad":
        # preprocess: tokens per expert, the map summed over tokens (drop_and_pad returns
        # before it: every expert holds the capacity).
        counts = b.t("tokens_per_expert", e, 8)
        b.fwd(Kernel("count_tokens", "elementwise", (rmap,), (counts,)))
    return b, x, probs, gprobs


def token_drop_kernels(b: _Builder, m: ModelSpec, lay: MoELayout, tokens: float, probs: Tensor,
                rmap: Tensor, gprobs: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``apply_router_token_dropping`` (Megatron-Core 0.14 ``moe_utils.py``, drop policy
    ``probs``): ``torch.topk`` of the dense probs over the tokens (``dim=0``, ``k`` = the
    capacity, unsorted), ``zeros_like(probs).scatter(0, indices, 1).bool()`` for the capacity
    mask, with padding that mask as the map (else ``logical_and`` with the top-k map), and the
    probs masked by a multiply, whose backward is the one kernel it adds there. Returns the
    masked probs, their map and the gradient of the masked probs (what the permutation's
    backward writes); the unmasked probs' gradient is the caller's ``gprobs``."""
    assert m.moe is not None and m.moe.capacity_factor is not None
    e, k = m.moe.experts, m.moe.top_k
    # get_capacity: ceil(tokens x top_k / experts x capacity_factor).
    cap = -(-tokens * k * m.moe.capacity_factor // e)
    vals = b.t("drop.topk_values", cap * e, lay.router_bytes)
    idx = b.t("drop.topk_indices", cap * e, 8)
    zeros = b.t("drop.zeros", tokens * e, lay.router_bytes)
    mask = b.t("drop.capacity_mask", tokens * e, MASK)
    b.fwd(Kernel("drop.topk", "elementwise", (probs,), (vals, idx)))
    b.fwd(Kernel("drop.zeros", "elementwise", (), (zeros,)))
    # scatter of ones into the zeros: one element written per kept index, in place.
    kept = b.t("drop.kept", cap * e, lay.router_bytes)
    b.fwd(Kernel("drop.scatter", "elementwise", (idx,), (kept,)))
    b.fwd(Kernel("drop.to_bool", "elementwise", (zeros,), (mask,)))
    fmap = mask
    if lay.token_drop == "drop":
        fmap = b.t("drop.map", tokens * e, MASK)
        b.fwd(Kernel("drop.logical_and", "elementwise", (rmap, mask), (fmap,)))
    fprobs = b.t("drop.probs", tokens * e, lay.router_bytes)
    b.fwd(Kernel("drop.mask_probs", "elementwise", (probs, fmap), (fprobs,)))
    b.save(fmap)
    gf = b.t("drop.g_probs", tokens * e, lay.router_bytes)
    b.bwd(Kernel("drop.mask_probs.bwd", "elementwise", (gf, fmap), (gprobs,)))
    return fprobs, fmap, gf


def row_id_map(b: _Builder, tokens: float, e: int) -> Tensor:
    """TE 2.7 ``make_row_id_map`` (``pytorch/triton/permutation.py``): ``[tokens, 2 e + 1]``
    int32, made by three Triton kernels over a ``(experts, tokens / 1024)`` grid: pass 1 a
    cumulative sum of the routing map per 1,024-token block, pass 2 the global sum into
    destination rows, pass 3 each token's destinations compacted after them."""
    rmap = b.t("permute.routing_map", tokens * e, MASK)
    ws = b.t("row_id_map.workspace", e * -(-tokens // 1024), INT32)
    part = b.t("row_id_map.block_cumsum", tokens * e, INT32)
    dst = b.t("row_id_map.rows", tokens * e, INT32)
    rid = b.t("row_id_map", tokens * (2 * e + 1), INT32)
    b.fwd(Kernel("row_id_map.pass_1", "elementwise", (rmap,), (part, ws)))
    b.fwd(Kernel("row_id_map.pass_2", "elementwise", (part, ws), (dst,)))
    b.fwd(Kernel("row_id_map.pass_3", "elementwise", (dst,), (rid,)))
    return rid


def permute_kernels(b: _Builder, m: ModelSpec, x: Tensor, probs: Tensor, gprobs: Tensor,
             tokens: float, rows: float | None = None, te: bool = False,
             router_bytes: int = FP32, torch_ops: bool = False, pad: bool = False) -> None:
    """Permutation 1 (TE ``moe_permute_with_probs``): each token gathered once per chosen
    expert into expert order, with its prob; backward sums each token's ``top_k`` gradient
    rows back (TE ``moe_unpermute`` of the gradient) and scatters the probs' gradient.
    ``rows``: the permuted rows (default ``tokens x top_k``; padded to capacity,
    ``experts x capacity``); the permuted probs keep the probs' dtype (``router_bytes``).
    ``torch_ops``: Megatron's unfused permutation instead (``moe_permute_fusion`` off,
    :func:`sim.workload.moe_torch_permute.torch_permute_kernels`; ``pad`` its drop-and-pad
    variant)."""
    assert m.moe is not None
    h, k, e = m.hidden, m.moe.top_k, m.moe.experts
    rows = tokens * k if rows is None else rows
    if torch_ops:
        torch_permute_kernels(b, h, e, x, probs, gprobs, tokens, rows, router_bytes, pad)
        return
    src = b.t("permute.gathered_rows", rows * h, BF16)   # x read once per copy
    out = b.t("permuted", rows * h, BF16)
    pp = b.t("permuted_probs", rows, router_bytes)
    if te:
        rid = row_id_map(b, tokens, e)
        b.fwd(Kernel("permute", "elementwise", (src, probs, rid), (out, pp)))
    else:
        rid = b.t("row_id_map", tokens * e, INT32)
        b.fwd(Kernel("permute", "elementwise", (src, probs), (out, pp, rid)))
    b.save(rid)
    g = b.t("g_permuted", rows * h, BF16)
    gx = b.t("permute.g_in", tokens * h, BF16)
    gpp = b.t("g_permuted_probs", rows, router_bytes)
    b.bwd(Kernel("permute.bwd", "elementwise", (g, rid), (gx,)),
          Kernel("permute.probs_bwd", "elementwise", (gpp, rid), (gprobs,)))
    b.block.outputs += [out, pp]
