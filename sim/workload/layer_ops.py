"""The kernels a transformer training step runs, block by block, as a framework issues them.

Each block (embedding, attention half of a layer, MLP half, final norm + LM head + loss) is
built once as a list of forward kernels and a list of backward kernels, each reading and
writing named tensors, plus the set of tensors autograd saves from forward to backward. From
that one description come:

* time: every kernel priced by :class:`~sim.hardware.compute.ComputeModel` (GEMM, attention,
  memory-bound by class), with the eager CPU issue cost as a floor;
* memory: saved activations per block, and the transient peak inside each block's forward
  and backward from tensor lifetimes (a tensor lives from the kernel that writes it to the last
  kernel that reads it);
* torch.compile: the runs of memory-bound kernels between two GEMM/attention kernels fused
  as inductor's scheduler fuses them (:mod:`sim.workload.inductor`): each fused kernel reads what
  comes from outside it and writes what leaves it.

This module builds the blocks of Hugging Face's and torchtitan's Llama and is the import
surface of the family (every name importable from it before it was split still is):
:mod:`sim.workload.kernels` holds the vocabulary (Tensor, Kernel, Style, Block, dtypes),
:mod:`sim.workload.layer_builder` the op-by-op builder, :mod:`sim.workload.layer_rules` the
linear-layer and
fused-norm rules it shares with :mod:`sim.workload.megatron_ops`, :mod:`sim.workload.block_pricing`
the time and
memory above.

Two execution styles cover the frameworks of this version:

``autocast``
    Plain PyTorch with fp32 parameters under ``torch.autocast(bfloat16)`` running Hugging Face
    ``LlamaForCausalLM`` (transformers 5.x, SDPA attention): fp32 residual stream (the
    embedding output is fp32 and adds promote), RMSNorm as six fp32 kernels, every linear
    casting its input to bf16 separately and its weight once per forward (autocast's weight
    cache, saved for backward), rotary embedding in fp32 (bf16 q times fp32 cos promotes), and a
    KV cache built in training (``use_cache`` defaults on) that copies k and v and lives until
    the forward returns. Sources: ``transformers/models/llama/modeling_llama.py``,
    ``integrations/sdpa_attention.py``, ``loss/loss_utils.py``; PyTorch
    ``aten/src/ATen/autocast_mode.cpp`` (cast cache only for fp32 leaf tensors that require
    grad; SDPA on the lower-precision list).
``bf16``
    torchtitan's Llama under FSDP2 mixed precision: parameters gathered in bf16, no autocast,
    bf16 residual stream, fused RMSNorm kernel (PyTorch 2.8 on; before it torchtitan's own
    eager RMSNorm, ``Style.fused_rmsnorm``), rotary embedding by complex multiply in fp32,
    no KV cache. Sources: ``torchtitan/models/llama3/model.py``,
    ``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``.
``hf_bf16``
    Hugging Face ``LlamaForCausalLM`` under FSDP2 mixed precision: bf16 parameters and
    activations, no autocast, the model's own eager RMSNorm (eight kernels through fp32) and
    ``rotate_half`` rotary embedding in bf16, and the KV cache of ``use_cache``
    (:mod:`sim.workload.hf_ops`).

Loss (both): logits in bf16, ``.float()`` copy, ``log_softmax`` (output saved) and
``nll_loss``; backward materialises the fp32 gradient of the logits twice (nll and
log_softmax) before casting it back to bf16. Compiled, inductor's two looped reductions
(:func:`compiled_cross_entropy`).
"""

from __future__ import annotations

from functools import lru_cache

from sim.workload.block_pricing import (
    BlockCost,
    SacCost,
    _fuse,
    _needed_outside,
    kernel_time,
    op_sac_costs,
    price_block,
)
from sim.workload.kernels import (
    BF16,
    FP32,
    IDX,
    Block,
    Kernel,
    KernelClass,
    Style,
    Tensor,
    is_reduction,
)
from sim.workload.layer_builder import _Builder
from sim.workload.layer_rules import cast_kernel
from sim.workload.model import ModelSpec

__all__ = [
    "BF16", "FP32", "IDX", "Block", "BlockCost", "Kernel", "KernelClass", "SacCost", "Style",
    "Tensor", "_Builder", "_fuse", "_needed_outside", "attention_block", "embedding_block",
    "head_block", "is_reduction", "kernel_time", "mlp_block", "mlp_projections",
    "model_blocks", "op_sac_costs", "price_block", "qkv_projections", "residual_norm_input",
]


# ---------------------------------------------------------------------- blocks
def qkv_projections(b: _Builder, m: ModelSpec, y: Tensor, tokens: float,
                    names: tuple[str, str, str] = ("q", "k", "v")
                    ) -> tuple[Tensor, Tensor, Tensor]:
    """Query, key and value projections of the normalised input ``y`` over the widths in
    ``m`` (the whole model, or one tensor-parallel rank's heads), with RoPE on queries and
    keys. ``names``: HF q, k, v; torchtitan wq, wk, wv."""
    h = m.hidden
    q = b.linear(y, tokens, h, m.q_dim, names[0], bias=m.bias)
    k = b.linear(y, tokens, h, m.kv_dim, names[1], bias=m.bias)
    v = b.linear(y, tokens, h, m.kv_dim, names[2], bias=m.bias)
    if m.qk_norm:
        # Qwen3 (torchtitan models/qwen3/model/model.py Attention.q_norm/k_norm, HF
        # Qwen3Attention): an RMSNorm over each head's head_dim on queries and keys, before
        # RoPE (ModelSpec.attention_params counts their 2 x head_dim weights).
        q = b.rmsnorm(q, tokens * m.q_dim // m.head_dim, m.head_dim, "q_norm")
        k = b.rmsnorm(k, tokens * m.kv_dim // m.head_dim, m.head_dim, "k_norm")
    if m.position == "rope":
        q = b.rope(q, tokens, m.q_dim, "rope_q")
        k = b.rope(k, tokens, m.kv_dim, "rope_k")
    return q, k, v


def residual_norm_input(b: _Builder, m: ModelSpec, tokens: float) -> tuple[Tensor, Tensor]:
    """A residual block's input ``x`` (the residual stream, read by the norm and by the
    residual add: its two gradients summed) and the norm's output ``y``."""
    h, act = m.hidden, b.style.act_bytes
    x = b.t("in", tokens * h, act)
    b.block.inputs.append(x)
    # Residual stream gradient plus the branch gradient through the norm.
    b.sum_grads(2, tokens * h, act, "resid_in", of=x)
    return x, b.norm(m, x, tokens, "norm")


def attention_block(m: ModelSpec, style: Style, batch: int, seq: int, kv_cache: bool) -> Block:
    """Norm, q/k/v projections, rotary embedding, causal attention, output projection, residual."""
    b = _Builder("attn", style)
    tokens = batch * seq
    h = m.hidden
    x, y = residual_norm_input(b, m, tokens)
    # Under autocast each projection casts y separately (3 reads of y, 3 fp32 input grads);
    # in bf16 they share y and their input gradients are summed.
    b.sum_grads(3, tokens * h, FP32 if style.autocast else BF16, "norm_out", of=y)
    q, k, v = qkv_projections(b, m, y, tokens)
    if kv_cache:
        # DynamicCache.update: torch.cat([empty, k]) and the same for v, kept until return.
        kc = Tensor("attn.cache_k", k.nbytes)   # same dtype as k after RoPE
        vc = b.t("cache_v", tokens * m.kv_dim, BF16)
        b.fwd(Kernel("cache_k", "elementwise", (k,), (kc,)))
        b.fwd(Kernel("cache_v", "elementwise", (v,), (vc,)))
        b.block.forward_scoped += [kc, vc]
    o = b.attention(m, q, k, v, batch, seq)
    out = b.linear(o, tokens, m.q_dim, h, "o", bias=m.bias)
    res = b.residual_add(x, out, tokens, h, "resid")
    b.block.outputs.append(res)
    return b.finish()


def mlp_projections(b: _Builder, m: ModelSpec, y: Tensor, tokens: float, f: int,
                    names: tuple[str, str, str] = ("gate", "up", "down")) -> Tensor:
    """The MLP between its normalised input ``y`` and its output projection's result:
    gate/up projections, SiLU and gate product (or the up projection and GELU), and the down
    projection, over an inner width ``f`` (the full ``ffn_hidden``, or one tensor-parallel
    rank's share). ``names``: the three projections' names (HF: gate, up, down; torchtitan:
    w1, w3, w2)."""
    h = m.hidden
    gate, up, down = names
    if m.mlp == "swiglu":
        g = b.linear(y, tokens, h, f, gate, bias=m.bias)
        u = b.linear(y, tokens, h, f, up, bias=m.bias)
        s = b.t("silu", tokens * f, BF16)
        prod = b.t("prod", tokens * f, BF16)
        # Eager SiLU and its backward stream at the vectorised rate: measured in the lent
        # H200's steps (h200-train-steps-ops.json: 537 MB in 139 us forward, 805 MB in 207 us
        # backward, 3.9 TB/s); eager GELU is bound by its math (ComputeModel.gelu_time).
        b.fwd(Kernel("silu", "elementwise", (g,), (s,)))
        b.fwd(Kernel("gate_mul", "elementwise", (s, u), (prod,)))
        # Compiled, AOTAutograd's min-cut partitioner saves g and u and recomputes silu(g) in
        # the backward's fused kernel (measured on the H200: the fused forward writes only
        # the product, h200-train-steps-profiled.json).
        recomputed = b.style.compile
        b.save(*((g, u) if recomputed else (g, s, u)))
        gp = b.t("g_prod", tokens * f, BF16)
        gs = b.t("g_silu", tokens * f, BF16)
        gu = b.t("g_up", tokens * f, BF16)
        gg = b.t("g_gate", tokens * f, BF16)
        b.bwd(Kernel("g_gate_mul_s", "elementwise", (gp, u), (gs,)),
              Kernel("g_gate_mul_u", "elementwise", (gp, g if recomputed else s), (gu,)),
              Kernel("g_silu", "elementwise", (gs, g), (gg,)))
        b.reads_grad(prod, gp)
        b.writes_grad(u, gu)
        b.writes_grad(g, gg)
        act = prod
    else:
        u = b.linear(y, tokens, h, f, up, bias=m.bias)
        act = b.t("gelu", tokens * f, BF16)
        b.fwd(Kernel("gelu", "elementwise", (u,), (act,), activation_elements=tokens * f))
        b.save(u)
        ga = b.t("g_gelu", tokens * f, BF16)
        gu = b.t("g_up", tokens * f, BF16)
        b.bwd(Kernel("g_gelu", "elementwise", (ga, u), (gu,), activation_elements=tokens * f,
                     activation_pass="bwd"))
        b.reads_grad(act, ga)
        b.writes_grad(u, gu)
    return b.linear(act, tokens, f, h, down, bias=m.bias)


def mlp_block(m: ModelSpec, style: Style, batch: int, seq: int) -> Block:
    """Norm, gate/up projections, SiLU-gate (or GELU), down projection, residual."""
    b = _Builder("mlp", style)
    tokens = batch * seq
    h, f = m.hidden, m.ffn_hidden
    x = b.t("in", tokens * h, style.act_bytes)
    b.block.inputs.append(x)
    b.sum_grads(2, tokens * h, style.act_bytes, "resid_in", of=x)
    y = b.norm(m, x, tokens, "norm")
    if m.mlp == "swiglu":
        b.sum_grads(2, tokens * h, FP32 if style.autocast else BF16, "norm_out", of=y)
    out = mlp_projections(b, m, y, tokens, f)
    res = b.residual_add(x, out, tokens, h, "resid")
    b.block.outputs.append(res)
    return b.finish()


#: The host-bound start of Hugging Face's eager forward (transformers 5.17, LlamaModel): the
#: cache positions, the causal-mask checks and RoPE's table are a dozen small kernels the
#: GPU waits for one by one, and the mask check copies a flag to the host (a device-to-host
#: sync), so the GPU drains there and idles while the host issues what follows. **Fitted**:
#: the GPU's idle gaps from the embedding lookup to the first layer's kernels in the lent
#: H200's 1b-plain step, 1.58 ms (``h200-step-gaps.json``); 8b4l-plain's, 1.63 ms, validates
#: it (a host cost: the same whatever the model's width).
HF_FORWARD_START_HOST_S = 1.58e-3


def embedding_block(m: ModelSpec, style: Style, batch: int, seq: int) -> Block:
    """Token (and learned position) embedding lookup; backward scatters into a dense grad."""
    b = _Builder("embed", style)
    tokens = batch * seq
    h = m.hidden
    wb = FP32 if style.autocast else BF16
    ids = b.t("ids", tokens, IDX)
    rows = b.t("rows", tokens * h, wb)
    out = b.t("out", tokens * h, style.act_bytes)
    b.fwd(Kernel("lookup", "elementwise", (ids, rows), (out,)))
    b.block.params += m.vocab * h
    gout = b.t("g_out", tokens * h, style.act_bytes)
    gtab = b.t("g_table", m.vocab * h, wb)
    # embedding_dense_backward: zero-filled [V, h] gradient, then index_add of the rows.
    b.bwd(Kernel("g_zero", "elementwise", (), (gtab,)),
          Kernel("g_index_add", "elementwise", (gout, ids), (rows,)))
    b.block.weight_grads.append(gtab)
    if m.position == "learned":
        b.block.params += m.max_positions * h
        pos = b.t("pos", seq * h, wb)
        out2 = b.t("out_pos", tokens * h, style.act_bytes)
        b.fwd(Kernel("add_pos", "elementwise", (out, pos), (out2,)))
        gpos = b.t("g_pos", m.max_positions * h, wb)
        b.bwd(Kernel("g_pos_sum", "elementwise", (gout,), (gpos,)))
        b.block.weight_grads.append(gpos)
        out = out2
    elif style.hf:
        # HF LlamaRotaryEmbedding, once per forward: a handful of [S, head_dim] kernels
        # (in bf16 also the casts of cos and sin to the hidden states' dtype).
        tab = b.t("rope_table", seq * m.head_dim, FP32)
        casts = ("cos_to_bf16", "sin_to_bf16") if not style.autocast else ()
        for name in ("pos_float", "inv_freq_mul", "cat", "cos", "sin", "scale_cos",
                     "scale_sin", *casts):
            b.fwd(Kernel(f"rope.{name}", "tiny", (tab,), (tab,)))
        if not style.sdpa_mask:
            # Traced whole by torch.compile, the mask check is in the graph (no sync);
            # compiling each decoder layer (FSDP2) leaves this start eager.
            b.block.exposed_host_s = HF_FORWARD_START_HOST_S
    b.block.outputs.append(out)
    return b.finish()


def head_block(m: ModelSpec, style: Style, batch: int, seq: int) -> Block:
    """Final norm, LM head over every position, cross-entropy in fp32 (on the bf16 logits
    with ``style.bf16_loss``)."""
    b = _Builder("head", style)
    tokens = batch * seq
    h, vocab = m.hidden, m.vocab
    x = b.t("in", tokens * h, style.act_bytes)
    b.block.inputs.append(x)
    y = b.norm(m, x, tokens, "norm")
    logits = b.linear(y, tokens, h, vocab, "lm_head", float8=False)
    if m.tied_embeddings:
        # The shared matrix's parameters belong to the embedding block.
        b.block.params -= h * vocab
    # The bf16 logits stay referenced (model output / local) until the forward returns.
    b.block.forward_scoped.append(logits)
    n = tokens * vocab
    g_logits = b.t("lm_head.g_out", n, BF16)
    if style.fused_loss:
        fused_cross_entropy(b, logits, g_logits, tokens)
        b.writes_grad(logits, g_logits)
        return b.finish()
    if style.compile:
        compiled_cross_entropy(b, logits, g_logits, tokens, n)
        b.writes_grad(logits, g_logits)
        return b.finish()
    # torchtitan's loss upcasts (``pred.float()``); AutoModel's runs on the bf16 logits.
    ebytes = BF16 if style.bf16_loss else FP32
    lsm = b.t("log_softmax", n, ebytes)
    loss = b.t("loss", 1, FP32)
    if style.bf16_loss:
        lf = logits
    else:
        lf = b.t("logits_fp32", n, FP32)
        b.fwd(cast_kernel("logits_float", logits, lf, n))
    # Each pass streams its 128k-wide rows like an elementwise loop, not at the short-row
    # reduction rate: measured on the lent H200 (h200-train-steps-ops.json, 1b-plain: four
    # passes of 8.4 GB in 7.83 ms forward and 8.35 ms backward, 4.3 and 4.0 TB/s).
    b.fwd(Kernel("log_softmax", "elementwise", (lf, lf, lf), (lsm,), streams=True))
    b.fwd(Kernel("nll_loss", "tiny", (lsm,), (loss,)))
    b.save(lsm)
    g_nll = b.t("g_nll", n, ebytes)
    # log_softmax backward: sum of the gradient over the row, then grad - exp(out) * sum.
    if style.bf16_loss:
        b.bwd(Kernel("g_nll", "elementwise", (), (g_nll,)),
              Kernel("g_log_softmax", "elementwise", (g_nll, g_nll, lsm), (g_logits,),
                     streams=True))
    else:
        g_lsm = b.t("g_log_softmax", n, FP32)
        b.bwd(Kernel("g_nll", "elementwise", (), (g_nll,)),
              Kernel("g_log_softmax", "elementwise", (g_nll, g_nll, lsm), (g_lsm,),
                     streams=True),
              Kernel("g_logits_bf16", "elementwise", (g_lsm,), (g_logits,)))
    b.writes_grad(logits, g_logits)
    return b.finish()



def compiled_cross_entropy(b: _Builder, logits: Tensor, g_logits: Tensor, tokens: float,
                           n: float) -> None:
    """``cross_entropy(logits.float(), labels)`` under torch.compile: inductor's forward is
    one looped reduction over each vocabulary row (the online max and sum of exponentials,
    ``prepare_softmax_online``) that writes only the row's log-sum-exp and the loss; the
    min-cut partitioner saves the bf16 logits (the graph's input) and that log-sum-exp rather
    than the fp32 log-softmax, and the backward recomputes the softmax from them into the
    bf16 gradient. Measured on the lent H200 (h200-train-steps-profiled.json, 1b-compile: a
    ``triton_red_fused__log_softmax`` forward of 3.18 ms and backward of 3.59 ms over 4.2 GB
    of logits, where the eager loss takes 16.2 ms)."""
    lse = b.t("logsumexp", tokens, FP32)
    loss = b.t("loss", 1, FP32)
    b.fwd(Kernel("log_softmax_online", "elementwise", (logits, logits), (lse, loss)))
    b.save(logits, lse)
    b.bwd(Kernel("g_log_softmax", "elementwise", (logits, logits, lse), (g_logits,)))


def fused_cross_entropy(b: _Builder, logits: Tensor, g_logits: Tensor, tokens: float) -> None:
    """flash-attn's fused softmax cross-entropy (``flash_attn/losses/cross_entropy.py`` over
    ``csrc/xentropy``, apex's ``xentropy`` kernels, 16-bit inputs kept as they are) on the
    logits as the output layer wrote them: the forward kernel runs over each vocabulary row
    twice (its max, then the sum of exponentials) and writes only the row's loss and
    log-sum-exp; the backward reads the row once more with that log-sum-exp and writes the
    16-bit gradient (``inplace_backward`` False, llm-foundry's ``FusedCrossEntropyLoss``
    default). Autograd saves the logits and the log-sum-exp, nothing in fp32 over the
    vocabulary."""
    lse = b.t("logsumexp", tokens, FP32)
    loss = b.t("loss", tokens, FP32)
    b.fwd(Kernel("xentropy_fwd", "elementwise", (logits, logits), (lse, loss)))
    b.save(logits, lse)
    b.bwd(Kernel("xentropy_bwd", "elementwise", (logits, lse), (g_logits,)))


@lru_cache(maxsize=256)
def model_blocks(m: ModelSpec, style: Style, batch: int, seq: int, kv_cache: bool
                 ) -> tuple[Block, Block, Block, Block]:
    """(embedding, attention, MLP, head) blocks of one micro-batch; a model with Multi-head
    Latent Attention gets torchtitan's (:mod:`sim.workload.titan_mla`)."""
    if m.mla is not None:
        from sim.workload.titan_mla import titan_mla_attention_block
        assert not kv_cache and style.name == "bf16", "MLA is modelled in torchtitan's code"
        attn = titan_mla_attention_block(m, style, batch, seq)
    else:
        attn = attention_block(m, style, batch, seq, kv_cache)
    return (embedding_block(m, style, batch, seq),
            attn,
            mlp_block(m, style, batch, seq),
            head_block(m, style, batch, seq))
