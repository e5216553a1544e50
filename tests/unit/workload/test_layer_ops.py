"""Per-block kernels: FLOPs, saved activations and the effect of compile, by closed forms."""

from __future__ import annotations

import pytest

from sim import catalog
from sim.hardware.compute import ComputeModel
from sim.workload.layer_ops import (
    Style,
    attention_block,
    head_block,
    mlp_block,
    model_blocks,
    price_block,
)
from sim.workload.model import ModelSpec

M = ModelSpec.from_ref("llama3.2-1b")
B, S = 2, 1024
T = B * S
H200 = ComputeModel(catalog.gpu("h200"))


def test_forward_gemm_and_attention_flops() -> None:
    # Linear layers: 2 x tokens x weights; causal attention forward: 2 x B x S^2 x q_dim.
    a = attention_block(M, Style("bf16"), B, S, kv_cache=False)
    m = mlp_block(M, Style("bf16"), B, S)
    h, q, kv, f = M.hidden, M.q_dim, M.kv_dim, M.ffn_hidden
    assert a.flops_fwd == pytest.approx(2 * T * (h * q + 2 * h * kv + q * h) + 2 * B * S * S * q)
    assert m.flops_fwd == pytest.approx(2 * T * 3 * h * f)
    # Backward: dgrad + wgrad per linear (2x forward), attention backward 2.5x forward.
    assert a.flops_bwd == pytest.approx(2 * 2 * T * (h * q + 2 * h * kv + q * h)
                                        + 2.5 * 2 * B * S * S * q)


def test_saved_activations_autocast_match_hugging_face_autograd() -> None:
    # HF Llama under autocast (fp32 residual): per token and layer, the norms save their fp32
    # input and normalised value (2 x 8h), each of q/k/v casts its own bf16 input (3 x 2h),
    # SDPA saves q (2q), k and v (2 x 2kv) and its output (2q), the MLP casts (2 x 2h),
    # gate, silu, up and their product (4 x 2f): 30h + 4kv + 8f with q = h, plus per-row
    # rsqrt (2 x 4) and SDPA's logsumexp (4 x heads).
    st = Style("autocast")
    a = attention_block(M, st, B, S, kv_cache=True)
    m = mlp_block(M, st, B, S)
    h, kv, f = M.hidden, M.kv_dim, M.ffn_hidden
    saved = sum(t.nbytes for t in a.saved + m.saved)
    small = T * (2 * 4 + 4 * M.heads)
    assert saved == pytest.approx(T * (30 * h + 4 * kv + 8 * f) + small)
    # The KV cache copies k (fp32 after RoPE) and v (bf16) and keeps them until forward ends.
    assert sum(t.nbytes for t in a.forward_scoped) == pytest.approx(T * kv * (4 + 2))
    # Every weight cast once per forward to bf16 (2 bytes per parameter).
    assert sum(t.nbytes for t in a.weight_casts + m.weight_casts) == pytest.approx(
        2 * (M.layer_params - 2 * h))


def test_saved_activations_bf16_torchtitan() -> None:
    # bf16 residual: norm input and output shared by the projections (2 x (2h + 2h)),
    # q and k after RoPE, v, the attention output (2q + 4kv + 2q), 4 MLP tensors (8f).
    st = Style("bf16")
    a = attention_block(M, st, B, S, kv_cache=False)
    m = mlp_block(M, st, B, S)
    h, q, kv, f = M.hidden, M.q_dim, M.kv_dim, M.ffn_hidden
    saved = sum(t.nbytes for t in a.saved + m.saved)
    small = T * (2 * 4 + 4 * M.heads)
    assert saved == pytest.approx(T * (8 * h + 4 * q + 4 * kv + 8 * f) + small)
    assert not a.weight_casts and not a.forward_scoped


def test_loss_memory_holds_three_fp32_logit_tensors_in_backward() -> None:
    # nll_loss backward writes a [T, V] fp32 gradient, log_softmax backward another, while the
    # saved log_softmax output is still held: 3 x 4 x T x V at the peak.
    blk = head_block(M, Style("autocast"), B, S)
    cost = price_block(blk, Style("autocast"), H200)
    tv4 = 4.0 * T * M.vocab
    assert cost.bwd_transient_bytes == pytest.approx(2 * tv4, rel=0.02)
    assert cost.saved_bytes >= tv4
    # Forward: bf16 logits (kept to the end of forward) and their fp32 copy.
    assert cost.forward_scoped_bytes == pytest.approx(2.0 * T * M.vocab)


def test_compile_fuses_memory_bound_kernels_but_not_gemms() -> None:
    eager = Style("autocast")
    compiled = Style("autocast", compile=True)
    blk = mlp_block(M, eager, B, S)
    e = price_block(blk, eager, H200)
    c = price_block(blk, compiled, H200)
    assert c.fwd_kernels < e.fwd_kernels and c.bwd_kernels < e.bwd_kernels
    assert c.fwd_s < e.fwd_s and c.bwd_s < e.bwd_s
    gemm_time = sum(H200.gemm_time(k.gemm[0], k.gemm[1], k.gemm[2], k.gemm[3])
                    for k in blk.forward if k.gemm)
    assert c.fwd_s > gemm_time     # GEMMs are untouched; only elementwise time went away


def test_recompute_stops_early_after_last_saved_tensor() -> None:
    # torch.utils.checkpoint (non-reentrant) stops recomputing once the last saved tensor is
    # rebuilt: in the MLP block that skips the down projection and the residual add.
    st = Style("autocast")
    blk = mlp_block(M, st, B, S)
    c = price_block(blk, st, H200)
    down = [k for k in blk.forward if k.name == "down.fwd"][0]
    assert c.early_stop_fwd_s < c.fwd_s
    assert c.fwd_s - c.early_stop_fwd_s >= H200.gemm_time(*down.gemm)


def test_block_params_sum_to_the_model() -> None:
    for st in (Style("autocast"), Style("bf16")):
        e, a, m, h = model_blocks(M, st, 1, 128, False)
        assert e.params + M.layers * (a.params + m.params) + h.params == M.total_params


def test_a_compiled_autocast_graph_casts_each_input_once() -> None:
    """Eager autocast casts the fp32 norm output once per linear that reads it (q, k, v; gate,
    up); a compiled graph's common-subexpression elimination keeps one cast, saved once."""
    import functools

    from sim.workload.kernels import Style
    from sim.workload.layer_ops import attention_block, mlp_block

    m = ModelSpec.from_ref("llama3.2-1b")

    def casts_and_saved(compiled: bool, block) -> tuple[int, float]:  # noqa: ANN001
        b = block(m, Style("autocast", compile=compiled), 1, 1024)
        casts = [k for k in b.forward if k.name.endswith(".in_bf16")]
        return len(casts), sum(t.nbytes for t in b.saved if t.name.endswith(".in_bf16"))

    attn = functools.partial(attention_block, kv_cache=False)
    for block, readers in ((attn, 3), (mlp_block, 2)):
        (eager_casts, eager_saved), (compiled_casts, compiled_saved) = (
            casts_and_saved(False, block), casts_and_saved(True, block))
        assert (eager_casts, compiled_casts) == (readers, 1)
        # The bf16 copy of the [1024, hidden] input, saved once instead of `readers` times.
        assert eager_saved - compiled_saved == pytest.approx((readers - 1) * 1024 * m.hidden * 2)


def test_a_compiled_mlp_saves_its_inputs_and_recomputes_the_silu() -> None:
    """AOTAutograd's partitioner saves gate and up and recomputes silu(gate) in the backward's
    fused kernel (the H200's fused forward wrote the product alone): the SiLU output is not
    saved, and the compiled forward's fused kernel moves gate, up and the product only."""
    from sim.workload.block_pricing import _fuse, _needed_outside
    from sim.workload.kernels import Style
    from sim.workload.layer_ops import mlp_block

    m = ModelSpec.from_ref("llama3.2-1b")
    tokens = 4 * 4096
    eager = mlp_block(m, Style("hf_bf16"), 4, 4096)
    compiled = mlp_block(m, Style("hf_bf16", compile=True), 4, 4096)
    assert "mlp.silu" in {t.name for t in eager.saved}
    assert "mlp.silu" not in {t.name for t in compiled.saved}
    fused = _fuse(compiled.forward, _needed_outside(compiled.forward, compiled), compiled)
    silu = next(k for k in fused if "silu" in k.name)
    assert silu.nbytes == pytest.approx(3 * tokens * m.ffn_hidden * 2)


def test_fused_cross_entropy_moves_the_logits_three_times_and_holds_no_fp32_copy() -> None:
    # flash-attn's xentropy (llm-foundry's loss_fn: fused_crossentropy): forward two passes
    # over each bf16 row (max, then sum of exponentials), backward one read and the bf16
    # gradient's write; saved: the bf16 logits and one fp32 log-sum-exp per token.
    st = Style("bf16", fused_loss=True)
    blk = head_block(M, st, B, S)
    tv2 = 2.0 * T * M.vocab
    loss_fwd = [k for k in blk.forward if k.name.startswith("xentropy")]
    loss_bwd = [k for k in blk.backward if k.name.startswith("xentropy")]
    assert [k.name for k in loss_fwd + loss_bwd] == ["xentropy_fwd", "xentropy_bwd"]
    assert sum(t.nbytes for t in loss_fwd[0].reads) == pytest.approx(2 * tv2)
    assert sum(t.nbytes for t in loss_bwd[0].reads) == pytest.approx(tv2 + 4.0 * T)
    assert sum(t.nbytes for t in loss_bwd[0].writes) == pytest.approx(tv2)
    assert not any(t.nbytes >= 4.0 * T * M.vocab for t in blk.saved)
    fused, eager = (price_block(head_block(M, s, B, S), s, H200)
                    for s in (st, Style("bf16")))
    assert fused.fwd_s < eager.fwd_s and fused.bwd_s < eager.bwd_s
    assert fused.bwd_transient_bytes < eager.bwd_transient_bytes
    assert fused.saved_bytes < eager.saved_bytes


def test_bf16_cross_entropy_streams_the_bf16_logits_without_an_fp32_copy() -> None:
    # NeMo AutoModel's MaskedCrossEntropy(fp32_upcast=False): F.cross_entropy on the bf16
    # logits. log_softmax reads each row three times and writes a bf16 row; backward the
    # nll gradient's zeros and the log_softmax backward (its gradient twice and the output
    # once), straight into the logits' bf16 gradient. torchtitan's .float() path streams
    # the same passes over fp32 rows plus two casts: exactly twice the bytes and more.
    tv2 = 2.0 * T * M.vocab
    blk = head_block(M, Style("bf16", bf16_loss=True), B, S)
    loss_fwd = [k for k in blk.forward if k.name in ("log_softmax", "logits_float")]
    assert [k.name for k in loss_fwd] == ["log_softmax"]
    assert loss_fwd[0].nbytes == pytest.approx(4 * tv2)
    loss_bwd = [k for k in blk.backward if k.name.startswith("g_")]
    assert [k.name for k in loss_bwd] == ["g_nll", "g_log_softmax"]
    assert sum(k.nbytes for k in loss_bwd) == pytest.approx(tv2 + 4 * tv2)
    assert max(t.nbytes for t in blk.saved) == pytest.approx(tv2)
    eager = head_block(M, Style("bf16"), B, S)
    up = sum(k.nbytes for k in eager.forward + eager.backward
             if k.name in ("log_softmax", "g_nll", "g_log_softmax"))
    assert up == pytest.approx(2 * (4 * tv2 + tv2 + 4 * tv2))
