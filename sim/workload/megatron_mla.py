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
  v_head_dim wide);
* ``linear_proj`` (heads x v_head_dim -> hidden, row-parallel).

This first cut runs one tensor-parallel rank (``tp`` 1, the layouts NeMo's DeepSeek-V2-Lite
recipe uses); with tensor and sequence parallelism Megatron gathers the latents rather than
the hidden state, which the unit builder does not lay out yet.
"""

from __future__ import annotations

from sim.workload.layer_ops import BF16, FP32, Block, Kernel, _Builder
from sim.workload.megatron_ops import (
    STYLE,
    MegatronLayout,
    _bias_dropout_add,
    _linear,
    _norm,
    _row_norm,
)
from sim.workload.model import ModelSpec


def mla_attention_block(m: ModelSpec, lay: MegatronLayout, batch: int, seq: int
                        ) -> tuple[Block, Block]:
    """(pre, main) of an MLA attention half on one rank (``lay.tp`` = ``lay.cp`` = 1)."""
    mla = m.mla
    assert mla is not None and lay.tp == 1 and lay.cp == 1
    tokens = batch * seq
    h, heads = m.hidden, m.heads
    qk, rope, nope, vd = mla.qk_head_dim, mla.qk_rope_head_dim, mla.qk_nope_head_dim, \
        mla.v_head_dim
    pre = _Builder("attn_pre", STYLE)
    x = pre.t("in", tokens * h, BF16)
    pre.block.inputs.append(x)
    pre.block.outputs.append(_norm(pre, m, x, tokens, "norm"))

    b = _Builder("attn_main", STYLE)
    yin = b.t("qkv_in", tokens * h, BF16)
    b.block.inputs.append(yin)
    if mla.q_lora_rank:
        qc = _linear(b, yin, tokens, h, mla.q_lora_rank, "q_down", m.bias, lay=lay)
        qc = _row_norm(b, m, qc, tokens, mla.q_lora_rank, "q_latent_norm")
        q = _linear(b, qc, tokens, mla.q_lora_rank, heads * qk, "q_up", m.bias, lay=lay)
    else:
        q = _linear(b, yin, tokens, h, heads * qk, "q_proj", m.bias, lay=lay)
    kvc = _linear(b, yin, tokens, h, mla.kv_lora_rank + rope, "kv_down", m.bias, lay=lay)
    latent = b.t("kv_latent", tokens * mla.kv_lora_rank, BF16)
    k_pos = b.t("k_pos", tokens * rope, BF16)
    b.fwd(Kernel("split_kv_latent", "tiny", (kvc,), (latent, k_pos)))
    latent = _row_norm(b, m, latent, tokens, mla.kv_lora_rank, "kv_latent_norm")
    kv = _linear(b, latent, tokens, mla.kv_lora_rank, heads * (nope + vd), "kv_up", m.bias,
                 lay=lay)
    # Rotary embedding on the query's rope part and the shared rotary key (views of q and
    # kv_combined), then the contiguous query and key TE's attention takes.
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
    ctx = b.t("ctx", tokens * heads * vd, BF16)
    lse = b.t("lse", batch * heads * seq, FP32)
    # Causal: each query sees seq/2 keys on average; QK^T is 2 x qk and PV 2 x v FLOPs per
    # key and head (the FLOPs of ModelSpec._attention_layer_flops). The time model takes
    # one head width: the mean of the two, which gives the same FLOPs.
    fl = 2.0 * batch * seq * (seq / 2) * heads * (qk + vd)
    hd = (qk + vd) // 2
    b.fwd(Kernel("flash_fwd", "attention", (query, key, value), (ctx, lse), fl,
                 attn=(batch, heads, seq, hd, "fwd")))
    b.save(query, key, value, ctx, lse)
    gctx = b.t("g_ctx", tokens * heads * vd, BF16)
    b.bwd(Kernel("flash_bwd", "attention", (gctx, query, key, value, ctx, lse), (gq, gk, gv),
                 2.5 * fl, attn=(batch, heads, seq, hd, "bwd")))
    out = _linear(b, ctx, tokens, heads * vd, h, "proj", m.bias, bias_in_epilogue=True,
                  lay=lay)
    resid = b.t("resid", tokens * h, BF16)
    b.block.outputs.append(_bias_dropout_add(b, out, resid, tokens, h, "bda", lay.dropout))
    return pre.finish(), b.finish()
