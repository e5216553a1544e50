"""torchtitan's tensor parallelism (and context parallelism's attention segments): the
segments of every block of one micro-batch on one rank, priced.

* Tensor parallelism (``torchtitan/models/llama3/infra/parallelize.py``, ``apply_tp``; the same
  plan as ``models/llama3/sharding.py`` with ``enable_sequence_parallel`` on, torchtitan's
  default): the norms are ``SequenceParallel`` (each rank normalises its 1/tp of the tokens),
  ``PrepareModuleInput`` all-gathers the normalised input before attention and before the MLP
  (Shard(1) -> Replicate), ``wq/wk/wv`` and ``w1/w3`` are colwise, ``wo`` and ``w2`` rowwise
  with Shard(1) output, i.e. a reduce-scatter; the residual add runs on the local tokens.
  Backward mirrors it: the reduce-scatter's gradient is an all-gather, the all-gather's a
  reduce-scatter. DeepSeek-V3's Multi-head Latent Attention
  (``models/deepseek_v3/infra/parallelize.py``, ``apply_non_moe_tp``) keeps ``wq_a``,
  ``q_norm``, ``wkv_a`` and ``kv_norm`` whole on every rank (``NoParallel``: the ``attn_latent``
  segment) and splits ``wq_b`` / ``wkv_b`` colwise and ``wo`` rowwise (``attn_heads``); in
  backward the latents' partial gradients are all-reduced, and the input's gradient, the same on
  every rank, needs no reduce-scatter. The embedding is rowwise (vocabulary-sharded table,
  masked lookup, reduce-scatter of the partial output); the final norm is sequence-parallel and
  the output projection colwise with loss parallelism (all-gather of its input,
  vocabulary-sharded logits, cross-entropy with small all-reduces of per-token statistics).
  DTensor issues each collective as a functional collective that the next op waits for: they
  block the compute stream (``async_tp`` is not modelled). The collectives themselves are issued
  by :mod:`.tp_pass`; torchao's float8 styles are :mod:`.float8`.
* Context parallelism (``torch/distributed/tensor/experimental/_attention.py``,
  ``_templated_ring_attention`` and ``_templated_ring_attention_backward``; what each step
  runs is :mod:`sim.frameworks.fsdp2.cp`): each rank holds seq/cp tokens, split
  round-robin (chunks r and 2cp-1-r) so every rank gets the same share of the causal
  triangle. Attention runs in cp steps, one per key/value chunk; results are merged in fp32
  (``_SDPAMerger``, ``convert_to_f32``). Keys and values move by the rotate method:
  ``allgather`` (torch's ``_cp_options`` default; torchtitan's ``context_parallel_rotate_method``
  default) gathers every chunk once, issued before the first (local) step;
  ``alltoall`` shifts the buffer to the next rank each step (``permute_tensor``). Backward
  gathers keys and values again the same way and always shifts the fp32 key/value gradients
  round the ring, one shift per step. Eager, each exchange overlaps the next step; compiled,
  each is waited for where it is issued.

The kernels are those of :mod:`sim.workload.layer_ops` in its ``bf16`` style (torchtitan's Llama),
built with the same :class:`~sim.workload.layer_ops._Builder` operations on the tensor-parallel
local
widths and split into segments wherever a collective sits between them, since a per-block kernel
list cannot carry a collective in its middle.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from sim.frameworks.fsdp2.cp import repeat_kv_kernels, ring_step_segments
from sim.frameworks.fsdp2.float8 import FP8, Float8TpBuilder, builder, cast_module_input
from sim.hardware.compute import ComputeModel
from sim.workload.layer_ops import (
    BF16,
    FP32,
    IDX,
    Block,
    BlockCost,
    Kernel,
    SacCost,
    Style,
    Tensor,
    _Builder,
    fused_cross_entropy,
    mlp_projections,
    op_sac_costs,
    price_block,
    qkv_projections,
)
from sim.workload.model import ModelSpec
from sim.workload.titan_mla import (
    mla_attention_heads,
    mla_kv_latent,
    mla_query_heads,
    mla_query_latent,
)

# ---------------------------------------------------------------------- segments


def local_dims(m: ModelSpec, tp: int) -> ModelSpec:
    """The model as one tensor-parallel rank sees it: 1/tp of the heads and MLP width."""
    return replace(m, heads=m.heads // tp, kv_heads=m.kv_heads // tp,
                   ffn_hidden=m.ffn_hidden // tp)


def local_vocab(m: ModelSpec, tp: int) -> int:
    """Rows of the vocabulary-sharded embedding and output on one rank (DTensor shards
    unevenly divisible dimensions with the first ranks one larger)."""
    return -(-m.vocab // tp)


@dataclass
class TitanBlocks:
    """The segments of every block of one micro-batch on one rank, priced."""

    seg: dict[str, Block]
    cost: dict[str, BlockCost]
    tp: int
    cp: int
    rotate: str
    tokens: int
    """Tokens of this rank's sequence share (batch x seq / cp)."""
    local_tokens: int
    """Tokens after sequence parallelism (tokens / tp)."""
    kv_bytes: float
    """Local keys and values, bf16, as the ring concatenates them."""
    attn_acc_bytes: float
    """The fp32 gradient accumulators of ring attention's backward."""
    hidden: int
    params: dict[str, int] = field(default_factory=dict)
    """Parameters on this rank per block (embed, attn, mlp, head)."""
    sac: dict[str, SacCost] | None = None
    """Op-level selective checkpointing of each layer segment (``selective``), else None."""
    fp8_tp: bool = False
    """torchao's float8 tensor-parallel styles are in effect (:mod:`.float8`)."""
    compiled: bool = False
    """The blocks run under torch.compile: the ring's exchanges are waited for where they
    are issued (:mod:`sim.frameworks.fsdp2.cp`)."""
    tied_sum_s: float = 0.0
    """Tied embeddings: seconds autograd spends summing the shared weight's two local
    gradients (:func:`tied_grad_sum_tp_s`), charged to the embedding's backward."""
    mla_latent_bytes: tuple[float, ...] = ()
    """Multi-head Latent Attention (``attn_latent`` / ``attn_heads``): bytes of each latent
    whose gradient the tensor-parallel ranks all-reduce between the two in backward (the
    query latent, and the key/value latent with the rotary key); empty otherwise."""

    def layer_segments(self) -> list[str]:
        """The segments of one transformer layer, in forward order."""
        attn = (["attn_latent", "attn_heads"] if self.mla_latent_bytes else
                ["attn_main"] if self.cp == 1 else
                ["attn_qkv"] + [f"attn_ring{i}" for i in range(self.cp)] + ["attn_o"])
        return ["attn_norm", *attn, "attn_resid", "mlp_norm", "mlp_main", "mlp_resid"]


def _norm_seg(m: ModelSpec, style: Style, name: str, local: float, residual: bool,
              fp8_tp: bool = False) -> Block:
    # A SequenceParallel norm on the local tokens; the residual stream read by the norm and by
    # the residual add gets its two gradients summed here.
    b = _Builder(name, style)
    h = m.hidden
    x = b.t("in", local * h, BF16)
    b.block.inputs.append(x)
    if residual:
        b.sum_grads(2, local * h, BF16, "resid_in")
    y = b.norm(m, x, local, "norm")
    if fp8_tp and residual:
        cast_module_input(b, y, local, h)
    b.block.outputs.append(y)
    return b.finish()


def _resid_seg(m: ModelSpec, style: Style, name: str, local: float) -> Block:
    b = _Builder(name, style)
    h = m.hidden
    x = b.t("x", local * h, BF16)
    y = b.t("branch", local * h, BF16)
    b.block.inputs += [x, y]
    b.block.outputs.append(b.residual_add(x, y, local, h, "resid"))
    return b.finish()


def _qkv(b: _Builder, ml: ModelSpec, tokens: float) -> tuple[Tensor, Tensor, Tensor]:
    h = ml.hidden
    y = b.t("in", tokens * h, FP8 if isinstance(b, Float8TpBuilder) else BF16)
    b.block.inputs.append(y)
    # q, k and v read the gathered norm output: their input gradients are summed.
    b.sum_grads(3, tokens * h, BF16, "norm_out")
    return qkv_projections(b, ml, y, tokens, ("wq", "wk", "wv"))


def _mlp_main(ml: ModelSpec, style: Style, tokens: float, fp8_tp: bool = False,
              tp: int = 1) -> Block:
    b = builder("mlp_main", style, fp8_tp, tokens / tp)
    h, f = ml.hidden, ml.ffn_hidden
    y = b.t("in", tokens * h, FP8 if fp8_tp else BF16)
    b.block.inputs.append(y)
    if ml.mlp == "swiglu":
        b.sum_grads(2, tokens * h, BF16, "norm_out")
    b.block.outputs.append(mlp_projections(b, ml, y, tokens, f, ("w1", "w3", "w2")))
    return b.finish()


def _attn_main(ml: ModelSpec, style: Style, batch: int, seq: int, fp8_tp: bool = False,
               tp: int = 1) -> Block:
    """q/k/v, rotary embedding, attention over the whole (local) sequence, wo: no context
    parallelism."""
    tokens = batch * seq
    b = builder("attn_main", style, fp8_tp, tokens / tp)
    q, k, v = _qkv(b, ml, tokens)
    o = b.attention(ml, q, k, v, batch, seq)
    b.block.outputs.append(b.linear(o, tokens, ml.q_dim, ml.hidden, "wo", bias=ml.bias))
    return b.finish()


def _mla_latent_seg(m: ModelSpec, style: Style, tokens: float) -> Block:
    """torchtitan's DeepSeek-V3 attention under tensor parallelism
    (``models/deepseek_v3/infra/parallelize.py``, ``apply_non_moe_tp``): ``wq_a``,
    ``q_norm``, ``wkv_a`` and ``kv_norm`` are ``NoParallel`` (replicated weights), so every
    rank runs them whole on the all-gathered tokens; their outputs are the latents
    ``attn_heads`` reads."""
    mla = m.mla
    assert mla is not None
    b = _Builder("attn_latent", style)
    h = m.hidden
    y = b.t("in", tokens * h, BF16)
    b.block.inputs.append(y)
    # wq_a and wkv_a both read the gathered norm output: their input gradients are summed.
    b.sum_grads(2, tokens * h, FP32 if style.autocast else BF16, "norm_out", of=y)
    qn = mla_query_latent(b, m, y, tokens)
    latent, k_pe = mla_kv_latent(b, m, y, tokens)
    b.block.outputs += [qn, latent, k_pe]
    return b.finish()


def _mla_heads_seg(m: ModelSpec, style: Style, batch: int, seq: int, tp: int) -> Block:
    """The heads of torchtitan's DeepSeek-V3 attention on one tensor-parallel rank:
    ``wq_b`` and ``wkv_b`` colwise (``heads / tp`` heads each), attention over those heads,
    ``wo`` rowwise (its partial output reduce-scattered after this segment)."""
    mla = m.mla
    assert mla is not None and mla.q_lora_rank
    q_lora = mla.q_lora_rank
    b = _Builder("attn_heads", style)
    tokens = batch * seq
    qn = b.t("q_latent", tokens * q_lora, BF16)
    latent = b.t("kv_latent", tokens * mla.kv_lora_rank, BF16)
    k_pe = b.t("k_pe", tokens * mla.qk_rope_head_dim, BF16)
    b.block.inputs += [qn, latent, k_pe]
    heads = m.heads // tp
    query = mla_query_heads(b, m, qn, q_lora, tokens, heads)
    b.block.outputs.append(mla_attention_heads(b, m, query, latent, k_pe, batch, seq, heads))
    return b.finish()


def _ring_segments(ml: ModelSpec, style: Style, cm: ComputeModel, batch: int, seq: int,
                   cp: int, fp8_tp: bool = False, tp: int = 1, repeat_kv: bool = True
                   ) -> dict[str, Block]:
    """Context parallelism: qkv (with torchtitan's ``repeat_kv``), the cp ring steps forward
    and backward (:func:`sim.frameworks.fsdp2.cp.ring_step_segments`), and wo."""
    tokens = batch * seq          # local queries (seq is already seq/cp)
    b = builder("attn_qkv", style, fp8_tp, tokens / tp)
    q, k, v = _qkv(b, ml, tokens)
    if repeat_kv:
        k, v = repeat_kv_kernels(b, k, v, tokens, ml.kv_dim, ml.q_dim)
    b.block.outputs += [q, k, v]
    segs = {"attn_qkv": b.finish()}
    segs.update(ring_step_segments(ml, style, cm, batch, seq, cp, kv_width(ml, repeat_kv)))
    w = builder("attn_o", style, fp8_tp, tokens / tp)
    oin = w.t("in", tokens * ml.q_dim, BF16)
    w.block.inputs.append(oin)
    w.block.outputs.append(w.linear(oin, tokens, ml.q_dim, ml.hidden, "wo", bias=ml.bias))
    segs["attn_o"] = w.finish()
    return segs


def kv_width(ml: ModelSpec, repeat_kv: bool) -> int:
    """Width of the keys (and of the values) that reach SDPA on one rank."""
    return ml.q_dim if repeat_kv else ml.kv_dim


def tied_grad_sum_tp_s(cm: ComputeModel, m: ModelSpec, tp: int) -> float:
    """Seconds autograd spends adding the two bf16 gradients of a tied embedding on one
    tensor-parallel rank (0 if untied).

    torchtitan ties ``tok_embeddings.weight`` to the output projection's
    (``enable_weight_tying``, ``models/common/decoder.py``; refused only with pipeline
    parallelism) and shards both by vocabulary rows (RowwiseParallel embedding,
    ColwiseParallel output: the same ``Shard(0)``), so the one leaf gets a ``local_vocab x
    hidden`` gradient from the output layer and one from the lookup, and autograd adds them
    (``InputBuffer::add``): read two, write one, as
    :func:`sim.frameworks.common.accounting.tied_grad_sum_s` charges it for the whole
    table (the same with tp 1). Context parallelism does not shard the vocabulary."""
    if not m.tied_embeddings:
        return 0.0
    return cm.membound_time(3 * BF16 * local_vocab(m, tp) * m.hidden)


def _embed_seg(m: ModelSpec, style: Style, tokens: float, tp: int) -> Block:
    """Token embedding; with tensor parallelism rowwise: each rank looks up the ids in its
    vocabulary range (others masked to zero) and the partial outputs are reduce-scattered."""
    b = _Builder("embed", style)
    h, vl = m.hidden, local_vocab(m, tp)
    b.block.params += vl * h
    ids = b.t("ids", tokens, IDX)
    rows = b.t("rows", tokens * h, BF16)
    out = b.t("out", tokens * h, BF16)
    if tp > 1:
        # RowwiseParallel._partition_embedding: mask out-of-range ids, shift, look up, zero.
        mask = b.t("mask", tokens, 1)
        b.fwd(Kernel("mask_ids", "elementwise", (ids,), (mask, ids)))
    b.fwd(Kernel("lookup", "elementwise", (ids, rows), (out,)))
    if tp > 1:
        b.fwd(Kernel("zero_masked", "elementwise", (out, mask), (out,)))
    gout = b.t("g_out", tokens * h, BF16)
    gtab = b.t("g_table", vl * h, BF16)
    b.bwd(Kernel("g_zero", "elementwise", (), (gtab,)),
          Kernel("g_index_add", "elementwise", (gout, ids), (rows,)))
    b.block.weight_grads.append(gtab)
    if m.position == "learned":
        b.block.params += m.max_positions * h
    b.block.outputs.append(out)
    return b.finish()


def _head_main(m: ModelSpec, style: Style, tokens: float, tp: int) -> Block:
    """Output projection to this rank's vocabulary shard and cross-entropy in fp32 (loss
    parallelism with tp > 1), as :func:`sim.workload.layer_ops.head_block` without its norm."""
    b = _Builder("head_main", style)
    h, vl = m.hidden, local_vocab(m, tp)
    y = b.t("in", tokens * h, BF16)
    b.block.inputs.append(y)
    logits = b.linear(y, tokens, h, vl, "output", float8=False)
    if m.tied_embeddings:
        b.block.params -= h * vl
    b.block.forward_scoped.append(logits)
    n = tokens * vl
    # The loss's gradient of the logits is the one the output layer's backward reads
    # (writes_grad, as layer_ops.head_block): one [tokens, vocab shard] tensor, not two.
    g_logits = b.t("output.g_out", n, BF16)
    b.writes_grad(logits, g_logits)
    if style.fused_loss:     # tp == 1 only (checks.py)
        fused_cross_entropy(b, logits, g_logits, tokens)
        return b.finish()
    lf, lsm = b.t("logits_fp32", n, FP32), b.t("log_softmax", n, FP32)
    b.fwd(Kernel("logits_float", "elementwise", (logits,), (lf,)))
    if tp > 1 and not style.compile:
        _loss_parallel(b, lf, lsm, g_logits, n)
        return b.finish()
    b.fwd(Kernel("log_softmax", "elementwise", (lf, lf, lf), (lsm,)))
    b.fwd(Kernel("nll_loss", "tiny", (lsm,), (b.t("loss", 1, FP32),)))
    b.save(lsm)
    g_nll, g_lsm = b.t("g_nll", n, FP32), b.t("g_log_softmax", n, FP32)
    b.bwd(Kernel("g_nll", "elementwise", (), (g_nll,)),
          Kernel("g_log_softmax", "elementwise", (g_nll, g_nll, lsm), (g_lsm,)),
          Kernel("g_logits_bf16", "elementwise", (g_lsm,), (g_logits,)))
    return b.finish()


def _loss_parallel(b: _Builder, lf: Tensor, lsm: Tensor, g_logits: Tensor, n: float) -> None:
    """Eager cross-entropy on vocabulary-sharded logits as torch's ``loss_parallel`` runs it
    (``torch/distributed/tensor/parallel/loss.py``): DTensor dispatches ``_log_softmax`` and
    ``nll_loss_backward`` to decompositions with all-reduces inserted, each op its own
    tensor, unlike aten's fused softmax kernels.

    * ``_log_softmax``: ``shifted = x - x_max``, ``torch.exp(shifted)`` summed over the
      shard, ``result = shifted - log(sumexp)``; ``x`` (the fp32 copy) and ``shifted`` are
      locals until it returns. The exp is materialised and freed before ``result`` exists,
      so the peak (x, shifted and one more fp32 buffer) is the same with the exp and the sum
      written as one kernel, as here.
    * ``_nll_loss_and_log_softmax_backward``: ``grad_input = torch.zeros_like(x)`` (scatter
      of -1 at the targets), returns ``(grad_input + torch.exp(x)) * grad_output``: four fp32
      buffers live at once with the saved output (autograd releases a node's saved tensors
      after its backward returns; ``grad_input`` is a local until then); the log_softmax
      backward handler is a no-op ``.to(input_dtype)``.
    """
    shifted = b.t("shifted", n, FP32)
    b.fwd(Kernel("amax", "elementwise", (lf,), ()))
    b.fwd(Kernel("sub_max", "elementwise", (lf,), (shifted,)))
    b.fwd(Kernel("exp_sum", "elementwise", (shifted, shifted), ()))
    b.fwd(Kernel("sub_lse", "elementwise", (shifted, lf), (lsm,)))
    b.fwd(Kernel("nll_loss", "tiny", (lsm,), (b.t("loss", 1, FP32),)))
    b.save(lsm)
    gi, ex, s, g = (b.t(k, n, FP32) for k in ("g_zeros", "g_exp", "g_sum", "g_mul"))
    b.bwd(Kernel("g_zeros", "elementwise", (), (gi,)),
          Kernel("g_scatter", "tiny", (gi,), (gi,)),
          Kernel("g_exp", "elementwise", (lsm,), (ex,)),
          Kernel("g_add", "elementwise", (gi, ex), (s,)),
          Kernel("g_mul", "elementwise", (s, gi, lsm), (g,)),
          Kernel("g_logits_bf16", "elementwise", (g,), (g_logits,)))


def titan_blocks(m: ModelSpec, style: Style, cm: ComputeModel, batch: int, seq: int, tp: int,
                 cp: int, rotate: str, sac: bool = False, eager_head: bool = False,
                 repeat_kv: bool = True) -> TitanBlocks:
    """Every segment of one micro-batch on one rank under tensor parallelism ``tp`` (with
    sequence parallelism) and context parallelism ``cp``; with ``sac``, also what each layer
    segment keeps and re-runs under torchtitan's op-level selective checkpointing
    (:func:`layer_sac_costs`). ``eager_head``: final norm, output and loss run uncompiled
    although ``style.compile`` (``Fsdp2Options.compile_loss`` false). ``repeat_kv``: the
    keys and values reach SDPA with the query heads' width (torchtitan before 2026,
    :func:`sim.frameworks.fsdp2.cp.titan_repeats_kv`; modelled on the context-parallel
    path, where it sets the bytes the ring moves)."""
    ml = local_dims(m, tp)
    seq_local = seq // cp
    tokens = batch * seq_local
    local = tokens // tp
    hstyle = replace(style, compile=False) if eager_head else style
    # torchao's float8 TP styles (tensorwise scaling only).
    # Rowwise recipes: torchtitan applies plain TP (bf16 all-gathers, local casts).
    fp8_tp = style.float8 and tp > 1 and not style.autocast \
        and style.float8_recipe == "tensorwise"
    segs: dict[str, Block] = {
        "embed": _embed_seg(m, style, tokens, tp),
        "attn_norm": _norm_seg(m, style, "attn_norm", local, residual=True, fp8_tp=fp8_tp),
        "attn_resid": _resid_seg(m, style, "attn_resid", local),
        "mlp_norm": _norm_seg(m, style, "mlp_norm", local, residual=True, fp8_tp=fp8_tp),
        "mlp_main": _mlp_main(ml, style, tokens, fp8_tp, tp),
        "mlp_resid": _resid_seg(m, style, "mlp_resid", local),
        "head_norm": _norm_seg(m, hstyle, "head_norm", local, residual=False),
        "head_main": _head_main(m, hstyle, tokens, tp),
    }
    mla = m.mla
    if mla is not None:     # cp 1, a query latent, no float8 TP (checks.py)
        segs["attn_latent"] = _mla_latent_seg(m, style, tokens)
        segs["attn_heads"] = _mla_heads_seg(m, style, batch, seq_local, tp)
    elif cp == 1:
        segs["attn_main"] = _attn_main(ml, style, batch, seq_local, fp8_tp, tp)
    else:
        segs.update(_ring_segments(ml, style, cm, batch, seq_local, cp, fp8_tp, tp,
                                   repeat_kv))
    cost = {k: price_block(b, hstyle if k.startswith("head") else style, cm)
            for k, b in segs.items()}
    params = {
        "embed": segs["embed"].params,
        "attn": sum(segs[k].params for k in segs if k.startswith("attn")),
        "mlp": sum(segs[k].params for k in segs if k.startswith("mlp")),
        "head": segs["head_norm"].params + segs["head_main"].params,
    }
    kvw = kv_width(ml, repeat_kv)
    tb = TitanBlocks(segs, cost, tp, cp, rotate, tokens, local,
                     kv_bytes=2.0 * tokens * kvw * BF16,
                     attn_acc_bytes=float(tokens * (ml.q_dim + 2 * kvw) * FP32),
                     hidden=m.hidden, params=params, fp8_tp=fp8_tp, compiled=style.compile,
                     tied_sum_s=tied_grad_sum_tp_s(cm, m, tp),
                     mla_latent_bytes=(() if mla is None else (
                         float(tokens * (mla.q_lora_rank or 0) * BF16),
                         float(tokens * (mla.kv_lora_rank + mla.qk_rope_head_dim) * BF16))))
    if sac:
        tb.sac = layer_sac_costs(tb, style, cm)
    return tb


def layer_sac_costs(tb: TitanBlocks, style: Style, cm: ComputeModel) -> dict[str, SacCost]:
    """Op-level selective checkpointing of one layer's segments on one rank.

    torchtitan's policy (``torchtitan/distributed/activation_checkpoint.py``, ``_apply_op_sac``
    and its ``_save_list``) is applied by a dispatch mode that sees the ops as the layer
    issues them: the local matmuls of the tensor-parallel shards (every second one saved,
    counted over the layer in forward order, as :func:`sim.workload.layer_ops.op_sac_costs`), the
    attention op and ``_c10d_functional.reduce_scatter_tensor`` are saved; the functional
    all-gathers are not, so recomputation runs them again. Context parallelism's ring runs
    inside the one attention op that DTensor dispatches (``_context_parallel/_attention.py``),
    so the mode saves that op's output and nothing of the ring (exchanges, merges) re-runs:
    its segments keep what autograd saves and re-run nothing.
    """
    order = tb.layer_segments()
    ring = [k for k in order if k.startswith("attn_ring")]
    out = op_sac_costs([tb.seg[k] for k in order if k not in ring], style, cm)
    for k in ring:
        out[k] = SacCost(cached_bytes=tb.cost[k].saved_bytes, recompute_s=0.0,
                         recompute_flops=0.0)
    return out
