"""The routed experts on Transformer Engine's operation fuser (``MoELayout.te_ops``) and its
fused grouped MLP (``MoELayout.fused_glu``), :mod:`sim.workload.moe_grouped_mlp`.

Independent truths: TE's GroupedTensor path runs each grouped GEMM as one kernel over every
local expert's rows (``general_grouped_gemm_for_grouped_tensor``) and quantizes each input in
one ``group_quantize`` launch, with 256-row expert segments (Megatron-Core
``get_align_size_for_quantization``); the fused grouped MLP (TE ``ops/fused/grouped_mlp.py``)
puts the SwiGLU-times-prob and its quantization in fc1's epilogue and their backward in fc2's
dgrad epilogue, so exactly four kernels of the unfused path disappear and nothing saved for
the backward changes (conservation of the saved bytes).
"""

from __future__ import annotations

import pytest

from sim import catalog
from sim.hardware.compute import KERNEL_BOUNDARY_S, ComputeModel
from sim.workload.block_pricing import kernel_time, price_block
from sim.workload.model import ModelSpec
from sim.workload.moe_ops import GROUPED_TENSOR_ALIGN, STYLE, MoELayout, moe_layer_ops

M = ModelSpec.from_ref("qwen3-30b-a3b")
TOKENS = 8192


def _experts(**kw: object):
    lay = MoELayout(ep=8, fp8="mxfp8", permute="te", gemm_per_expert=True, **kw)
    return moe_layer_ops(M, lay, tokens=TOKENS).experts


def test_grouped_tensor_gemms_are_one_kernel_over_all_rows() -> None:
    cm = ComputeModel(catalog.gpu("gb200"))
    blk = _experts(te_ops=True)
    rows = TOKENS * M.moe.top_k
    gemms = [k for k in (*blk.forward, *blk.backward) if k.klass == "gemm"]
    assert len(gemms) == 6
    for k in gemms:
        assert k.group == () and k.launches == 1
        m, kk, n, p = k.gemm
        # Each expert's routed rows padded to its 256-row segment, in expectation.
        local = M.moe.experts // 8
        assert rows < m < rows + local * GROUPED_TENSOR_ALIGN
        assert kernel_time(cm, k) >= cm.gemm_time(m, kk, n, p, fp8=True, block_scaled=True)
    casts = [k for k in blk.forward if ".cast_in" in k.name]
    assert casts and all(k.launches == 1 for k in casts)   # group_quantize
    # The multi-stream path issues one cuBLASLt GEMM per local expert (16 here).
    per_expert = [k for k in _experts().forward if k.klass == "gemm"]
    assert all(k.launches == M.moe.experts // 8 for k in per_expert)


def test_fused_glu_drops_exactly_the_activation_and_its_casts() -> None:
    plain = _experts(te_ops=True)
    fused = _experts(te_ops=True, fused_glu=True)
    names = lambda ks: {k.name for k in ks}  # noqa: E731
    assert names(plain.forward) - names(fused.forward) == {"weighted_act", "fc2.cast_in"}
    assert names(plain.backward) - names(fused.backward) == {"weighted_act.bwd", "fc1.cast_g"}
    assert not names(fused.forward) - names(plain.forward)
    assert not names(fused.backward) - names(plain.backward)
    cm = ComputeModel(catalog.gpu("gb200"))
    a, b = price_block(plain, STYLE, cm), price_block(fused, STYLE, cm)
    assert b.saved_bytes == a.saved_bytes           # fc1's output, probs, both FP8 inputs
    assert b.flops_fwd == a.flops_fwd and b.flops_bwd == a.flops_bwd
    # each removed kernel's own time and the stream's idle moment after it
    removed_f = sum(kernel_time(cm, k) + KERNEL_BOUNDARY_S for k in plain.forward
                    if k.name in ("weighted_act", "fc2.cast_in"))
    assert a.fwd_gpu_s - b.fwd_gpu_s == pytest.approx(removed_f, rel=1e-9)
    assert b.bwd_gpu_s < a.bwd_gpu_s


def test_gpt_oss_clamped_biased_glu_runs_as_te_ops() -> None:
    # Under the fuser GPT-OSS's clamped quick-GEGLU is TE's ScaledClampedQGeGLU (one kernel,
    # no eager clamps) and fc2's bias is GroupedLinear's (no eager per-expert _apply_bias);
    # the fused MLP folds the activation into the epilogues as for SwiGLU (TE
    # fuse_grouped_mlp_ops' activation_op_types). A bf16 run keeps its activation kernel.
    oss = ModelSpec.from_ref("gpt-oss-120b")

    def names(**kw: object) -> set[str]:
        lay = MoELayout(ep=8, permute="te", **kw)
        blk = moe_layer_ops(oss, lay, tokens=4096).experts
        return {k.name for k in (*blk.forward, *blk.backward)}

    eager = names(fp8="mxfp8")
    assert any("clamp" in n for n in eager) and any("apply_bias" in n for n in eager)
    ops = names(fp8="mxfp8", te_ops=True)
    assert not any("clamp" in n or "apply_bias" in n for n in ops)
    assert {"weighted_act", "fc1.g_bias", "fc2.g_bias"} <= ops
    fused = names(fp8="mxfp8", te_ops=True, fused_glu=True)
    assert ops - fused == {"weighted_act", "weighted_act.bwd", "fc2.cast_in", "fc1.cast_g"}
    assert "weighted_act" in names(te_ops=True, fused_glu=True)


@pytest.mark.parametrize(("copies", "align"), [(8192, 256), (1024, 256), (1024, 16), (300, 32)])
def test_expected_padding_matches_sampled_binomial_counts(copies, align) -> None:
    # Forced-balance routing draws each token's top-k among E experts at random: an expert's
    # count is binomial (n tokens x sources, p = k / E). The closed form must match the
    # average padded count of seeded draws (a Monte Carlo mean, 4 standard errors).
    import numpy as np

    from sim.workload.moe_ops import expected_aligned_rows

    k, e = 8, 128
    n = int(copies * e / k)
    draws = np.random.default_rng(7).binomial(n, k / e, size=200_000)
    padded = np.ceil(draws / align) * align
    expected = expected_aligned_rows(copies, align, copies * (1 - k / e))
    assert expected == pytest.approx(padded.mean(), abs=4 * padded.std() / 447)


def test_capacity_padded_counts_are_not_padded_again() -> None:
    # Drop-and-pad fixes every expert at its capacity: no variance, nothing to add.
    from dataclasses import replace

    lay = MoELayout(ep=8, fp8="tensorwise", permute="te", token_drop="pad")
    m = ModelSpec.from_ref("mixtral-8x7b")
    m = replace(m, moe=replace(m.moe, capacity_factor=1.0))
    rows = moe_layer_ops(m, lay, tokens=4096, tokens_per_expert=(8192.0,),
                         permuted_rows=8192.0).experts
    assert {k.gemm[0] for k in rows.forward if k.klass == "gemm"} == {8192.0}
