"""In-place writes allocate nothing (:func:`sim.workload.block_pricing.in_place_targets`).

Independent truths: the sources named per test. A kernel that writes into a tensor that already
exists (saved for backward, or made outside the kernel sequence) reuses its storage; PyTorch's
caching allocator sees no new request. Each test below fails with the rule taken out (the
saved or external tensor then counts a second time).
"""

from __future__ import annotations

import pytest

from sim import catalog
from sim.hardware.compute import ComputeModel
from sim.workload.block_pricing import price_block
from sim.workload.kernels import BF16, FP32, Block, Kernel, Tensor
from sim.workload.layer_builder import _Builder
from sim.workload.megatron_loss import vocab_parallel_loss
from sim.workload.megatron_ops import (
    STYLE,
    MegatronLayout,
    attention_block,
    embedding_block,
    head_block,
    megatron_blocks,
    padded_vocab,
)
from sim.workload.model import ModelSpec
from sim.workload.moe_ops import MoELayout, moe_layer_ops

H200 = ComputeModel(catalog.gpu("h200"))
MIB = 2.0**20


def test_a_backward_write_into_a_saved_tensor_costs_no_bytes() -> None:
    s = Tensor("softmax", 64 * MIB)
    new = Tensor("g_half", 32 * MIB)
    blk = Block("b", forward=[Kernel("make", "elementwise", (), (s,))],
                backward=[Kernel("mul_", "elementwise", (s,), (s,))], saved=[s])
    c = price_block(blk, STYLE, H200)
    assert c.saved_bytes == 64 * MIB
    assert c.bwd_transient_bytes == 0.0          # 64 MiB with the saved tensor counted again
    # Control: a new tensor written beside it is counted, whole.
    blk.backward.append(Kernel("cast", "elementwise", (s,), (new,)))
    assert price_block(blk, STYLE, H200).bwd_transient_parts == (32 * MIB,)


def test_an_accumulator_made_outside_the_sequence_is_written_in_place() -> None:
    # A kernel that reads and writes a tensor no kernel of the sequence made (a framework's
    # accumulator, torch's ring-attention dq/dk/dv buffers) adds into it in place.
    acc, g, out = Tensor("acc", 48 * MIB), Tensor("g", 16 * MIB), Tensor("next", 48 * MIB)
    blk = Block("acc", backward=[Kernel("add_", "elementwise", (acc, g), (acc,)),
                                 Kernel("send", "elementwise", (acc,), (out,))])
    assert price_block(blk, STYLE, H200).bwd_transient_parts == (48 * MIB,)   # `next` only


N_TOK, VOCAB = 4 * 4096, 8192
N = N_TOK * VOCAB
"""Logits of one micro-batch on one rank (the GPT-OSS B200 row has 4 x 4,096 tokens of
201,088 columns; a smaller vocabulary keeps the test fast: the closed forms scale with N)."""


def _loss(impl: str):
    b = _Builder("loss", STYLE)
    logits = b.t("logits", N, BF16)
    vocab_parallel_loss(b, logits, N_TOK, VOCAB, impl)  # type: ignore[arg-type]
    return price_block(b.finish(), STYLE, H200)


@pytest.mark.parametrize(("impl", "saved", "peak"), [
    # Megatron-Core tensor_parallel/cross_entropy.py (unfused, the default) and
    # fusions/fused_cross_entropy.py (native): forward saves the fp32 softmax (4N). Backward
    # (calculate_gradients): grad_input = softmax; grad_2d[arange, target] -= update and
    # grad_input.mul_(grad_output) in that storage; the cast to bf16 (autograd's .float()
    # node; native: .to(torch.bfloat16)) is the one new tensor, 2N, while the fp32 one is
    # still held: the backward's peak is 4N + 2N. (Before the rule: unfused 4N + 8N, the
    # softmax counted again plus a separate fp32 gradient; native 4N + 6N.)
    ("unfused", 4 * N, 6 * N),
    ("native", 4 * N, 6 * N),
    # Transformer Engine (common/triton/cross_entropy.py, TE 2.2-2.17): cross_entropy_kernel
    # writes the gradient into the bf16 logits it saved, element_mul_kernel scales them in
    # place: 2N saved, nothing new (before: 2N more).
    ("te", 2 * N, 2 * N),
])
def test_loss_backward_peak_is_megatrons_closed_form(impl: str, saved: float, peak: float
                                                     ) -> None:
    c = _loss(impl)
    assert c.saved_bytes == saved
    assert c.saved_bytes + c.bwd_transient_bytes == peak


def test_unfused_loss_backward_moves_the_bytes_of_megatrons_kernels() -> None:
    # mul_ reads and writes the fp32 softmax (4 + 4 bytes per logit), the cast reads it and
    # writes bf16 (4 + 2); the one-hot update touches one element per token (a tiny kernel).
    b = _Builder("loss", STYLE)
    vocab_parallel_loss(b, b.t("logits", N, BF16), N_TOK, VOCAB, "unfused")
    blk = b.finish()
    assert [k.klass for k in blk.backward] == ["tiny", "elementwise", "elementwise"]
    assert sum(k.nbytes for k in blk.backward) == 14 * N


def test_gpt_oss_b200_row_head_backward_holds_one_bf16_gradient() -> None:
    # The published-moe GPT-OSS-120B B200 row: tp 1, 4 x 4,096 tokens, 201,088 columns.
    # Unfused loss: the head's backward holds the bf16 gradient of the logits (2N) beyond the
    # saved tensors; the fp32 softmax (4N) is freed after the cast, which leaves room for the
    # output layer's dgrad and fp32 wgrad. It was 24.5 GiB (the softmax again and an fp32
    # gradient), an overcount of 18.4 GiB = 6N.
    m = ModelSpec.from_ref("gpt-oss-120b", 4096)
    n = 4 * 4096 * 201088
    c = price_block(head_block(m, MegatronLayout(tp=1), 4, 4096), STYLE,
                    ComputeModel(catalog.gpu("b200")))
    assert c.bwd_transient_bytes == 2 * n


def test_local_attention_backward_holds_both_score_gradients() -> None:
    # Megatron's unfused attention backward runs P V's dgrad (g_probs), then the softmax's
    # backward (reads g_probs and probs, writes g_scores), then Q K^T's GEMMs: at the softmax
    # backward both score-sized gradients are alive (less the few saved tensors already freed
    # by then: the proj input, v); in the reverse order each lived one kernel alone.
    m = ModelSpec.from_ref("llama3.2-1b", 1024)
    _, am = attention_block(m, MegatronLayout(flash_attention=False), 1, 1024)
    names = [k.name for k in am.backward]
    assert names.index("pv_bmm.dgrad") < names.index("softmax.bwd") < names.index("qk_bmm.dgrad")
    scores = 1 * m.heads * 1024 * 1024 * BF16
    c = price_block(am, STYLE, H200)
    assert c.bwd_transient_parts[0] == scores
    assert c.bwd_transient_bytes > 1.9 * scores


def test_router_logit_gradient_is_allocated_once_with_the_aux_loss() -> None:
    # The aux-loss branch's backward makes the logits' gradient; the routing branch's is then
    # accumulated into it (torch autograd's InputBuffer): one tokens x experts fp32 tensor.
    m = ModelSpec.from_ref("qwen3-30b-a3b", 4096)
    assert m.moe is not None
    tokens = 4096
    e = m.moe.experts
    for aux, fused in ((True, True), (True, False), (False, True), (False, False)):
        router = moe_layer_ops(m, MoELayout(aux_loss=aux, router_fusion=fused), tokens).router
        glog = [t for k in router.backward for t in k.writes if t.name.endswith("g_logits")]
        assert glog and {t.nbytes for t in glog} == {tokens * e * FP32}
        c = price_block(router, STYLE, H200)
        assert c.bwd_transient_bytes >= tokens * e * FP32


@pytest.mark.parametrize("fp8", [None, "delayed"])
def test_megatron_wgrads_accumulate_into_main_grad(fp8) -> None:
    # gradient_accumulation_fusion (Megatron-Core tensor_parallel/layers.py,
    # wgrad_gemm_accum_fp32; TE fuse_wgrad_accumulation, GroupedLinear too): every wgrad GEMM
    # adds into the persistent fp32 main_grad, which the framework counts as "gradients"; the
    # block's backward allocates none of it. GPT-OSS-120B's head with TE's loss on the B200
    # row: nothing of vocabulary size is new in backward, only the bf16 gradient of the
    # hidden states (tokens x hidden); the output layer's main_grad (vocab x hidden x 4,
    # 2.2 GiB) counted before.
    m = ModelSpec.from_ref("gpt-oss-120b", 4096)
    lay = MegatronLayout(tp=1, cross_entropy="te", fp8=fp8)
    blocks = [head_block(m, lay, 4, 4096)]
    blocks.append(moe_layer_ops(m, MoELayout(ep=8, fp8=fp8), 4 * 4096).experts)
    for blk in blocks:
        wgrads = [k for k in blk.backward if k.name.endswith(".wgrad")]
        assert wgrads
        for k in wgrads:
            assert k.writes[0] in blk.weight_grads and any(t is k.writes[0] for t in k.reads)
    c = price_block(blocks[0], STYLE, ComputeModel(catalog.gpu("b200")))
    assert c.bwd_transient_bytes == 4 * 4096 * m.hidden * BF16


def test_wgrads_accumulate_in_the_main_grads_own_dtype() -> None:
    # With grad_reduce_in_fp32 false Megatron's main_grad buffers are 16-bit, and the fused
    # wgrad GEMM adds into them as they are (wgrad_gemm_accum_fp16; TE GroupedLinear's
    # fuse_wgrad_accumulation writes its main_grad's dtype): 2 bytes an element, not 4, for
    # every wgrad's accumulation target, dense, expert and router alike.
    m = ModelSpec.from_ref("qwen3-30b-a3b", 4096)

    def targets(nbytes: int) -> dict[str, float]:
        lay = MegatronLayout(tp=1, main_grad_bytes=nbytes)
        moe = moe_layer_ops(m, MoELayout(ep=8, main_grad_bytes=nbytes), 4096)
        blocks = [*megatron_blocks(m, lay, 1, 4096).values(), moe.experts, moe.router]
        return {k.writes[0].name: k.writes[0].nbytes for blk in blocks for k in blk.backward
                if k.klass == "gemm" and k.name.endswith(".wgrad")}

    fp32, bf16 = targets(FP32), targets(BF16)
    assert set(fp32) == set(bf16) and len(fp32) >= 6
    assert {"attn_main.qkv.main_grad", "moe_experts.fc1.main_grad",
            "moe_router.gate.main_grad"} <= set(fp32)
    assert all(bf16[k] * FP32 == fp32[k] * BF16 for k in fp32)
    qkv_out = (m.heads + 2 * m.kv_heads) * m.head_dim
    assert fp32["attn_main.qkv.main_grad"] == m.hidden * qkv_out * FP32


@pytest.mark.parametrize("main_bytes", [FP32, BF16])
def test_embedding_backward_moves_a_dense_gradient_into_main_grad(main_bytes: int) -> None:
    # F.embedding's backward zero-fills a bf16 gradient of the whole local table and adds the
    # tokens' rows in; Megatron-Core's DDP hook then adds it into main_grad (no fused
    # accumulation for embeddings): vocab x hidden x (2 + 2 + 2 x main_grad bytes) bytes,
    # plus the rows (the output gradient read, the table's rows written), every micro-batch.
    # The dense gradient is a transient of the backward; main_grad is the framework's.
    m = ModelSpec.from_ref("llama3-8b", 8192)
    blk = embedding_block(m, MegatronLayout(tp=2, main_grad_bytes=main_bytes), 1, 8192)
    vocab = padded_vocab(m, 2) // 2
    rows = 8192 * m.hidden * BF16
    table = vocab * m.hidden
    moved = sum(k.nbytes for k in blk.backward)
    ids = 8192 * 8
    assert moved == table * (BF16 + BF16 + 2 * main_bytes) + 2 * rows + ids
    c = price_block(blk, STYLE, H200)
    assert c.bwd_transient_bytes >= table * BF16
