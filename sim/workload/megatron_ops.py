"""The kernels of a Megatron-LM transformer layer on one tensor-parallel rank.

Megatron's GPT/Llama layer with its fused kernels (apex/TE fused LayerNorm or RMSNorm,
column-parallel QKV and fc1, row-parallel output projection and fc2, jit-fused
bias-dropout-add and bias-GeLU, gradient-accumulation fusion into ``main_grad``),
following ``megatron/core/transformer`` (local spec) and ``megatron/core/tensor_parallel``.
Parameters and activations are 16-bit; there is no autocast.

Core attention is either a flash kernel (``flash_attention``) or Megatron's unfused path:
``baddbmm`` for the scores, the fused scale-mask-softmax kernel, dropout on the
probabilities, ``bmm`` with V (``megatron/core/transformer/dot_product_attention.py``).

Each block is split in two parts so that the framework can place tensor-parallel
communication between them as Megatron does: ``pre`` is the normalisation (on the local
sequence shard with sequence parallelism), ``main`` the rest. Saved activations follow from
the kernels; with 16-bit activations and 1-byte dropout masks they reproduce Korthikanti et
al., "Reducing Activation Recomputation in Large Transformer Models" (2022), section 4:
``sbh(34 + 5as/h)`` per layer without parallelism, ``sbh(10 + 24/t + 5as/(ht))`` with tensor
parallelism, ``sbh(34/t + 5as/(ht))`` with sequence parallelism too.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Literal

from sim.config.base import Fp8Recipe
from sim.hardware.attention_cost import window_pairs
from sim.workload.gpt_oss_ops import unfused_rope, yarn_concentration
from sim.workload.kernels import BOOL, accumulating
from sim.workload.layer_ops import BF16, FP32, IDX, Block, Kernel, Style, Tensor, _Builder
from sim.workload.layer_rules import (
    BLOCK_SCALED,
    bias_grad,
    fp8_element_bytes,
    fused_norm_forward,
    linear16_gemms,
    linear_gemm,
    linear_params,
    scaled_cast,
    te_scaled_cast,
)
from sim.workload.megatron_loss import LossImpl, vocab_parallel_loss
from sim.workload.model import ModelSpec
from sim.workload.mx_swizzle import Operand, scale_swizzles, sp_swizzled
from sim.workload.qkv_split import qkv_split
from sim.workload.te_attention import (
    cp_ring_backward_kernels,
    cp_ring_forward_kernels,
    fp8_attention_inputs,
)

MASK = BOOL  # dropout masks are bytes


@dataclass(frozen=True)
class MegatronLayout:
    """What changes a Megatron layer's kernels: parallel degrees and options."""

    tp: int = 1
    sequence_parallel: bool = False
    flash_attention: bool = True
    dropout: float = 0.0
    """hidden_dropout and attention_dropout (Megatron-DeepSpeed default 0.1)."""
    selective_recompute: bool = False
    """Recompute core attention in backward (Megatron's --recompute-granularity selective)."""
    cp: int = 1
    """Context parallelism: each rank holds seq/cp tokens of every sequence."""
    fp8: Fp8Recipe | None = None
    """FP8 linear layers (Transformer Engine, ``--fp8-format``) with this scaling recipe
    (``--fp8-recipe``, :data:`~sim.workload.layer_rules.Fp8Recipe`); None = 16-bit."""
    weight_cast_share: float = 1.0
    """Share of a weight's FP8 cast each micro-batch pays: Transformer Engine casts weights on
    the first micro-batch of a step only (``is_first_microbatch``), 1 / micro-batches."""
    fp8_transpose: bool = True
    """FP8 casts also write the transposed (column-wise) copy the backward GEMMs read:
    Hopper's FP8 GEMMs take only the TN layout. Blackwell's do not
    (``nvte_is_non_tn_fp8_gemm_supported``, TE 2.7 ``common/transformer_engine.cpp``: compute
    capability 10.x and 13.x): TE's quantizers then write row-wise data only
    (``Float8CurrentScalingQuantizer`` / ``Float8Quantizer`` ``create_tensor``,
    ``pytorch/csrc/quantizer.cpp``) and the dgrad and wgrad GEMMs read it transposed."""
    cross_entropy: LossImpl = "unfused"
    """The loss's implementation (:mod:`sim.workload.megatron_loss`)."""
    rope_fusion: bool = False
    """``apply_rope_fusion``: MLA's fused rotary kernels (:mod:`sim.workload.megatron_mla`)."""
    fp8_output: bool = False
    """``fp8_output_proj``: the output layer (LM head) runs under the FP8 recipe too
    (Megatron-Core's ``TELMHeadColumnParallelLinear``, MXFP8 only); else it stays 16-bit."""
    fp8_attention: bool = False
    """``fp8_dot_product_attention`` (TE's ``fp8_dpa``): the fused attention runs in FP8, MXFP8
    under the mxfp8 recipe (:func:`fp8_attention_inputs`)."""
    grad_accumulation_fusion: bool = True
    """``gradient_accumulation_fusion``: each wgrad GEMM adds into ``main_grad`` (in its
    dtype, :attr:`main_grad_bytes`); off, it writes a 16-bit gradient that one elementwise
    kernel then adds there."""
    main_grad_bytes: int = FP32
    """Bytes of a ``main_grad`` element (2 when gradients are reduced in 16 bits): what the
    unfused accumulation's add reads and writes."""
    mx_swizzled: frozenset[Operand] = frozenset()
    """MXFP8 operands whose scales Transformer Engine swizzles in a kernel of its own at every
    GEMM call (:func:`sim.workload.mx_swizzle.swizzled_operands`)."""


STYLE = Style("bf16")


def _local(m: ModelSpec, lay: MegatronLayout) -> tuple[int, int, int, int, int]:
    """Per-rank (q width, kv width, heads, kv heads, ffn width) under tensor parallelism."""
    t = lay.tp
    heads = m.heads // t
    kv_heads = max(1, m.kv_heads // t)   # fewer KV heads than ranks: replicated
    return heads * m.head_dim, kv_heads * m.head_dim, heads, kv_heads, m.ffn_hidden // t


def _dropout(b: _Builder, x: Tensor, numel: float, name: str, p: float, g_in: Tensor
             ) -> tuple[Tensor, Tensor]:
    """Dropout as its own kernel (attention probabilities): output and a 1-byte mask saved.
    ``g_in``: the gradient of ``x`` its backward writes. Returns the output and the gradient
    of the output that its backward reads (``x`` and ``g_in`` when ``p`` is 0)."""
    if p <= 0:
        return x, g_in
    out = b.t(f"{name}.out", numel, BF16)
    mask = b.t(f"{name}.mask", numel, MASK)
    b.fwd(Kernel(f"{name}", "elementwise", (x,), (out, mask)))
    b.save(mask)
    g = b.t(f"{name}.g_out", numel, BF16)
    b.bwd(Kernel(f"{name}.bwd", "elementwise", (g, mask), (g_in,)))
    return out, g


def _saved_bmm(b: _Builder, name: str, xy: tuple[Tensor, Tensor], out: Tensor,
               grads: tuple[Tensor, Tensor, Tensor], flops: float,
               shape: tuple[float, int, int]) -> None:
    """``out = x @ y`` batched, both inputs saved; its backward (added at once, so it runs
    right before what precedes it) reads ``grads[0]`` (the output's gradient) and writes
    ``grads[1]`` (x's) by the ``dgrad`` GEMM and ``grads[2]`` (y's) by the ``wgrad`` one.
    ``shape``: (rows, inner, columns) of the forward product."""
    x, y = xy
    g_out, gx, gy = grads
    b.fwd(Kernel(name, "gemm", (x, y), (out,), flops, gemm=(*shape, "fwd")))
    b.save(x, y)
    b.bwd(Kernel(f"{name}.dgrad", "gemm", (g_out, y), (gx,), flops, gemm=(*shape, "dgrad")),
          Kernel(f"{name}.wgrad", "gemm", (g_out, x), (gy,), flops, gemm=(*shape, "wgrad")))


def unfused_core_attention(b: _Builder, qkv: tuple[Tensor, Tensor, Tensor],
                           grads: tuple[Tensor, Tensor, Tensor], ctx: Tensor, gctx: Tensor,
                           rows: float, kv_len: int, head_dims: tuple[int, int],
                           dropout: float, sink_grad: tuple[Tensor, ...] = ()) -> None:
    """Core attention without a fused kernel: ``baddbmm`` Q K^T over the whole score matrix,
    the fused scale-mask-softmax, dropout, the P V ``bmm`` (Megatron's local path and
    Transformer Engine's ``UnfusedDotProductAttention`` alike), for ``rows`` (batch x local
    heads x queries) over ``kv_len`` keys; ``head_dims``: the query/key and value widths
    (Multi-head Latent Attention's differ). ``grads``: the gradients of q, k and v its
    backward writes; ``gctx`` the context's it reads."""
    q, k, v = qkv
    gq, gk, gv = grads
    d_qk, d_v = head_dims
    n_scores = rows * kv_len
    scores = b.t("scores", n_scores, BF16)
    fl_qk, fl_pv = 2.0 * n_scores * d_qk, 2.0 * n_scores * d_v
    gs = b.t("g_scores", n_scores, BF16)
    gp = b.t("g_probs", n_scores, BF16)
    # Each op's backward is added right after its forward (the builder runs them in
    # reverse): P V's, dropout's, the softmax's, then Q K^T's.
    _saved_bmm(b, "qk_bmm", (q, k), scores, (gs, gq, gk), fl_qk, (rows, d_qk, kv_len))
    probs = b.t("probs", n_scores, BF16)
    b.fwd(Kernel("softmax", "elementwise", (scores,), (probs,)))
    b.save(probs)
    b.bwd(Kernel("softmax.bwd", "elementwise", (gp, probs), (gs,) + sink_grad))
    dropped, gd = _dropout(b, probs, n_scores, "attn_dropout", dropout, gp)
    _saved_bmm(b, "pv_bmm", (dropped, v), ctx, (gctx, gd, gv), fl_pv, (rows, kv_len, d_v))


def _norm(b: _Builder, m: ModelSpec, x: Tensor, tokens: float, name: str) -> Tensor:
    """Fused LayerNorm/RMSNorm (apex MixedFusedLayerNorm / TE): input and row stats saved."""
    h = m.hidden
    b.block.params += m.norm_params
    y = b.t(f"{name}.out", tokens * h, BF16)
    stats = b.t(f"{name}.stats", 2 * tokens, FP32)
    fused_norm_forward(b, x, y, stats, name)
    gy = b.t(f"{name}.g_out", tokens * h, BF16)
    gx = b.t(f"{name}.g_in", tokens * h, BF16)
    gw = b.t(f"{name}.g_w", m.norm_params, FP32)
    # Backward is Megatron's own, not the PyTorch builder's norms (layer_builder): the weight
    # kernel reads the row statistics and writes an fp32 gradient.
    b.bwd(Kernel(f"{name}.bwd", "norm_fused", (gy, x, stats), (gx,)),
          Kernel(f"{name}.bwd_w", "norm_fused", (gy, x, stats), (gw,)))
    b.block.weight_grads.append(gw)
    return y


def _row_norm(b: _Builder, m: ModelSpec, x: Tensor, rows: float, width: int,
              name: str) -> Tensor:
    """A fused norm of ``rows`` rows ``width`` wide inside a block, with its own ``width``
    weights: Qwen3's per-head query or key norm (Megatron-Core ``qk_layernorm``:
    ``SelfAttention`` builds ``q_layernorm``/``k_layernorm`` over
    ``hidden_size_per_attention_head`` and applies them in ``get_query_key_value_tensors`` to
    the split [s, b, heads, head_dim] query and key, before the rotary embedding;
    megatron/core/transformer/attention.py), or MLA's latent norms (``q_layernorm`` over
    q_lora_rank, ``kv_layernorm`` over kv_lora_rank; multi_latent_attention.py).
    One fused kernel (TE's ``RMSNorm`` or apex's fused norm) reads the input and writes the
    output and one fp32 statistic per row (rstd; LayerNorm's mean too), saving the input and
    statistics. Backward is one fused kernel (TE's ``rmsnorm_bwd``: the input gradient and
    the per-block partial weight gradient from one read of the output gradient, input and
    statistics, the partials summed into the fp32 ``main_grad``). The weight is replicated
    over tensor-parallel ranks; its gradient's all-reduce over the tensor-parallel group
    (``finalize_model_grads._allreduce_layernorm_grads``, a few KiB per layer) is not
    modelled, like the sequence-parallel norms'."""
    stat = 2 if m.norm == "layernorm" else 1
    b.block.params += width
    y = b.t(f"{name}.out", rows * width, BF16)
    stats = b.t(f"{name}.stats", stat * rows, FP32)
    fused_norm_forward(b, x, y, stats, name)
    gy = b.t(f"{name}.g_out", rows * width, BF16)
    gx = b.t(f"{name}.g_in", rows * width, BF16)
    gw = b.t(f"{name}.g_w", width, FP32)
    b.bwd(Kernel(f"{name}.bwd", "norm_fused", (gy, x, stats), (gx, gw)))
    b.block.weight_grads.append(gw)
    return y


def _linear(b: _Builder, x: Tensor, tokens: float, n_in: int, n_out: int, name: str,
            bias: bool, bias_in_epilogue: bool = False,
            lay: MegatronLayout | None = None, g_out: Tensor | None = None,
            grad_in_output: bool = False, after_norm: bool = False,
            parallel: Literal["column", "row"] | None = None) -> Tensor:
    """A tensor-parallel linear on the local shard; weight gradient accumulated straight into
    main_grad (fp32, or 16-bit with ``lay.main_grad_bytes`` 2) by the wgrad GEMM
    (gradient_accumulation_fusion), else added there by one kernel.

    With FP8 (``lay.fp8``, Transformer Engine's ``Linear``/``LayerNormLinear`` under
    ``fp8_autocast``, ``transformer_engine/pytorch/module/linear.py``): the input is cast to
    E4M3 with its transpose (``cast_transpose``: Hopper's FP8 GEMMs take only the TN layout,
    so the wgrad needs the transposed copy), which is what is saved for backward (1 byte per
    element instead of 2); the weight is cast the same way once per step; backward casts the
    output gradient to E5M2 with its transpose; the three GEMMs run on FP8 operands with
    16-bit (fwd, dgrad) or main_grad (wgrad) outputs. The ``tensorwise`` recipe (current
    scaling) first reduces each tensor's amax in its own pass; ``delayed`` scaling takes the
    scale from the amax history and records the new amax inside the cast. Where TE fuses the
    cast into the preceding norm or activation kernel we still count it as its own pass.

    ``g_out``: the output gradient when the caller's backward produces it as a tensor of its
    own (the fused losses' gradient of the logits); ``grad_in_output``: it arrives in the
    output's own storage (Transformer Engine's cross-entropy); a new tensor otherwise.
    ``after_norm``: the input is the preceding norm's output on this rank's whole sequence
    (``LayerNormLinear`` without sequence parallelism), whose amax the norm kernel records
    under current scaling (:func:`~sim.workload.layer_rules.te_scaled_cast`).
    ``parallel``: a column- or row-parallel linear; with sequence parallelism its input
    (column) or output gradient (row) is gathered after it is quantized, so Transformer Engine
    swizzles that operand's MXFP8 scales at the GEMM call in every release
    (:mod:`sim.workload.mx_swizzle`).
    """
    b.block.params += linear_params(n_in, n_out, bias)
    fp8 = lay.fp8 if lay is not None else None
    y = b.t(f"{name}.out", tokens * n_out, BF16)
    gy = y if grad_in_output else g_out if g_out is not None else \
        b.t(f"{name}.g_out", tokens * n_out, BF16)
    gx = b.t(f"{name}.g_in", tokens * n_in, BF16)
    # Fused, the wgrad GEMM accumulates into main_grad in its own dtype: fp32, or 16 bits
    # where gradients are reduced in 16 bits (Megatron's wgrad_gemm_accum_fp16).
    gw = b.t(f"{name}.main_grad", n_in * n_out,
             lay.main_grad_bytes if lay is not None else FP32)
    if fp8 is None:
        w = b.t(f"{name}.w", n_in * n_out, BF16)
        ks = linear16_gemms(b, name, x, w, y, gy, gx, gw, tokens, n_in, n_out)
    else:
        assert lay is not None
        share = lay.weight_cast_share
        layouts = 2 if lay.fp8_transpose else 1
        # Block scales travel with their data (1/32 byte an element, layer_rules).
        e8 = fp8_element_bytes(fp8)
        blocks = fp8 in BLOCK_SCALED
        w16 = b.t(f"{name}.w_bf16_share", n_in * n_out * share, BF16)
        w8s = b.t(f"{name}.w_fp8_share", layouts * n_in * n_out * share, e8)
        w8 = b.t(f"{name}.w_fp8", n_in * n_out, e8)
        amax = fp8 == "tensorwise"
        # Named as what the backward reads (``in_fp8_t``, which recomputation looks up)
        # when the one row-wise copy serves both.
        x8 = b.t(f"{name}.in_fp8" if lay.fp8_transpose else f"{name}.in_fp8_t",
                 tokens * n_in, e8)
        # TE's cast_transpose writes both GEMM layouts in one kernel on Hopper (torchao: one
        # cast each); on Blackwell the row-wise data serves every GEMM (fp8_transpose).
        x8t = b.t(f"{name}.in_fp8_t", tokens * n_in, e8) if lay.fp8_transpose else x8
        xs = (x8, x8t) if lay.fp8_transpose else (x8,)
        # The weight's cast runs on the first micro-batch only (its share); the input's and
        # the output gradient's every micro-batch, with current scaling's four launches each.
        for k in (scaled_cast(name, "w", w16, (w8s,), amax, te=True)
                  + te_scaled_cast(name, "in", x, xs, amax,
                                   amax_in_norm=after_norm and not lay.sequence_parallel)):
            b.fwd(k)
        sw = lay.mx_swizzled if fp8 == "mxfp8" else frozenset()
        if fp8 == "mxfp8" and lay.sequence_parallel and parallel is not None:
            sw = sp_swizzled(sw, parallel)
        nx, ng, nw = tokens * n_in, tokens * n_out, n_in * n_out
        for k in scale_swizzles(name, "fwd", (("in", nx), ("w", nw)), sw):
            b.fwd(k)
        b.fwd(linear_gemm(name, "fwd", (x8, w8), y, tokens, n_in, n_out, fp8=True,
                          fp8_block=blocks))
        b.save(x8t)
        g8 = b.t(f"{name}.g_out_fp8", tokens * n_out, e8)
        g8t = b.t(f"{name}.g_out_fp8_t", tokens * n_out, e8) if lay.fp8_transpose else g8
        gs = (g8, g8t) if lay.fp8_transpose else (g8,)
        ks = [*te_scaled_cast(name, "g", gy, gs, amax),
              *scale_swizzles(name, "dgrad", (("g", ng), ("w", nw)), sw),
              linear_gemm(name, "dgrad", (g8, w8), gx, tokens, n_in, n_out, fp8=True,
                          fp8_block=blocks),
              *scale_swizzles(name, "wgrad", (("g", ng), ("in", nx)), sw),
              linear_gemm(name, "wgrad", (g8t, x8t), gw, tokens, n_in, n_out, fp8=True,
                          fp8_block=blocks)]
    out = y
    if bias and not bias_in_epilogue:
        out = b.t(f"{name}.biased", tokens * n_out, BF16)
        b.fwd(Kernel(f"{name}.bias", "elementwise", (y,), (out,)))
    if bias:
        gb = b.t(f"{name}.g_b", n_out, FP32)
        ks.append(bias_grad(name, gy, gb))
    if lay is None or lay.grad_accumulation_fusion:
        # The wgrad GEMM adds into the persistent main_grad.
        b.bwd(*(accumulating(k, gw) if k.name == f"{name}.wgrad" else k for k in ks))
    else:
        # Unfused (NeMo's Megatron-FSDP recipes): a 16-bit gradient, then main_grad += it.
        g16 = b.t(f"{name}.w_grad", n_in * n_out, BF16)
        ks = [replace(k, writes=(g16,)) if k.name == f"{name}.wgrad" else k for k in ks]
        mg = Tensor(f"{name}.main_grad_buffer", n_in * n_out * lay.main_grad_bytes)
        b.bwd(*ks, Kernel(f"{name}.main_grad_add", "elementwise", (mg, g16), (mg,)))
    b.block.weight_grads.append(gw)
    return out


def _keep_input_shard(b: _Builder, kept: int, name: str, numel: float,
                      lay: MegatronLayout) -> None:
    """With sequence parallelism a column-parallel linear keeps only its sequence shard of the
    gathered input (1 byte per element in FP8) and gathers it again in backward: replace what
    :func:`_linear` saved for its input (everything saved after index ``kept``)."""
    if lay.sequence_parallel:
        del b.block.saved[kept:]
        b.save(b.t(name, numel, fp8_element_bytes(lay.fp8) if lay.fp8 else BF16))


def _bias_dropout_add(b: _Builder, out: Tensor, resid: Tensor, tokens: float, h: int,
                      name: str, p: float) -> Tensor:
    """Jit-fused bias + dropout + residual add; the dropout mask is saved."""
    y = b.t(f"{name}.out", tokens * h, BF16)
    writes: tuple[Tensor, ...] = (y,)
    if p > 0:
        mask = b.t(f"{name}.mask", tokens * h, MASK)
        writes = (y, mask)
        b.save(mask)
    b.fwd(Kernel(name, "elementwise", (out, resid), writes))
    g = b.t(f"{name}.g", tokens * h, BF16)
    if p > 0:
        gb = b.t(f"{name}.g_branch", tokens * h, BF16)
        b.bwd(Kernel(f"{name}.bwd", "elementwise", (g, writes[-1]), (gb,)))
    return y


def attention_block(m: ModelSpec, lay: MegatronLayout, batch: int, seq: int,
                    window: int | None = None) -> tuple[Block, Block]:
    """(pre, main) of the attention half of a layer; ``window``: a sliding-window layer's
    keys per query (GPT-OSS's even layers; None: full causal attention).

    A windowed flash kernel runs the band only: its FLOPs are ``4 x heads x head_dim x
    window_pairs`` forward (:func:`~sim.hardware.attention_cost.window_pairs`) and its time
    the band's tiles. Megatron's unfused path (``local`` attention backend) masks the full
    score matrix (``get_sliding_window_causal_mask``, megatron/core/transformer/utils.py) and
    costs what a full layer does. Attention sinks (``softmax_type="learnable"``,
    TransformerConfig; TE's ``softmax_offset``): one learned logit per local head, a
    parameter of the block whose gradient the attention backward writes; the extra softmax
    column is one score per query and head beside the keys (negligible, not priced)."""
    t = lay.tp
    s = seq // lay.cp
    tokens = batch * s
    local = tokens / t if lay.sequence_parallel else tokens
    qd, kvd, heads, groups, _ = _local(m, lay)
    h = m.hidden
    pre = _Builder("attn_pre", STYLE)
    x = pre.t("in", local * h, BF16)
    pre.block.inputs.append(x)
    y = _norm(pre, m, x, local, "norm")
    pre.block.outputs.append(y)

    b = _Builder("attn_main", STYLE)
    # With sequence parallelism the QKV input is kept sharded and gathered again in backward.
    yin = b.t("qkv_in", tokens * h, BF16)
    b.block.inputs.append(yin)
    kept = len(b.block.saved)
    g_qkv = b.t("qkv.g_out", tokens * (qd + 2 * kvd), BF16)
    qkv = _linear(b, yin, tokens, h, qd + 2 * kvd, "qkv", m.bias, lay=lay, after_norm=True,
                  g_out=g_qkv, parallel="column")
    _keep_input_shard(b, kept, "qkv_in_shard", local * h, lay)
    q, k, v = qkv_split(b, qkv, g_qkv, tokens, qd, kvd, heads, groups)
    if m.qk_norm:
        # ModelSpec.attention_params: 2 x head_dim weights per layer.
        q = _row_norm(b, m, q, tokens * heads, m.head_dim, "q_norm")
        k = _row_norm(b, m, k, tokens * kvd // m.head_dim, m.head_dim, "k_norm")
    if m.position == "rope" and m.yarn_factor is not None \
            and yarn_concentration(m.yarn_factor) != 1.0:
        # YaRN's mscale keeps Megatron-Core off TE's fused RoPE (GPT-OSS; gpt_oss_ops).
        q = unfused_rope(b, q, tokens * qd, s * m.head_dim, "q")
        k = unfused_rope(b, k, tokens * kvd, s * m.head_dim, "k")
    elif m.position == "rope":
        qr, kr = b.t("q_rope", tokens * qd, BF16), b.t("k_rope", tokens * kvd, BF16)
        b.fwd(Kernel("rope", "elementwise", (q, k), (qr, kr)))
        gq_, gk_ = b.t("g_q_rope", tokens * qd, BF16), b.t("g_k_rope", tokens * kvd, BF16)
        gq2, gk2 = b.t("g_q_pre", tokens * qd, BF16), b.t("g_k_pre", tokens * kvd, BF16)
        b.bwd(Kernel("rope.bwd", "elementwise", (gq_, gk_), (gq2, gk2)))
        q, k = qr, kr
    # Attention over the full sequence: with context parallelism the K/V of the other ranks
    # arrive by ring exchange (the framework adds it); the scores cover seq x seq/cp.
    kv_len = s * lay.cp
    ctx = b.t("ctx", tokens * qd, BF16)
    sink_grad: tuple[Tensor, ...] = ()
    if m.attention_sinks:
        # TE DotProductAttention's softmax_offset: one logit per local head (heads split over
        # tp); its fp32 main_grad comes out of the attention backward.
        b.block.params += heads
        sink_grad = (b.t("sink.main_grad", heads, FP32),)
        b.block.weight_grads.append(sink_grad[0])
    if lay.flash_attention:
        lse = b.t("lse", batch * heads * s, FP32)
        # Two matmuls (Q K^T and P V) of 2 x s x kv x d FLOPs per head each, causal: half of
        # the score matrix (as sdpa.fwd in sim/workload/layer_builder.py counts it); over a
        # sliding window, 4 x d per (query, key) pair of the band.
        fl = 2.0 * batch * s * kv_len * qd if window is None else \
            4.0 * batch * qd * window_pairs(s, window)
        gctx = b.t("g_ctx", tokens * qd, BF16)
        (q, k, v), gout, gcast, (f8, f8b) = fp8_attention_inputs(b, lay, (q, k, v), gctx)
        dropout = lay.dropout > 0   # drawn inside the kernel, no mask stored
        b.fwd(Kernel("flash_fwd", "attention", (q, k, v), (ctx, lse), fl,
                     attn=(batch, heads, s, m.head_dim, "fwd"), fp8=f8, fp8_block=f8b,
                     attn_kv_seq=kv_len if lay.cp > 1 else 0, attn_window=window,
                     attn_dropout=dropout))
        for kern in cp_ring_forward_kernels(k, v, ctx, lse, lay.cp):
            b.fwd(kern)
        b.save(q, k, v, ctx, lse)
        gqa = b.t("g_q", tokens * qd, BF16)
        gka, gva = b.t("g_k", tokens * kvd, BF16), b.t("g_v", tokens * kvd, BF16)
        b.bwd(*gcast, Kernel("flash_bwd", "attention", (gout, q, k, v, ctx, lse),
                     (gqa, gka, gva) + sink_grad,
                     2.5 * fl, attn=(batch, heads, s, m.head_dim, "bwd"), fp8=f8, fp8_block=f8b,
                     attn_kv_seq=kv_len if lay.cp > 1 else 0, attn_window=window,
                     attn_dropout=dropout),
              *cp_ring_backward_kernels(gqa, gka, gva, lay.cp))
    else:
        gctx = b.t("g_ctx", tokens * qd, BF16)
        gq, gk, gv = (b.t(f"g_{n}", tokens * w, BF16) for n, w in (("q", qd), ("k", kvd),
                                                                    ("v", kvd)))
        unfused_core_attention(b, (q, k, v), (gq, gk, gv), ctx, gctx, batch * heads * s,
                               kv_len, (m.head_dim, m.head_dim), lay.dropout, sink_grad)
    out = _linear(b, ctx, tokens, qd, h, "proj", m.bias, bias_in_epilogue=True, lay=lay,
                  parallel="row")
    # The row-parallel output is reduced across the tensor-parallel group (the framework's
    # all-reduce or reduce-scatter) before the fused bias-dropout-add on `local` tokens.
    resid = b.t("resid", local * h, BF16)
    y2 = _bias_dropout_add(b, out, resid, local, h, "bda", lay.dropout)
    b.block.outputs.append(y2)
    return pre.finish(), b.finish()


def mlp_block(m: ModelSpec, lay: MegatronLayout, batch: int, seq: int) -> tuple[Block, Block]:
    """(pre, main) of the MLP half of a layer."""
    t = lay.tp
    tokens = batch * (seq // lay.cp)
    local = tokens / t if lay.sequence_parallel else tokens
    _, _, _, _, f = _local(m, lay)
    h = m.hidden
    pre = _Builder("mlp_pre", STYLE)
    x = pre.t("in", local * h, BF16)
    pre.block.inputs.append(x)
    y = _norm(pre, m, x, local, "norm")
    pre.block.outputs.append(y)

    b = _Builder("mlp_main", STYLE)
    yin = b.t("fc1_in", tokens * h, BF16)
    b.block.inputs.append(yin)
    width = 2 * f if m.mlp == "swiglu" else f
    kept = len(b.block.saved)
    fc1 = _linear(b, yin, tokens, h, width, "fc1", m.bias, bias_in_epilogue=True,
                  lay=lay, after_norm=True, parallel="column")
    _keep_input_shard(b, kept, "fc1_in_shard", local * h, lay)
    act = b.t("act", tokens * f, BF16)
    # Jit-fused bias-GeLU (or bias-SwiGLU, or Nemotron's squared ReLU: megatron/core/
    # activations.py squared_relu under jit_fuser), a vectorised memory-bound kernel (not
    # eager PyTorch's slower SiLU); its input is saved for the backward.
    b.fwd(Kernel("bias_act", "elementwise", (fc1,), (act,)))
    b.save(fc1)
    ga = b.t("g_act", tokens * f, BF16)
    gi = b.t("g_fc1", tokens * width, BF16)
    b.bwd(Kernel("bias_act.bwd", "elementwise", (ga, fc1), (gi,)))
    out = _linear(b, act, tokens, f, h, "fc2", m.bias, bias_in_epilogue=True, lay=lay,
                  parallel="row")
    resid = b.t("resid", local * h, BF16)
    y2 = _bias_dropout_add(b, out, resid, local, h, "bda", lay.dropout)
    b.block.outputs.append(y2)
    return pre.finish(), b.finish()


def padded_vocab(m: ModelSpec, tp: int, divisible_by: int = 128) -> int:
    """Megatron pads the vocabulary to a multiple of 128 x tp (--make-vocab-size-divisible-by)."""
    unit = divisible_by * tp
    return -(-m.vocab // unit) * unit


def embedding_block(m: ModelSpec, lay: MegatronLayout, batch: int, seq: int) -> Block:
    """Vocab-parallel token embedding (+ learned positions, + dropout) on the first stage; its
    output is summed across the tensor-parallel group by the framework."""
    b = _Builder("embed", STYLE)
    tokens = batch * (seq // lay.cp)
    h = m.hidden
    vocab = padded_vocab(m, lay.tp) // lay.tp
    b.block.params += vocab * h
    ids = b.t("ids", tokens, IDX)
    out = b.t("out", tokens * h, BF16)
    b.fwd(Kernel("lookup", "elementwise", (ids,), (out,)))
    gout = b.t("g_out", tokens * h, BF16)
    # F.embedding's backward (embedding_dense_backward) zero-fills a dense gradient of the
    # local table in the parameter's dtype and adds the tokens' rows in; Megatron-Core's DDP
    # hook then adds it into main_grad (``param.main_grad.add_(param.grad)``: embeddings have
    # no fused accumulation) and drops it. The rows' update touches the tokens' rows only.
    gtab = b.t("w_grad", vocab * h, BF16)
    rows = b.t("w_grad.rows", tokens * h, BF16)
    main = Tensor("main_grad", vocab * h * lay.main_grad_bytes)
    b.bwd(Kernel("g_zero", "elementwise", (), (gtab,)),
          Kernel("g_index_add", "elementwise", (gout, ids), (rows,)),
          Kernel("main_grad_add", "elementwise", (main, gtab), (main,)))
    b.block.weight_grads.append(main)
    if m.position == "learned":
        b.block.params += m.max_positions * h
        out2 = b.t("out_pos", tokens * h, BF16)
        b.fwd(Kernel("add_pos", "elementwise", (out,), (out2,)))
        out = out2
    if lay.dropout > 0:
        local = tokens / lay.tp if lay.sequence_parallel else tokens
        mask = b.t("dropout.mask", local * h, MASK)
        out3 = b.t("dropout.out", local * h, BF16)
        b.fwd(Kernel("dropout", "elementwise", (out,), (out3, mask)))
        b.save(mask)
        out = out3
    b.block.outputs.append(out)
    return b.finish()


def head_block(m: ModelSpec, lay: MegatronLayout, batch: int, seq: int) -> Block:
    """Final norm, vocab-parallel output layer and vocab-parallel cross-entropy as
    ``lay.cross_entropy`` selects (:func:`sim.workload.megatron_loss.vocab_parallel_loss`)."""
    b = _Builder("head", STYLE)
    tokens = batch * (seq // lay.cp)
    local = tokens / lay.tp if lay.sequence_parallel else tokens
    h = m.hidden
    vocab = padded_vocab(m, lay.tp) // lay.tp
    x = b.t("in", local * h, BF16)
    b.block.inputs.append(x)
    y = _norm(b, m, x, local, "norm")
    yin = b.t("out_in", tokens * h, BF16) if lay.sequence_parallel else y
    impl = lay.cross_entropy
    # The loss's gradient is the tensor the output layer's backward reads (unfused and native:
    # the bf16 tensor it returns; te: the logits themselves, overwritten in place).
    g = b.t("output.g_out", tokens * vocab, BF16) if impl != "te" else None
    # The output layer is 16-bit unless fp8_output_proj; its weight gradient is accumulated
    # (or not) into main_grad as every other linear's (ColumnParallelLinear).
    logits = _linear(b, yin, tokens, h, vocab, "output", False, g_out=g,
                     grad_in_output=impl == "te",
                     lay=lay if lay.fp8_output else replace(lay, fp8=None))
    vocab_parallel_loss(b, logits, tokens, vocab, impl, g)
    if m.tied_embeddings:
        b.block.params -= vocab * h
    return b.finish()


@lru_cache(maxsize=512)
def megatron_blocks(m: ModelSpec, lay: MegatronLayout, batch: int, seq: int
                    ) -> dict[str, Block]:
    """Every block of a Megatron layer stack for one micro-batch on one TP rank."""
    if m.mla is not None:
        # Multi-head Latent Attention's own module (imported here: it builds on this one).
        from sim.workload.megatron_mla import mla_attention_block
        ap, am = mla_attention_block(m, lay, batch, seq)
    else:
        ap, am = attention_block(m, lay, batch, seq)
    mp, mm = mlp_block(m, lay, batch, seq)
    blocks = {"embed": embedding_block(m, lay, batch, seq), "attn_pre": ap, "attn_main": am,
              "mlp_pre": mp, "mlp_main": mm, "head": head_block(m, lay, batch, seq)}
    if m.sliding_window is not None and m.sliding_window < seq and m.mla is None:
        # The sliding-window layers' attention (ModelSpec.windowed; full ones keep attn_main).
        blocks[WINDOWED] = attention_block(m, lay, batch, seq, m.sliding_window)[1]
    return blocks


WINDOWED = "attn_main_window"
"""The block key of a sliding-window layer's attention (:func:`attention_key`)."""


def attention_key(m: ModelSpec, layer: int, blocks: dict[str, Block]) -> str:
    """The block that prices layer ``layer``'s attention: :data:`WINDOWED` for a layer over
    the sliding window (:meth:`ModelSpec.windowed`) when the window is shorter than the
    sequence, ``attn_main`` otherwise."""
    return WINDOWED if WINDOWED in blocks and m.windowed(layer) else "attn_main"
