"""Multi-head Latent Attention as torchtitan's DeepSeek-V3 model issues it, op by op.

torchtitan ``models/deepseek_v3/model/model.py`` ``Attention.forward`` (pytorch/torchtitan,
2026; DeepSeek-V2 arXiv:2405.04434 section 2.1 for the algorithm):

* queries: ``wq`` (hidden -> heads x (nope + rope)) without a query latent
  (``q_lora_rank`` 0, DeepSeek-V2-Lite), else ``wq_a`` (hidden -> q_lora_rank), ``q_norm``
  (``nn.RMSNorm``) and ``wq_b`` (q_lora_rank -> heads x (nope + rope)); ``torch.split`` into
  the part without positions and the rotary part (views);
* ``apply_rotary_emb`` on the rotary part: ``x.float()``, the complex product with
  ``freqs_cis``, ``.to(dtype)`` (the torchtitan branch of :meth:`_Builder.rope`), then
  ``torch.cat([q_nope, q_pe])``: a copy of every query;
* keys and values: ``wkv_a`` (hidden -> kv_lora_rank + rope), split into the latent and the
  one rotary key all heads share (views), RoPE on the shared key, ``kv_norm`` on the latent,
  ``wkv_b`` (kv_lora_rank -> heads x (nope + v)), split into keys without positions and the
  values (views), ``torch.cat([k_nope, k_pe.expand(heads)])``: a copy of every key;
* core attention: ``ScaledDotProductAttentionWrapper``, whose backend list puts cuDNN first;
  PyTorch's flash kernels need one head dim for q, k and v (``sdp_utils``
  ``check_head_dim_size_flash``), cuDNN's fused attention runs qk 192 / v 128, priced at the
  widths of :func:`~sim.workload.megatron_mla.attention_head_dims` (the backend is the
  scenario's, which :func:`sim.hardware.attention_cost.resolve` makes cuDNN for MLA);
* ``wo`` (heads x v -> hidden) and the residual add.

``attn_type`` "sdpa" is what this prices, as torchtitan's first DeepSeek-V3 model (2025) ran
it. Its current flavors ("16B", "236B", "671B" in ``models/deepseek_v3/__init__.py``) set
``attn_type="flex"`` (FlexAttention, compiled, with a block-causal mask over packed
documents); FlexAttention is not modelled yet, and such a run is priced here as SDPA.

Backward, as autograd runs it: the two cats' gradients are views (``CatBackward``), the shared
key's expansion sums its gradient over the heads (``ExpandBackward``), and each ``split``
concatenates its parts' gradients again (``SplitBackward``): a copy each. The parts are
functions of their own (:func:`mla_query_latent`, :func:`mla_query_heads`,
:func:`mla_kv_latent`, :func:`mla_attention_heads`) so that tensor parallelism
(:mod:`sim.frameworks.fsdp2.tp`) can run the latents whole and the heads split; context
parallelism is not modelled with MLA (refused for every framework).
"""

from __future__ import annotations

from sim.workload.kernels import BF16, FP32, Block, Kernel, Style, Tensor
from sim.workload.layer_builder import _Builder
from sim.workload.layer_ops import residual_norm_input
from sim.workload.megatron_mla import attention_head_dims
from sim.workload.model import ModelSpec


def _split(b: _Builder, x: Tensor, tokens: float, widths: tuple[int, int],
           name: str) -> tuple[Tensor, Tensor]:
    """``torch.split`` of ``x`` into two views; its backward concatenates the two parts'
    gradients into ``x``'s (one copy)."""
    parts = (b.t(f"{name}.a", tokens * widths[0], BF16), b.t(f"{name}.b", tokens * widths[1],
                                                              BF16))
    grads = (b.t(f"{name}.g_a", tokens * widths[0], BF16),
             b.t(f"{name}.g_b", tokens * widths[1], BF16))
    gx = b.t(f"{name}.g_in", tokens * sum(widths), BF16)
    b.bwd(Kernel(f"{name}.bwd_cat", "elementwise", grads, (gx,)))
    for p, g in zip(parts, grads, strict=True):
        b.reads_grad(p, g)
    b.writes_grad(x, gx)
    return parts


def _cat(b: _Builder, parts: tuple[Tensor, Tensor], numels: tuple[float, float],
         name: str) -> Tensor:
    """``torch.cat`` of two tensors (one copy); its backward hands each input a view of the
    output's gradient (no kernel)."""
    out = b.t(f"{name}.out", sum(numels), BF16)
    b.fwd(Kernel(name, "elementwise", parts, (out,)))
    g = b.t(f"{name}.g_out", sum(numels), BF16)
    b.reads_grad(out, g)
    for i, (p, n) in enumerate(zip(parts, numels, strict=True)):
        b.writes_grad(p, b.t(f"{name}.g_view{i}", n, BF16))
    return out


def mla_query_latent(b: _Builder, m: ModelSpec, y: Tensor, tokens: float) -> Tensor:
    """``wq_a`` and ``q_norm`` on the normalised tokens ``y``: the query latent."""
    mla = m.mla
    assert mla is not None and mla.q_lora_rank
    qa = b.linear(y, tokens, m.hidden, mla.q_lora_rank, "wq_a", bias=m.bias)
    return b.rmsnorm(qa, tokens, mla.q_lora_rank, "q_norm")


def mla_query_heads(b: _Builder, m: ModelSpec, q_in: Tensor, q_in_dim: int, tokens: float,
                    heads: int) -> Tensor:
    """The queries of ``heads`` heads from ``q_in`` (``wq_b`` from the query latent, or
    ``wq`` from the normalised input), split, RoPE on the rotary part, and the copy that
    joins them again."""
    mla = m.mla
    assert mla is not None
    qk, rope, nope = mla.qk_head_dim, mla.qk_rope_head_dim, mla.qk_nope_head_dim
    q = b.linear(q_in, tokens, q_in_dim, heads * qk, "wq_b" if mla.q_lora_rank else "wq",
                 bias=m.bias)
    q_nope, q_pe = _split(b, q, tokens * heads, (nope, rope), "q_split")
    q_pe = b.rope(q_pe, tokens, heads * rope, "rope_q")
    return _cat(b, (q_nope, q_pe), (tokens * heads * nope, tokens * heads * rope), "q_cat")


def mla_kv_latent(b: _Builder, m: ModelSpec, y: Tensor, tokens: float) -> tuple[Tensor, Tensor]:
    """``wkv_a`` on the normalised tokens, split into the key/value latent and the rotary
    key all heads share; RoPE on that key, ``kv_norm`` on the latent."""
    mla = m.mla
    assert mla is not None
    rope = mla.qk_rope_head_dim
    kv_a = b.linear(y, tokens, m.hidden, mla.kv_lora_rank + rope, "wkv_a", bias=m.bias)
    latent, k_pe = _split(b, kv_a, tokens, (mla.kv_lora_rank, rope), "kv_a_split")
    k_pe = b.rope(k_pe, tokens, rope, "rope_k")
    latent = b.rmsnorm(latent, tokens, mla.kv_lora_rank, "kv_norm")
    return latent, k_pe


def mla_attention_heads(b: _Builder, m: ModelSpec, query: Tensor, latent: Tensor, k_pe: Tensor,
                        batch: int, seq: int, heads: int) -> Tensor:
    """``wkv_b`` from the latent, the shared rotary key expanded over ``heads`` heads and
    the key copy, causal attention of ``query``, and ``wo``: returns ``wo``'s output."""
    mla = m.mla
    assert mla is not None
    tokens = batch * seq
    qk, rope, nope, vd = (mla.qk_head_dim, mla.qk_rope_head_dim, mla.qk_nope_head_dim,
                          mla.v_head_dim)
    kv = b.linear(latent, tokens, mla.kv_lora_rank, heads * (nope + vd), "wkv_b", bias=m.bias)
    k_nope, value = _split(b, kv, tokens * heads, (nope, vd), "kv_split")
    # k_pe.expand(-1, -1, heads, -1): a view forward; its backward sums over the heads.
    k_pe_all = b.t("k_pe_expand", tokens * heads * rope, BF16)
    g_all = b.t("k_pe_expand.g_out", tokens * heads * rope, BF16)
    g_pe = b.t("k_pe_expand.g_in", tokens * rope, BF16)
    b.bwd(Kernel("k_pe_expand.bwd_sum", "elementwise", (g_all,), (g_pe,)))
    b.reads_grad(k_pe_all, g_all)
    b.writes_grad(k_pe, g_pe)
    key = _cat(b, (k_nope, k_pe_all), (tokens * heads * nope, tokens * heads * rope), "k_cat")

    ctx = b.t("sdpa.out", tokens * heads * vd, BF16)
    lse = b.t("sdpa.lse", batch * heads * seq, FP32)
    # Causal: QK^T 2 x qk and PV 2 x v FLOPs per key and head over seq/2 keys a query.
    fl = 2.0 * batch * seq * (seq / 2) * heads * (qk + vd)
    hd_fwd, hd_bwd = (round(w) for w in attention_head_dims(qk, vd))
    b.fwd(Kernel("sdpa.fwd", "attention", (query, key, value), (ctx, lse), fl,
                 attn=(batch, heads, seq, hd_fwd, "fwd")))
    b.save(query, key, value, ctx, lse)
    go = b.t("sdpa.g_out", tokens * heads * vd, BF16)
    gq = b.t("sdpa.g_q", tokens * heads * qk, BF16)
    gk = b.t("sdpa.g_k", tokens * heads * qk, BF16)
    gv = b.t("sdpa.g_v", tokens * heads * vd, BF16)
    b.bwd(Kernel("sdpa.bwd", "attention", (go, query, key, value, ctx, lse), (gq, gk, gv),
                 2.5 * fl * hd_bwd / hd_fwd, attn=(batch, heads, seq, hd_bwd, "bwd")))
    b.reads_grad(ctx, go)
    b.writes_grad(query, gq)
    b.writes_grad(key, gk)
    b.writes_grad(value, gv)
    return b.linear(ctx, tokens, heads * vd, m.hidden, "wo", bias=m.bias)


def titan_mla_attention_block(m: ModelSpec, style: Style, batch: int, seq: int) -> Block:
    """Norm, MLA's projections, latent norms, RoPE, the query and key copies, causal
    attention, output projection, residual: one micro-batch on one GPU.

    Examples
    --------
    >>> from sim.workload.kernels import Style
    >>> m = ModelSpec.from_ref("deepseek-v3")
    >>> blk = titan_mla_attention_block(m, Style("bf16"), 1, 4096)
    >>> blk.params == m.attention_params + m.norm_params
    True
    """
    mla = m.mla
    assert mla is not None
    b = _Builder("attn", style)
    tokens = batch * seq
    h = m.hidden
    x, y = residual_norm_input(b, m, tokens)
    # wq (or wq_a) and wkv_a both read the normalised input.
    b.sum_grads(2, tokens * h, FP32 if style.autocast else BF16, "norm_out", of=y)
    if mla.q_lora_rank:
        query = mla_query_heads(b, m, mla_query_latent(b, m, y, tokens), mla.q_lora_rank,
                                tokens, m.heads)
    else:
        query = mla_query_heads(b, m, y, h, tokens, m.heads)
    latent, k_pe = mla_kv_latent(b, m, y, tokens)
    out = mla_attention_heads(b, m, query, latent, k_pe, batch, seq, m.heads)
    res = b.residual_add(x, out, tokens, h, "resid")
    b.block.outputs.append(res)
    return b.finish()
