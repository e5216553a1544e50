"""The kernels of one mixture-of-experts layer on one rank, as Megatron-Core runs it.

Megatron-Core's ``MoELayer`` (``megatron/core/transformer/moe/moe_layer.py``) with the
``alltoall`` token dispatcher, Transformer Engine grouped GEMMs and, when the model has them,
shared experts. Per forward, on the ``tokens`` this rank holds (its sequence shard):

1. **router** (``router.py``, ``TopKRouter``): ``gating`` runs ``router_gating_linear``
   (``moe_utils.py``, ``RouterGatingLinearFunction``): bf16 input and weight, logits in
   ``moe_router_dtype`` (fp32, or bf16 when unset); ``routing``: optional z-loss, then
   ``topk_routing_with_score_function`` (softmax, or sigmoid plus the expert bias and
   normalisation of the top-k), one fused TE kernel with ``moe_router_fusion``; the aux loss
   (``switch_load_balancing_loss_func``) over scores recomputed by
   ``compute_routing_scores_for_aux_loss``;
2. **dispatch** (``token_dispatcher.py``, ``MoEAlltoAllTokenDispatcher``): ``preprocess``
   counts tokens per expert (``routing_map.sum(0)``) and all-gathers the counts over the
   expert-TP x EP group (the dispatcher's ``tp_group`` is ``pg_collection.expt_tp``);
   ``dispatch_preprocess`` permutes (``moe_utils.permute``, TE's fused
   ``moe_permute_with_probs`` with ``moe_permute_fusion``): every token copied once per
   chosen expert, grouped by expert; ``token_dispatch``: the all-to-all of tokens and of their probs
   over the EP group; ``dispatch_postprocess``: all-gather over expert-TP, then
   ``sort_chunks_by_idxs`` into local-expert order when a rank holds more than one expert;
3. **experts** (``experts.py``, ``TEGroupedMLP.forward``): grouped fc1 (gate and up together
   for SwiGLU), ``weighted_bias_swiglu_impl`` (activation times the routing prob, fused),
   grouped fc2 (:mod:`sim.workload.grouped_gemm` prices them); FP8 pads each expert's rows to
   the recipe's alignment (``quantization_padding``, ``get_align_size_for_quantization``);
4. **combine**: ``combine_preprocess`` sorts back and reduce-scatters over expert-TP;
   ``token_combine``: the reverse all-to-all; ``combine_postprocess``: ``unpermute`` sums each
   token's expert outputs (the probs were applied in the activation) and adds the shared
   experts' output;
5. **shared experts** (``shared_experts.py``, ``SharedExpertMLP``): a tensor-parallel MLP
   ``shared x moe_ffn_hidden`` wide on every token, which Megatron can overlap with the
   dispatch (``moe_shared_expert_overlap``): its own block, for the builder's streams.

The all-to-alls and expert-TP gathers are not kernels here: :class:`MoELayerOps` returns their
per-peer bytes for the builder to turn into collectives. Backward: every GEMM's dgrad and
wgrad (grouped for the experts), the activation's backward (which also gives the probs'
gradient), the permutations reversed, the router's two GEMMs (fp32 in Megatron; priced at the
16-bit rate, see :func:`router_kernels`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from sim.config.base import Fp8Recipe
from sim.workload.gpt_oss_ops import clamped_glu_input, expert_input_bias, expert_output_bias
from sim.workload.kernels import BF16, FP32, Block, Kernel, Tensor
from sim.workload.layer_builder import _Builder
from sim.workload.megatron_ops import MegatronLayout, _linear
from sim.workload.model import ModelSpec
from sim.workload.moe_grouped_mlp import fused_glu_mlp, grouped_linear
from sim.workload.moe_router_ops import INT32, STYLE, permute_kernels, router_kernels
from sim.workload.moe_torch_permute import torch_sort_chunks, torch_unpermute_kernels
from sim.workload.mx_swizzle import Operand

# Rows per expert an FP8 grouped GEMM needs (megatron/core/fp8_utils.py get_fp8_align_size:
# 16 for every recipe but MXFP8, 32 for MXFP8's 32-element scale blocks).
FP8_ALIGN = 16
MXFP8_ALIGN = 32
# ... and on the GroupedTensor path, whatever the recipe ("TE's grouped-tensor and fused
# grouped-MLP kernels require 256-token alignment", get_align_size_for_quantization).
GROUPED_TENSOR_ALIGN = 256


def expected_aligned_rows(mean: float, align: int, var: float) -> float:
    """Expected rows of an expert's GEMM when its routed count, of mean ``mean`` and variance
    ``var``, is padded up to a multiple of ``align``: ``align x sum_j P(C > j align)`` for a
    normal ``C`` with a continuity correction (each of the routed copies lands on the expert
    independently, a binomial count, variance ``mean x (1 - top_k / experts)`` under balanced
    or forced-balance routing). With no variance, the count itself rounded up.

    >>> expected_aligned_rows(1024, 256, 0.0)
    1024.0
    >>> round(expected_aligned_rows(1024, 256, 1024 * (1 - 8 / 128)))    # half pad to 1,280
    1150
    >>> round(expected_aligned_rows(1024, 16, 1024 * (1 - 8 / 128)), 1)  # (16 - 1) / 2 rows
    1031.5
    """
    if mean <= 0:
        return 0.0
    if var <= 0:
        return float(-(-mean // align) * align)
    sd = math.sqrt(var)
    lo = max(0, math.floor((mean - 8 * sd) / align))
    hi = math.ceil((mean + 8 * sd) / align)
    # P(C > j align) for an integer count: the normal beyond j align + 1/2 (continuity).
    tail = sum(0.5 * math.erfc((j * align + 0.5 - mean) / (sd * math.sqrt(2.0)))
               for j in range(lo, hi + 1))
    return float(align * (lo + tail))


@dataclass(frozen=True)
class MoELayout:
    """What changes the kernels of an MoE layer on one rank: parallel sizes and options.

    ``ep`` expert-parallel ranks share the ``experts`` (``experts / ep`` each);
    ``etp`` expert-tensor-parallel ranks split each local expert's width (Megatron
    ``--expert-tensor-parallel-size``); ``tp`` the attention's tensor parallelism, which the
    shared experts use (``SharedExpertMLP`` is a dense ``MLP``).
    """

    ep: int = 1
    etp: int = 1
    tp: int = 1
    fp8: Fp8Recipe | None = None
    """FP8 expert GEMMs (TE ``fp8_autocast``) with this recipe
    (:data:`~sim.workload.layer_rules.Fp8Recipe`); the dispatch itself stays 16-bit with the
    ``alltoall`` dispatcher (only the NCCL-EP/HybridEP paths quantise it)."""
    weight_cast_share: float = 1.0
    """Share of a weight's FP8 cast each micro-batch pays (1 / micro-batches)."""
    fp8_transpose: bool = True
    """FP8 casts write the transposed copy too (Hopper, and the block recipes everywhere); not
    per-tensor scales on Blackwell (:func:`sim.workload.layer_rules.fp8_both_layouts`)."""
    router_fusion: bool = True
    """``moe_router_fusion``: top-k with score function and the aux-loss scores as single TE
    kernels (else the PyTorch ops of ``topk_routing_with_score_function``)."""
    aux_loss: bool = True
    """``moe_aux_loss_coeff > 0`` (DeepSeek-V3 keeps a small sequence-wise one)."""
    z_loss: bool = False
    """``moe_z_loss_coeff`` set."""
    token_drop: Literal["drop", "pad"] | None = None
    """Megatron's ``apply_router_token_dropping`` (``moe_utils.py``), run by ``TopKRouter.routing``
    whenever ``moe_expert_capacity_factor`` is set: ``drop`` keeps at most ``capacity`` tokens
    an expert, ``pad`` (``moe_pad_expert_input_to_capacity``) exactly ``capacity``; None for
    routers without it (torchtitan's, DeepSpeed's)."""
    permute: Literal["plain", "te", "torch"] = "plain"
    """How the tokens are permuted to their experts and back. ``te``: Megatron's fused
    permutations (``moe_permute_fusion``, which the Bridge model providers set): TE 2.7's
    Triton ``moe_permute_with_probs`` builds its row-id map in three passes before the permute
    kernel, and ``moe_sort_chunks_by_index`` its chunk map before the sort
    (``transformer_engine/pytorch/triton/permutation.py``). ``torch``: Megatron-Core's
    unfused permutations (``moe_permute_fusion`` off): PyTorch's argsort, ``index_select``,
    ``scatter_add_`` and ``split`` / ``cat`` (:mod:`sim.workload.moe_torch_permute`).
    ``plain``: one kernel each, as torchtitan's permutation is priced."""
    gemm_per_expert: bool = False
    """The grouped GEMMs run as Transformer Engine's ``GroupedLinear`` does by default on
    Hopper in bf16 and always in FP8 (``nvte_multi_tensor_gemm`` -> ``multi_stream_cublas_gemm``):
    the host issues one cuBLASLt GEMM per local expert with rows (:attr:`Kernel.launches`);
    else one grouped kernel (``torch._grouped_mm``)."""
    te_ops: bool = False
    """Transformer Engine's operation fuser (Megatron's ``use_transformer_engine_op_fuser``,
    ``TEGroupedMLP`` as ``te.ops`` GroupedLinear -> ScaledSwiGLU -> GroupedLinear on the
    GroupedTensor path): each grouped GEMM is one kernel over every local expert's rows (the
    splits stay on the device), each quantization one ``group_quantize`` launch, and each
    expert's rows are padded to :data:`GROUPED_TENSOR_ALIGN`."""
    fused_glu: bool = False
    """With ``te_ops``: the fused grouped MLP of cuDNN's CuTe-DSL kernels (TE
    ``ops/fused/grouped_mlp.py``, Blackwell, MXFP8, SwiGLU without bias or clamp): fc1's
    epilogue applies the activation times the routing prob and quantizes fc2's input, fc2's
    dgrad epilogue the activation's backward (with the probs' gradient) and quantizes fc1's
    output gradient; no activation or cast kernels of their own."""
    router_bytes: int = FP32
    """Bytes of a routing element (logits, scores, probs), ``moe_router_dtype``
    (:func:`sim.workload.moe_router_ops.router_dtype_bytes`): 4 for fp32, 2 when unset."""
    main_grad_bytes: int = FP32
    """Bytes of a ``main_grad`` element the expert and gate wgrad GEMMs accumulate into
    (gradient-accumulation fusion): 2 where gradients are reduced in 16 bits."""
    mx_swizzled: frozenset[Operand] = frozenset()
    """MXFP8 operands whose scales Transformer Engine swizzles at every grouped GEMM call, one
    multi-tensor kernel each (:func:`sim.workload.mx_swizzle.swizzled_operands`)."""
    torch_grouped_mm: bool = False
    """The grouped GEMMs are ``torch._grouped_mm`` (torchtitan's ``GroupedExperts``), priced at
    its measured slowdown (:attr:`~sim.workload.kernels.Kernel.grouped_impl`)."""
    torchao_mx: bool = False
    """With ``torch_grouped_mm``: torchao's MXFP8 grouped GEMMs (torchtitan's
    ``quantize.grouped_mm.mx`` converter, :mod:`sim.workload.mx_grouped_mm`) in place of the
    bf16 ones; the rest of the layer stays bf16."""
    eager_fc1_bias: bool = False
    """NeMo AutoModel's ``GroupedExpertsDeepEP``: fc1's bias added per expert in eager
    PyTorch after a GEMM without one (:func:`~sim.workload.gpt_oss_ops.expert_input_bias`),
    and the activation (GPT-OSS's clamps included) one compiled kernel
    (``quick_geglu_deepep`` under ``torch.compile``), where Megatron adds the bias in the
    GEMM epilogue and clamps in eager kernels first."""


@dataclass(frozen=True)
class AllToAll:
    """One all-to-all over the EP group as this rank sees it: bytes to and from each peer
    (index = EP rank; this rank's own chunk is copied locally, not sent)."""

    name: str
    send_bytes: tuple[float, ...]
    recv_bytes: tuple[float, ...]
    rank: int = 0

    @property
    def sent_bytes(self) -> float:
        """Bytes this rank puts on the wire (its own chunk excluded)."""
        return sum(b for i, b in enumerate(self.send_bytes) if i != self.rank)

    @property
    def received_bytes(self) -> float:
        return sum(b for i, b in enumerate(self.recv_bytes) if i != self.rank)


@dataclass
class MoELayerOps:
    """The kernels and communication of one MoE layer on one rank, for one micro-batch.

    Blocks in forward order (backward runs them in reverse): ``router`` (gate, top-k, aux
    loss, permutation), then the dispatch all-to-all, ``experts`` (sort by local expert,
    grouped fc1, activation, grouped fc2, sort back), the combine all-to-all, ``combine``
    (unpermute, shared-expert add); ``shared`` (None without shared experts) may run beside
    the dispatch on another stream.
    """

    router: Block
    experts: Block
    combine: Block
    shared: Block | None
    tokens_per_expert: tuple[float, ...]
    """Rows of each local expert's GEMMs (after the expert-TP gather)."""
    alltoall: dict[str, AllToAll] = field(default_factory=dict)
    """``dispatch_fwd``, ``dispatch_probs_fwd``, ``combine_fwd`` and, in backward,
    ``combine_bwd`` (the output gradient sent back to the experts), ``dispatch_bwd``,
    ``dispatch_probs_bwd``; each empty of wire bytes when ``ep`` is 1."""
    etp_gather_bytes: float = 0.0
    """Bytes this rank contributes to the expert-TP all-gather of dispatched tokens (and to the
    reduce-scatter of the combine; the same again in backward); 0 when ``etp`` is 1."""
    count_gather_bytes: float = 0.0
    """The per-expert token counts all-gathered over expert-TP x EP before the dispatch
    (int64; the dispatcher's ``tp_ep_group`` is ``pg_collection.tp_ep``)."""
    host_sync: str = "before_finish"
    """Where the CPU waits for the GPU's token counts (``MoEAlltoAllTokenDispatcher.preprocess``,
    ``_maybe_update_cuda_sync_point``): ``before_ep_alltoall`` when the splits cross ranks
    (ep or expert-TP > 1), ``before_permutation_1`` with a capacity factor, else ``before_finish``;
    the CPU cannot run ahead of the GPU past it."""

    @property
    def blocks(self) -> list[Block]:
        return [b for b in (self.router, self.experts, self.combine, self.shared) if b]


def balanced_tokens_per_expert(tokens: float, top_k: int, experts: int, ep: int = 1,
                               etp: int = 1) -> tuple[float, ...]:
    """Rows of each local expert's GEMM under perfectly balanced routing: each of the
    ``ep x etp`` ranks feeding this rank's experts sends ``tokens x top_k / experts`` to each.

    Examples
    --------
    >>> balanced_tokens_per_expert(4096, 8, 256, ep=64)     # DeepSeek-V3, 4 local experts
    (8192.0, 8192.0, 8192.0, 8192.0)
    """
    local = experts // ep
    return (float(tokens) * top_k * ep * etp / experts,) * local


def _splits(tokens: float, top_k: int, ep: int, counts: Sequence[float], etp: int,
            send: Sequence[float] | None, recv: Sequence[float] | None
            ) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Tokens sent to and received from each EP peer (``input_splits``, ``output_splits``)."""
    out_send = tuple(send) if send is not None else (tokens * top_k / ep,) * ep
    if recv is not None:
        out_recv = tuple(recv)
    else:
        # Without a measured split, what the local experts hold came equally from every peer.
        out_recv = (sum(counts) / etp / ep,) * ep
    if len(out_send) != ep or len(out_recv) != ep:
        raise ValueError(f"per-peer splits must have ep={ep} entries")
    return out_send, out_recv


def _experts(m: ModelSpec, lay: MoELayout, counts: tuple[float, ...]) -> Block:
    """Sort by local expert, grouped fc1, weighted activation, grouped fc2, sort back."""
    assert m.moe is not None
    h = m.hidden
    f = m.moe.ffn_hidden // lay.etp
    b = _Builder("moe_experts", STYLE)
    rows = sum(counts)
    x = b.t("in", rows * h, BF16)
    probs = b.t("probs", rows, lay.router_bytes)
    b.block.inputs += [x, probs]
    if len(counts) > 1 and lay.permute == "torch" and lay.token_drop != "pad":
        # sort_chunks_by_idxs unfused: torch.split by (source rank, local expert), torch.cat
        # in local-expert order, for the tokens and the probs (and their gradients back).
        xs_, ps_ = torch_sort_chunks(b, "sort_chunks", x, probs, rows, h, lay.router_bytes,
                                     lay.ep * lay.etp * len(counts))
        assert ps_ is not None
        x, probs = xs_, ps_
    elif len(counts) > 1:
        # sort_chunks_by_idxs (fused: TE moe_sort_chunks_by_index): tokens and probs from
        # source-rank order into local-expert order; backward sorts the gradient back.
        xs = b.t("sorted", rows * h, BF16)
        ps = b.t("sorted_probs", rows, lay.router_bytes)
        if lay.token_drop == "pad":
            # dispatch_postprocess with drop_and_pad: view, transpose(0, 1).contiguous() of
            # the tokens, then of the probs: two copies of a transposed view, PyTorch's
            # strided loop (Megatron-Core 0.14 token_dispatcher.py).
            b.fwd(Kernel("sort_chunks", "elementwise", (x,), (xs,), legacy_elements=rows * h))
            b.fwd(Kernel("sort_chunks.probs", "elementwise", (probs,), (ps,),
                         legacy_elements=rows))
        else:
            reads: tuple[Tensor, ...] = (x, probs)
            if lay.permute == "te":
                # make_chunk_sort_map: one int32 destination row a token, its own kernel,
                # kept for the backward's sort.
                sort_map = b.t("chunk_sort_map", rows, INT32)
                b.fwd(Kernel("sort_chunks.map", "elementwise", (), (sort_map,)))
                b.save(sort_map)
                reads += (sort_map,)
            b.fwd(Kernel("sort_chunks", "elementwise", reads, (xs, ps)))
        gxs, gx = b.t("g_sorted", rows * h, BF16), b.t("g_in", rows * h, BF16)
        # With drop_and_pad the gradient comes back as the transposed view, which the
        # view's backward reshapes: the same strided copy.
        b.bwd(Kernel("sort_chunks.bwd", "elementwise", (gxs,), (gx,),
                     legacy_elements=rows * h if lay.token_drop == "pad" else 0.0))
        x, probs = xs, ps
    gemm_counts = counts
    if lay.fp8 is not None or lay.te_ops:
        align = GROUPED_TENSOR_ALIGN if lay.te_ops else \
            MXFP8_ALIGN if lay.fp8 == "mxfp8" else FP8_ALIGN
        # Routed (dropless) counts vary around the balanced share: each expert pads what its
        # own count leaves; counts fixed by capacity pad exactly.
        share = m.moe.top_k / m.moe.experts if lay.token_drop is None else 1.0
        gemm_counts = tuple(expected_aligned_rows(c, align, c * (1.0 - share))
                            for c in counts)
    # TEGroupedMLP.forward's fp8_padding (TE Fp8Padding): each expert's rows padded to the
    # FP8 GEMM alignment, a copy of the tokens and another of the probs; Fp8Unpadding after
    # fc2 copies them back. TE returns the input itself when every expert's rows are already
    # aligned (transformer_engine/pytorch/module/fp8_padding.py, "no padding needed"), which
    # only padding to capacity guarantees (capacity x ep x etp rows each, fixed): routed
    # counts are data-dependent and essentially never all multiples of 16, even where the
    # balanced idealisation here makes them so.
    padded = lay.fp8 is not None and (gemm_counts != counts or lay.token_drop != "pad")
    if padded:
        xp = b.t("padded", sum(gemm_counts) * h, BF16)
        pp = b.t("padded_probs", sum(gemm_counts), lay.router_bytes)
        b.fwd(Kernel("fp8_pad", "elementwise", (x, probs), (xp, pp)))
        gxp, gx2 = b.t("g_padded", sum(gemm_counts) * h, BF16), b.t("g_unpad", rows * h, BF16)
        b.bwd(Kernel("fp8_pad.bwd", "elementwise", (gxp,), (gx2,)))
        x, probs = xp, pp
    prow = sum(gemm_counts)
    swiglu = m.mlp == "swiglu"
    width = 2 * f if swiglu else f
    if lay.fused_glu and lay.fp8 == "mxfp8" and swiglu and h % 64 == 0 and f % 64 == 0:
        # SwiGLU and GPT-OSS's clamped quick-GEGLU (TE ScaledClampedQGeGLU), biases packed
        # into the GEMM epilogues (grouped_mlp.py _pack_grouped_linear_bias_for_cudnn); the
        # fusion matches only features in multiples of 64 (validate_grouped_mlp_dims).
        out = fused_glu_mlp(b, x, probs, gemm_counts, h, f, lay, m.bias, model_rows=rows)
        return _experts_tail(b, m, lay, out, counts, rows, gemm_counts, padded, probs)
    # bf16: TE takes fc1's bias gradient from its wgrad GEMM (no kernel of its own).
    eager_bias = m.bias and lay.eager_fc1_bias
    fc1 = grouped_linear(b, x, gemm_counts, h, width, "fc1", lay, m.bias and not eager_bias,
                         bias_grad_kernel=lay.fp8 is not None or lay.te_ops, model_rows=rows,
                         input_calls=2 if swiglu and lay.torchao_mx else 1)
    if eager_bias:
        b.block.params += len(counts) * width
        fc1 = expert_input_bias(b, fc1, gemm_counts, width)
    # The operation fuser's activation op (ScaledSwiGLU / ScaledClampedQGeGLU) and
    # AutoModel's compiled one clamp inside their own kernel; Megatron's eager path clamps
    # first.
    act_in = fc1 if m.activation_clamp is None or lay.te_ops or lay.eager_fc1_bias \
        else clamped_glu_input(b, fc1, prow, f)
    act = b.t("act", prow * f, BF16)
    # weighted_bias_swiglu_impl (or the GELU equivalent): bias, activation and the routing
    # prob in one kernel; input and probs saved; backward gives both gradients.
    b.fwd(Kernel("weighted_act", "elementwise", (act_in, probs), (act,)))
    b.save(act_in, probs)
    ga = b.t("g_act", prow * f, BF16)
    gfc1 = b.t("g_fc1", prow * width, BF16)
    gp = b.t("g_probs", prow, lay.router_bytes)
    b.bwd(Kernel("weighted_act.bwd", "elementwise", (ga, act_in, probs), (gfc1, gp)))
    # fc2 skips its bias (skip_bias_add: TEGroupedMLP._apply_bias adds it after the unpad);
    # the operation fuser's GroupedLinear op adds it in its epilogue.
    out = grouped_linear(b, act, gemm_counts, f, h, "fc2", lay, m.bias,
                         bias_grad_kernel=lay.te_ops, model_rows=rows)
    return _experts_tail(b, m, lay, out, counts, rows, gemm_counts, padded, probs)


def _experts_tail(b: _Builder, m: ModelSpec, lay: MoELayout, out: Tensor,
                  counts: tuple[float, ...], rows: float, gemm_counts: tuple[float, ...],
                  padded: bool, probs: Tensor) -> Block:
    """After fc2: the unpadding, the experts' output bias and the sort back."""
    h = m.hidden
    if padded:
        up = b.t("unpadded", rows * h, BF16)
        b.fwd(Kernel("fp8_unpad", "elementwise", (out,), (up,)))
        gup = b.t("g_unpadded", rows * h, BF16)
        gout = b.t("g_fc2_out", sum(gemm_counts) * h, BF16)
        b.bwd(Kernel("fp8_unpad.bwd", "elementwise", (gup,), (gout,)))
        out = up
    if m.bias and not lay.te_ops:
        out = expert_output_bias(b, out, probs, counts, h)
    if len(counts) > 1 and lay.permute == "torch" and lay.token_drop != "pad":
        # combine_preprocess's sort_chunks_by_idxs back, unfused: split and cat (tokens only).
        out = torch_sort_chunks(b, "unsort_chunks", out, None, rows, h, lay.router_bytes,
                                lay.ep * lay.etp * len(counts))[0]
    elif len(counts) > 1:
        back = b.t("unsorted", rows * h, BF16)
        if lay.permute == "te" and lay.token_drop != "pad":
            # combine_preprocess: sort_chunks_by_idxs back, with a chunk map of its own.
            b.fwd(Kernel("unsort_chunks.map", "elementwise", (),
                         (b.t("chunk_unsort_map", rows, INT32),)))
        # combine_preprocess with drop_and_pad: transpose(0, 1).contiguous() back, and its
        # gradient's reshape: strided copies as above.
        strided = rows * h if lay.token_drop == "pad" else 0.0
        b.fwd(Kernel("unsort_chunks", "elementwise", (out,), (back,), legacy_elements=strided))
        gb, gbs = b.t("g_out", rows * h, BF16), b.t("g_unsorted", rows * h, BF16)
        b.bwd(Kernel("unsort_chunks.bwd", "elementwise", (gb,), (gbs,),
                     legacy_elements=strided))
        out = back
    b.block.outputs.append(out)
    return b.finish()


def _combine(m: ModelSpec, tokens: float, shared: bool, rows: float | None = None,
             torch_ops: bool = False) -> Block:
    """Unpermutation 1 (TE ``moe_unpermute``): each token's ``top_k`` expert outputs summed
    back into place; then the shared experts' output added. Backward gathers the output
    gradient once per copy. ``rows`` as for :func:`permute_kernels`; ``torch_ops``:
    Megatron's unfused ``zeros`` + ``scatter_add_`` instead (:mod:`.moe_torch_permute`)."""
    assert m.moe is not None
    h, k, e = m.hidden, m.moe.top_k, m.moe.experts
    rows = tokens * k if rows is None else rows
    b = _Builder("moe_combine", STYLE)
    x = b.t("in", rows * h, BF16)
    if torch_ops:
        b.block.inputs.append(x)
        return finish_with_shared(b, torch_unpermute_kernels(b, h, x, tokens, rows),
                                  tokens * h, shared)
    rid = b.t("row_id_map", tokens * e, INT32)
    b.block.inputs.append(x)
    out = b.t("out", tokens * h, BF16)
    b.fwd(Kernel("unpermute", "elementwise", (x, rid), (out,)))
    # The output gradient [tokens, h], read once per copy.
    gsrc = b.t("unpermute.g_rows", rows * h, BF16)
    gx = b.t("g_in", rows * h, BF16)
    b.bwd(Kernel("unpermute.bwd", "elementwise", (gsrc, rid), (gx,)))
    return finish_with_shared(b, out, tokens * h, shared)


def finish_with_shared(b: _Builder, out: Tensor, elements: float, shared: bool) -> Block:
    """End a combine block: the shared experts' output (``elements`` wide, bf16) added to
    ``out`` when the layer has shared experts, the result the block's output."""
    if shared:
        sh = b.t("shared_out", elements, BF16)
        y = b.t("sum", elements, BF16)
        b.fwd(Kernel("add_shared", "elementwise", (out, sh), (y,)))
        out = y
    b.block.outputs.append(out)
    return b.finish()


def shared_experts_block(m: ModelSpec, lay: MoELayout, tokens: float) -> Block:
    """``SharedExpertMLP``: a dense TP MLP ``shared x moe_ffn_hidden`` wide over the layer's
    tokens gathered across TP (sequence parallel), its width split over ``tp``."""
    assert m.moe is not None
    h = m.hidden
    f = m.moe.shared * m.moe.ffn_hidden // lay.tp
    full = tokens * lay.tp
    mlay = MegatronLayout(tp=lay.tp, fp8=lay.fp8, weight_cast_share=lay.weight_cast_share,
                          fp8_transpose=lay.fp8_transpose, mx_swizzled=lay.mx_swizzled)
    b = _Builder("moe_shared", STYLE)
    x = b.t("in", full * h, BF16)
    b.block.inputs.append(x)
    width = 2 * f if m.mlp == "swiglu" else f
    fc1 = _linear(b, x, full, h, width, "fc1", m.bias, bias_in_epilogue=True, lay=mlay)
    act = b.t("act", full * f, BF16)
    b.fwd(Kernel("bias_act", "elementwise", (fc1,), (act,)))
    b.save(fc1)
    ga, gi = b.t("g_act", full * f, BF16), b.t("g_fc1", full * width, BF16)
    b.bwd(Kernel("bias_act.bwd", "elementwise", (ga, fc1), (gi,)))
    out = _linear(b, act, full, f, h, "fc2", m.bias, bias_in_epilogue=True, lay=mlay)
    b.block.outputs.append(out)
    return b.finish()


def moe_layer_ops(m: ModelSpec, lay: MoELayout, tokens: float,
                  tokens_per_expert: Sequence[float] | None = None,
                  send_tokens: Sequence[float] | None = None,
                  recv_tokens: Sequence[float] | None = None, ep_rank: int = 0,
                  permuted_rows: float | None = None) -> MoELayerOps:
    """The kernels of one MoE layer on one rank and the bytes of its all-to-alls.

    Parameters
    ----------
    m : ModelSpec
        A model with experts (``m.moe``).
    lay : MoELayout
        ``ep``, ``etp``, ``tp``, FP8 and router options.
    tokens : float
        Tokens entering the layer on this rank (micro-batch x sequence / (cp x tp) with
        sequence parallelism).
    tokens_per_expert : sequence of float, optional
        Rows of each of the ``experts / ep`` local experts' GEMMs, after the expert-TP gather
        (the routing imbalance); balanced by default
        (:func:`balanced_tokens_per_expert`).
    send_tokens, recv_tokens : sequence of float, optional
        Tokens sent to and received from each EP peer by the dispatch (Megatron's
        ``input_splits`` and ``output_splits``); balanced by default, ``recv_tokens`` then
        spread evenly from ``tokens_per_expert``.
    ep_rank : int
        This rank's index in the EP group (its own chunk never leaves the GPU).
    permuted_rows : float, optional
        Rows of the permutation and unpermutation (default ``tokens x top_k``): with
        ``moe_pad_expert_input_to_capacity``, ``experts x capacity``.

    Returns
    -------
    MoELayerOps

    Examples
    --------
    >>> m = ModelSpec.from_ref("mixtral-8x7b")
    >>> ops = moe_layer_ops(m, MoELayout(ep=8), tokens=4096)
    >>> ops.tokens_per_expert                     # 4096 tokens x top-2 over 8 experts x 8 ranks
    (8192.0,)
    >>> ops.alltoall["dispatch_fwd"].sent_bytes == 4096 * 2 * 4096 * 2 * 7 / 8
    True
    >>> round(ops.experts.flops_fwd / (2 * 4096 * 2 * 3 * 4096 * 14336), 6)
    1.0
    """
    moe = m.moe
    if moe is None:
        raise ValueError(f"model {m.name!r} has no experts")
    if moe.experts % lay.ep:
        raise ValueError(f"experts ({moe.experts}) not divisible by ep ({lay.ep})")
    if moe.ffn_hidden % lay.etp:
        raise ValueError(f"expert width ({moe.ffn_hidden}) not divisible by etp ({lay.etp})")
    if lay.token_drop is not None and moe.capacity_factor is None:
        raise ValueError("token dropping needs the model's capacity_factor")
    local = moe.experts // lay.ep
    if tokens_per_expert is None:
        counts = balanced_tokens_per_expert(tokens, moe.top_k, moe.experts, lay.ep, lay.etp)
    else:
        counts = tuple(float(c) for c in tokens_per_expert)
        if len(counts) != local or min(counts) < 0:
            raise ValueError(f"tokens_per_expert needs {local} non-negative counts")
    send, recv = _splits(tokens, moe.top_k, lay.ep, counts, lay.etp, send_tokens, recv_tokens)
    rb, x, probs, gprobs = router_kernels(m, lay, tokens)
    permute_kernels(rb, m, x, probs, gprobs, tokens, permuted_rows, te=lay.permute == "te",
                    router_bytes=lay.router_bytes, torch_ops=lay.permute == "torch",
                    pad=lay.token_drop == "pad")
    router = rb.finish()
    ops = MoELayerOps(router=router, experts=_experts(m, lay, counts),
                      combine=_combine(m, tokens, moe.shared > 0, permuted_rows,
                                       torch_ops=lay.permute == "torch"),
                      shared=shared_experts_block(m, lay, tokens) if moe.shared else None,
                      tokens_per_expert=counts)
    hb = m.hidden * BF16      # the alltoall dispatcher moves 16-bit tokens
    s_b = tuple(t * hb for t in send)
    r_b = tuple(t * hb for t in recv)
    s_p = tuple(t * lay.router_bytes for t in send)      # probs in moe_router_dtype
    r_p = tuple(t * lay.router_bytes for t in recv)
    a = {"dispatch_fwd": AllToAll("dispatch_fwd", s_b, r_b, ep_rank),
         "dispatch_probs_fwd": AllToAll("dispatch_probs_fwd", s_p, r_p, ep_rank),
         "combine_fwd": AllToAll("combine_fwd", r_b, s_b, ep_rank),
         # Backward: each all-to-all's gradient is the reverse all-to-all.
         "combine_bwd": AllToAll("combine_bwd", s_b, r_b, ep_rank),
         "dispatch_bwd": AllToAll("dispatch_bwd", r_b, s_b, ep_rank),
         "dispatch_probs_bwd": AllToAll("dispatch_probs_bwd", r_p, s_p, ep_rank)}
    if lay.ep == 1:
        a = {k: AllToAll(v.name, (0.0,), (0.0,), 0) for k, v in a.items()}
    ops.alltoall = a
    ops.etp_gather_bytes = sum(recv) * hb if lay.etp > 1 else 0.0
    ops.count_gather_bytes = moe.experts * 8.0 if lay.ep * lay.etp > 1 else 0.0
    if moe.capacity_factor is not None:
        ops.host_sync = "before_permutation_1"
    elif lay.ep * lay.etp > 1:
        ops.host_sync = "before_ep_alltoall"
    return ops
