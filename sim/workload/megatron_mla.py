"""Multi-head Latent Attention's kernels in a Megatron-Core layer (DeepSeek-V2/V3).

Megatron-Core's ``MLASelfAttention`` (megatron/core/transformer/multi_latent_attention.py)
replaces the fused QKV projection of :func:`sim.workload.megatron_ops.attention_block`:

* queries: ``linear_q_proj`` (hidden -> heads x (nope + rope), column-parallel) without a
  query latent (``q_lora_rank`` None, DeepSeek-V2-Lite), else ``linear_q_down_proj``
  (hidden -> q_lora_rank, duplicated on every tensor-parallel rank), ``q_layernorm`` (RMSNorm
  over q_lora_rank) and ``linear_q_up_proj`` (q_lora_rank -> heads x (nope + rope),
  column-parallel);
* keys and values: ``linear_kv_down_proj`` (hidden -> kv_lora_rank + rope, duplicated),
  split into the latent and the one rotary key all heads share, ``kv_layernorm`` (RMSNorm over
  kv_lora_rank), ``linear_kv_up_proj`` (kv_lora_rank -> heads x (nope + v), column-parallel),
  split into the keys without positions and the values;
* rotary embedding on the query's rope part and the shared key, then the query
  ``cat(q_nope, q_rope)`` and the key ``cat(k_nope, k_rope expanded to every head)``, made
  contiguous for Transformer Engine's attention (queries and keys nope + rope wide, values
  v_head_dim wide); with ``apply_rope_fusion`` (Megatron-Bridge's performance scripts) two
  fused Triton kernels instead, the query rotated in place (:func:`_fused_rope`);
* core attention: Transformer Engine's ``DotProductAttention`` with query/key head dim
  nope + rope and value head dim v_head_dim (192 / 128 for DeepSeek-V3: core_v0.14.0 passes
  the value unpadded; later releases pad it to 192 only for packed THD sequences,
  ``_prepare_mla_core_attention_value``, not these [s, b, h, d] inputs). Transformer
  Engine runs it as cuDNN's fused attention: ``get_attention_backend`` (TE v2.7
  ``dot_product_attention/utils.py``) disables FlashAttention 2 and 3 whenever
  head_dim_qk != head_dim_v and keeps FusedAttention for separate q, k, v layouts
  (``hd_hd_hd``), the scenario's ``cudnn`` backend on Hopper and Blackwell; priced at the
  widths of :func:`attention_head_dims`. Where cuDNN cannot train these widths (Blackwell
  under TE 2.4 or older, or cuDNN before 9.11: :mod:`sim.hardware.te_fused_attention`) TE
  runs ``UnfusedDotProductAttention`` (:func:`~sim.workload.megatron_ops.
  unfused_core_attention`: the full 192-wide score matrix, softmax, 128-wide P V);
* ``linear_proj`` (heads x v_head_dim -> hidden, row-parallel).

With tensor parallelism the heads split over the ranks (the column-parallel up projections
and q projection, the row-parallel output projection) while the down projections are
duplicated: with sequence parallelism each rank runs them, and the latent norms, on its own
sequence shard, and the column-parallel linears gather what they consume: the hidden state
(``linear_q_proj``), the query latent (``linear_q_up_proj``), the key/value latent
(``linear_kv_up_proj``) and the shared rotary key (``gather_from_sequence_parallel_region``).
:func:`mla_gather_width` is that width per token; the unit builder gathers it (and
reduce-scatters its gradient) where it gathers a dense layer's hidden state. The duplicated
weights' gradients are all-reduced over the tensor-parallel group once per step
(``finalize_model_grads``, like the sequence-parallel norms': :mod:`sim.frameworks.megatron.
tp_grads`). With ``recompute_modules`` ``mla_up_proj`` the up projections run inside a
``CheckpointWithoutOutput`` whose own costs are :func:`mla_up_checkpoint_calls` and
:func:`mla_up_restore` (end of this module). Context
parallelism is not modelled with MLA.
"""

from __future__ import annotations

from sim.workload.checkpoint_without_output import checkpoint_calls, restore_copy
from sim.workload.layer_ops import BF16, FP32, Block, Kernel, Tensor, _Builder
from sim.workload.layer_rules import FP8
from sim.workload.megatron_host_ops import MLA_ROPE_FUSION_SAVED_OPS
from sim.workload.megatron_ops import (
    STYLE,
    MegatronLayout,
    _bias_dropout_add,
    _linear,
    _norm,
    _row_norm,
    unfused_core_attention,
)
from sim.workload.model import ModelSpec
from sim.workload.moe import MLASpec
from sim.workload.te_attention import fp8_attention_inputs


def mla_gather_width(m: ModelSpec) -> int:
    """Per-token width the attention's column-parallel linears gather under sequence
    parallelism: the hidden state for the q projection without a query latent, else the
    query latent, plus the key/value latent and the shared rotary key."""
    mla = m.mla
    assert mla is not None
    q = mla.q_lora_rank or m.hidden
    return q + mla.kv_lora_rank + mla.qk_rope_head_dim


def mla_attention_block(m: ModelSpec, lay: MegatronLayout, batch: int, seq: int
                        ) -> tuple[Block, Block]:
    """(pre, main) of an MLA attention half on one tensor-parallel rank (``lay.cp`` = 1)."""
    mla = m.mla
    assert mla is not None and lay.cp == 1
    t = lay.tp
    tokens = batch * seq
    local = tokens / t if lay.sequence_parallel else tokens
    h, heads = m.hidden, m.heads // t
    qk, rope, nope, vd = mla.qk_head_dim, mla.qk_rope_head_dim, mla.qk_nope_head_dim, \
        mla.v_head_dim
    act = FP8 if lay.fp8 else BF16
    pre = _Builder("attn_pre", STYLE)
    x = pre.t("in", local * h, BF16)
    pre.block.inputs.append(x)
    pre.block.outputs.append(_norm(pre, m, x, local, "norm"))

    b = _Builder("attn_main", STYLE)
    yin = b.t("qkv_in", local * h, BF16)
    b.block.inputs.append(yin)
    # With sequence parallelism a column-parallel linear keeps its input's shard (1 byte per
    # element in FP8) and gathers it again in backward: what it saved becomes the shard.
    if mla.q_lora_rank:
        qc = _linear(b, yin, local, h, mla.q_lora_rank, "q_down", m.bias, lay=lay)
        qc = _row_norm(b, m, qc, local, mla.q_lora_rank, "q_latent_norm")
        q = _sharded_input_linear(b, qc, tokens, local, mla.q_lora_rank, heads * qk, "q_up",
                                  m, lay, act)
    else:
        q = _sharded_input_linear(b, yin, tokens, local, h, heads * qk, "q_proj", m, lay, act)
    kvc = _linear(b, yin, local, h, mla.kv_lora_rank + rope, "kv_down", m.bias, lay=lay)
    latent = b.t("kv_latent", local * mla.kv_lora_rank, BF16)
    k_pos = b.t("k_pos", local * rope, BF16)
    b.fwd(Kernel("split_kv_latent", "tiny", (kvc,), (latent, k_pos)))
    if local != tokens:
        k_pos = b.t("k_pos_gathered", tokens * rope, BF16)     # the shared key, gathered
    latent = _row_norm(b, m, latent, local, mla.kv_lora_rank, "kv_latent_norm")
    kv = _sharded_input_linear(b, latent, tokens, local, mla.kv_lora_rank, heads * (nope + vd),
                               "kv_up", m, lay, act)
    assemble = _fused_rope if lay.rope_fusion else _unfused_rope
    query, key, value, gq, gk, gv = assemble(b, q, kv, k_pos, tokens, heads, mla)
    ctx = b.t("ctx", tokens * heads * vd, BF16)
    if lay.flash_attention:
        _flash_core(b, (query, key, value), (gq, gk, gv), ctx, lay, batch, seq, heads, qk, vd)
    else:
        # Transformer Engine with no fused kernel for these head dims (Blackwell before TE
        # 2.5 / cuDNN 9.11: sim.hardware.te_fused_attention) runs UnfusedDotProductAttention.
        unfused_core_attention(b, (query, key, value), (gq, gk, gv), ctx,
                               b.t("g_ctx", tokens * heads * vd, BF16), batch * heads * seq,
                               seq, (qk, vd), lay.dropout)
    out = _linear(b, ctx, tokens, heads * vd, h, "proj", m.bias, bias_in_epilogue=True,
                  lay=lay)
    # Reduced over the tensor-parallel group (all-reduce or reduce-scatter) before the
    # bias-dropout-add on the local tokens, as in the dense layer.
    resid = b.t("resid", local * h, BF16)
    b.block.outputs.append(_bias_dropout_add(b, out, resid, local, h, "bda", lay.dropout))
    return pre.finish(), b.finish()


def _flash_core(b: _Builder, qkv: tuple[Tensor, Tensor, Tensor],
                grads: tuple[Tensor, Tensor, Tensor], ctx: Tensor, lay: MegatronLayout,
                batch: int, seq: int, heads: int, qk: int, vd: int) -> None:
    """Core attention as one fused kernel each way (cuDNN's, TE's FusedAttention)."""
    query, key, value = qkv
    gq, gk, gv = grads
    tokens = batch * seq
    lse = b.t("lse", batch * heads * seq, FP32)
    # Causal: each query sees seq/2 keys on average; QK^T is 2 x qk and PV 2 x v FLOPs per
    # key and head (the FLOPs of ModelSpec._attention_layer_flops). The time model takes
    # one head width per pass (4 x width FLOPs a score forward, 10 x width backward):
    # :func:`attention_head_dims` gives the widths whose matmul FLOPs are the kernels' own.
    fl = 2.0 * batch * seq * (seq / 2) * heads * (qk + vd)
    # (The kernel record takes a whole width: 166.4 rounds to 166, 0.2% of the backward.)
    hd_fwd, hd_bwd = (round(w) for w in attention_head_dims(qk, vd))
    gctx = b.t("g_ctx", tokens * heads * vd, BF16)
    (query, key, value), gout, gcast, (f8, f8b) = fp8_attention_inputs(
        b, lay, (query, key, value), gctx)
    b.fwd(Kernel("flash_fwd", "attention", (query, key, value), (ctx, lse), fl,
                 attn=(batch, heads, seq, hd_fwd, "fwd"), fp8=f8, fp8_block=f8b))
    b.save(query, key, value, ctx, lse)
    b.bwd(*gcast, Kernel("flash_bwd", "attention", (gout, query, key, value, ctx, lse),
                         (gq, gk, gv), 2.5 * fl * hd_bwd / hd_fwd,
                         attn=(batch, heads, seq, hd_bwd, "bwd"), fp8=f8, fp8_block=f8b))


def _sharded_input_linear(b: _Builder, x: Tensor, tokens: float, local: float, n_in: int,
                          n_out: int, name: str, m: ModelSpec, lay: MegatronLayout,
                          act: int) -> Tensor:
    """A column-parallel linear over the gathered ``tokens`` whose input arrives as a
    ``local`` shard: under sequence parallelism it saves the shard only (re-gathered in
    backward)."""
    xin = b.t(f"{name}.in", tokens * n_in, BF16) if local != tokens else x
    kept = len(b.block.saved)
    y = _linear(b, xin, tokens, n_in, n_out, name, m.bias, lay=lay)
    if local != tokens:
        del b.block.saved[kept:]
        b.save(b.t(f"{name}.in_shard", local * n_in, act))
    return y


def attention_head_dims(qk: int, v: int) -> tuple[float, float]:
    """(forward, backward) head widths at which the attention time model's per-score matmul
    FLOPs (4 x width forward, 10 x width backward) equal a fused kernel's with query/key
    head dim ``qk`` and value head dim ``v``.

    Forward: S = Q K^T (2 qk a score) and O = P V (2 v): 2 (qk + v) = 4 x (qk + v) / 2.
    Backward (FlashAttention-2's algorithm, Dao 2023 arXiv 2307.08691 Algorithm 2, which
    cuDNN's and FlashAttention-3's kernels follow): S = Q K^T recomputed, dP = dO V^T,
    dV = P^T dO, dQ = dS K, dK = dS^T Q: three products over qk and two over v,
    2 (3 qk + 2 v) = 10 x (3 qk + 2 v) / 5. With qk = v both are the head dim and backward is
    2.5 x forward; DeepSeek-V3's 192 / 128 gives 160 and 166.4 (2.6 x).

    Examples
    --------
    >>> attention_head_dims(128, 128)
    (128.0, 128.0)
    >>> attention_head_dims(192, 128)
    (160.0, 166.4)
    """
    return (qk + v) / 2, (3 * qk + 2 * v) / 5


def _unfused_rope(b: _Builder, q: Tensor, kv: Tensor, k_pos: Tensor, tokens: float,
                  heads: int, mla: MLASpec) -> tuple[Tensor, ...]:
    """``apply_rope_fusion`` off (``qkv_up_proj_and_rope_apply``): ``apply_rotary_pos_emb``
    on the query's rope part and the shared rotary key (views of q and kv_combined), the
    query ``cat(q_nope, q_rope)``, the key ``cat(k_nope, k_rope expanded to every head)`` and
    the value made contiguous for Transformer Engine's attention. Returns (query, key, value)
    and the attention's (dq, dk, dv)."""
    qk, rope, nope, vd = mla.qk_head_dim, mla.qk_rope_head_dim, mla.qk_nope_head_dim, \
        mla.v_head_dim
    q_rope = b.t("q_rope", tokens * heads * rope, BF16)
    k_rope = b.t("k_rope", tokens * rope, BF16)
    b.fwd(Kernel("rope", "elementwise", (q, k_pos), (q_rope, k_rope)))
    b.bwd(Kernel("rope.bwd", "elementwise", (b.t("g_q_rope", tokens * heads * rope, BF16),
                                             b.t("g_k_rope", tokens * rope, BF16)),
                 (b.t("g_q_pos", tokens * heads * rope, BF16),
                  b.t("g_k_pos", tokens * rope, BF16))))
    query = b.t("query", tokens * heads * qk, BF16)
    key = b.t("key", tokens * heads * qk, BF16)
    value = b.t("value", tokens * heads * vd, BF16)
    b.fwd(Kernel("cat_query", "elementwise", (q, q_rope), (query,)))
    b.fwd(Kernel("cat_key", "elementwise", (kv, k_rope), (key,)))
    b.fwd(Kernel("value_contiguous", "elementwise", (kv,), (value,)))
    # Backward of the concatenations: the gradients sliced back into q and kv, and the shared
    # rotary key's gradient summed over the heads.
    gq, gk, gv = (b.t(f"g_{n}", tokens * heads * w, BF16)
                  for n, w in (("query", qk), ("key", qk), ("value", vd)))
    b.bwd(Kernel("cat.bwd", "elementwise", (gq, gk, gv),
                 (b.t("g_q", tokens * heads * qk, BF16),
                  b.t("g_kv", tokens * heads * (nope + vd), BF16),
                  b.t("g_k_rope_sum", tokens * rope, BF16))))
    return query, key, value, gq, gk, gv


def _fused_rope(b: _Builder, q: Tensor, kv: Tensor, k_pos: Tensor, tokens: float,
                heads: int, mla: MLASpec) -> tuple[Tensor, ...]:
    """``apply_rope_fusion`` on: Megatron-Core's Triton kernels
    (megatron/core/fusions/fused_mla_yarn_rope_apply.py). ``fused_apply_mla_rope_for_q``
    rotates the rope part of q in place (``rotary_fwd_q_kernel`` loads and stores only those
    ``qk_rope_head_dim`` columns of each head), so the query is q itself; its backward rotates
    the same columns of dq in place. ``fused_apply_mla_rope_for_kv`` reads kv and the shared
    rotary key and writes the key (nope columns copied, rope columns rotated per head) and
    the value as new tensors; its backward copies dk's nope columns and dv into one dkv and
    sums dk's rope columns over the heads into the rotary key's gradient. Returns (query,
    key, value) and the attention's (dq, dk, dv)."""
    qk, rope, nope, vd = mla.qk_head_dim, mla.qk_rope_head_dim, mla.qk_nope_head_dim, \
        mla.v_head_dim
    # In place: the kernel reads the columns before it writes them (a tensor read before
    # its first write exists already, so nothing is allocated).
    q_pe = b.t("q_pe", tokens * heads * rope, BF16)
    b.fwd(Kernel("rope.q", "elementwise", (q_pe,), (q_pe,)))
    key = b.t("key", tokens * heads * qk, BF16)
    value = b.t("value", tokens * heads * vd, BF16)
    b.fwd(Kernel("rope.kv", "elementwise", (kv, k_pos), (key, value)))
    gq, gk, gv = (b.t(f"g_{n}", tokens * heads * w, BF16)
                  for n, w in (("query", qk), ("key", qk), ("value", vd)))
    g_pe = b.t("g_q_pe", tokens * heads * rope, BF16)
    b.bwd(Kernel("rope.q.bwd", "elementwise", (g_pe,), (g_pe,)))
    b.bwd(Kernel("rope.kv.bwd", "elementwise", (gk, gv),
                 (b.t("g_kv", tokens * heads * (nope + vd), BF16),
                  b.t("g_k_pos", tokens * rope, BF16))))
    return q, key, value, gq, gk, gv


# ------------------------------------------------ recompute_modules: mla_up_proj
# Megatron-Core core_v0.14.0 wraps ``qkv_up_proj_and_rope_apply`` in a
# ``tensor_parallel.CheckpointWithoutOutput`` (multi_latent_attention.py L781-785) and, once
# core attention has run, frees the query, key and value storages
# (``discard_output_and_register_recompute``, L313-316). What any such checkpoint costs beyond
# the kernels it re-runs is :mod:`sim.workload.checkpoint_without_output`'s rule; MLA's
# function has four tensor inputs and three outputs, is built with ``fp8=config.fp8`` (TE's
# recompute contexts under FP8 only), and its re-run makes, besides its two TE module calls,
# the two identity latent norms (the norms are fused into the up projections' TE modules),
# two views, ``unsqueeze``, the context-parallel rank and size, the two fused rotary
# applications and three ``contiguous`` (12; unfused rotary embedding: the five more calls
# :data:`sim.workload.megatron_host_ops.MLA_ROPE_FUSION_SAVED_OPS` counts).
MLA_UP_CKPT_IO = (4, 3)
"""Tensor inputs and outputs of ``qkv_up_proj_and_rope_apply``."""
MLA_UP_CKPT_RERUN = 12
"""Plain calls of its re-run with fused rotary embedding."""
MLA_UP_CKPT_MODULES = 2
"""The up projections' TE module calls the backward re-runs (forward calls, full price)."""
MLA_UP_OUTPUTS = ("query", "key", "value", "q_up.out", "q_proj.out")
"""Names (block prefix dropped) of the checkpoint's outputs among what the attention block
saves: the query, key and value core attention reads (with ``apply_rope_fusion`` the query
is the q projection's output, rotated in place)."""


def mla_up_restore(main: Block) -> Kernel:
    """The recompute's copy of the recomputed query, key and value into the storages the
    forward freed (:func:`~sim.workload.checkpoint_without_output.restore_copy`): both
    copies are live through the attention's backward. Under FP8 attention the block saves
    FP8 copies (``query_fp8``, ...); the checkpoint still restores the 16-bit tensors it
    freed (their block scales left out)."""
    outs = []
    for t in main.saved:
        stem = t.name.split(".", 1)[-1]
        if stem in MLA_UP_OUTPUTS:
            outs.append(t)
        elif stem.endswith("_fp8") and stem[:-4] in MLA_UP_OUTPUTS:
            outs.append(Tensor(t.name[:-4], t.nbytes * BF16 / FP8))
    return restore_copy("up_proj.restore", outs)


def mla_up_checkpoint_calls(fp8: bool, rope_fusion: bool) -> tuple[int, int]:
    """(forward, backward) plain torch calls of the ``mla_up_proj`` checkpoint beyond the
    function's own forward calls (the backward's include its re-run, less its two module
    calls: :data:`MLA_UP_CKPT_MODULES`).

    Examples
    --------
    >>> mla_up_checkpoint_calls(fp8=False, rope_fusion=True)
    (15, 38)
    >>> mla_up_checkpoint_calls(fp8=True, rope_fusion=False)
    (18, 45)
    """
    rerun = MLA_UP_CKPT_RERUN + (0 if rope_fusion else MLA_ROPE_FUSION_SAVED_OPS)
    return checkpoint_calls(*MLA_UP_CKPT_IO, rerun, te_contexts=fp8)
