"""Gradients linked by identity in the builder, as autograd passes them, and what
torch.compile's fusion then sees (sim.workload.layer_builder._Builder.finish)."""

from __future__ import annotations

from sim.workload.block_pricing import _fuse, _needed_outside
from sim.workload.kernels import BF16, FP32, Block, Kernel, Style
from sim.workload.layer_ops import attention_block, head_block, mlp_block
from sim.workload.model import ModelSpec

M = ModelSpec(name="tiny", layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64,
              ffn_hidden=512, vocab=1000)


def kernel(block: Block, name: str) -> Kernel:
    return next(k for k in block.backward if k.name == name)


def test_one_gradient_is_one_tensor_on_both_sides():
    """SDPA's query gradient, cast back to fp32 under autocast, is what RoPE's backward
    reads; RoPE's input gradient is what the q projection's dgrad reads."""
    b = attention_block(M, Style("autocast"), 2, 64, kv_cache=False)
    cast = kernel(b, "sdpa.g_q_fp32").writes[0]
    assert any(t is cast for t in kernel(b, "rope_q.g_mul_cos").reads)
    rope_in = kernel(b, "rope_q.g_sum").writes[0]
    assert any(t is rope_in for t in kernel(b, "q.dgrad").reads)


def test_the_sums_add_the_parts_into_what_the_producer_reads():
    """The three projections' fp32 input gradients are summed into the gradient RMSNorm's
    backward reads; the residual's gradient and the norm's input gradient into the block
    input's."""
    b = attention_block(M, Style("autocast"), 2, 64, kv_cache=False)
    parts = {id(kernel(b, f"{p}.g_in_fp32").writes[0]) for p in "qkv"}
    s0, s1 = kernel(b, "norm_out.g_sum0"), kernel(b, "norm_out.g_sum1")
    assert {id(t) for t in s0.reads + s1.reads} - {id(s0.writes[0])} == parts
    assert s1.writes[0] is kernel(b, "norm.g_mul_w").reads[0]
    resid = kernel(b, "resid_in.g_sum0")
    branch = kernel(b, "resid.g_branch_bf16").reads[0]      # the block output's gradient
    norm_in = kernel(b, "norm.g_sum").writes[0]
    assert {id(t) for t in resid.reads} == {id(branch), id(norm_in)}


def test_compiled_norm_backward_fuses_the_sums_around_it():
    """Inductor fuses the gradient sums with the norm's backward they feed and with the
    residual's sum after it (measured: one ``triton_per_fused_..._add_..._pow_sum`` kernel
    per norm on the lent H200), where separate tensors kept them apart."""
    for build in (attention_block, mlp_block):
        b = build(M, Style("autocast", compile=True), 2, 64, kv_cache=False) \
            if build is attention_block else build(M, Style("autocast", compile=True), 2, 64)
        fused = _fuse(b.backward, _needed_outside(b.backward, b), b)
        norm = next(k for k in fused if "norm.g_mul_a" in k.name)
        assert "norm_out.g_sum0" in norm.name and "resid_in.g_sum0" in norm.name


def test_compiled_loss_saves_the_bf16_logits_not_an_fp32_log_softmax():
    """Compiled cross-entropy keeps the graph's bf16 logits and each row's log-sum-exp for
    the backward; eager keeps the fp32 log-softmax (twice the bytes)."""
    tokens = 2 * 64
    eager = head_block(M, Style("autocast"), 2, 64)
    compiled = head_block(M, Style("autocast", compile=True), 2, 64)
    saved = {t.name: t.nbytes for t in compiled.saved}
    assert saved["head.lm_head.out"] == tokens * M.vocab * BF16
    assert saved["head.logsumexp"] == tokens * FP32
    assert "head.log_softmax" not in saved
    assert {t.name: t.nbytes for t in eager.saved}["head.log_softmax"] == tokens * M.vocab * FP32
