"""The linear and fused-norm rules of sim.workload.layer_rules, and the layer_ops import surface.

Independent truths: a linear layer's training FLOPs are 6 x tokens x parameters (2 forward,
4 backward: Kaplan et al., "Scaling Laws for Neural Language Models", 2020, section 2.1);
Transformer Engine's delayed scaling takes its scale from the amax history and adds no
reduction pass, current (tensorwise) scaling adds one per cast tensor
(transformer_engine/common/recipe: DelayedScaling vs Float8CurrentScaling).
"""

from __future__ import annotations

import pytest

from sim.workload import layer_ops
from sim.workload.layer_ops import Style, _Builder
from sim.workload.megatron_ops import MegatronLayout, _linear

T, N_IN, N_OUT = 1024.0, 512, 2048


def _gemms(b: _Builder):
    blk = b.finish()
    return [k for k in blk.forward + blk.backward if k.klass == "gemm"]


@pytest.mark.parametrize("style", [Style("bf16"), Style("autocast"), Style("hf_bf16"),
                                   Style("bf16", float8=True)])
def test_pytorch_linear_is_six_flops_per_token_and_parameter(style: Style) -> None:
    b = _Builder("blk", style)
    x = b.t("x", T * N_IN, style.act_bytes)
    b.linear(x, T, N_IN, N_OUT, "fc", bias=True)
    assert b.block.params == N_IN * N_OUT + N_OUT
    assert [k.name for k in _gemms(b)] == ["fc.fwd", "fc.dgrad", "fc.wgrad"]
    assert b.block.flops_fwd + b.block.flops_bwd == 6 * T * N_IN * N_OUT
    assert all(k.fp8 == style.float8 for k in _gemms(b))


@pytest.mark.parametrize("fp8", [None, "delayed", "tensorwise"])
def test_megatron_linear_shares_the_gemm_rule(fp8) -> None:
    b = _Builder("blk", Style("bf16"))
    x = b.t("x", T * N_IN, 2)
    _linear(b, x, T, N_IN, N_OUT, "fc", bias=False, lay=MegatronLayout(fp8=fp8))
    ref = _Builder("ref", Style("bf16"))
    ref.linear(ref.t("x", T * N_IN, 2), T, N_IN, N_OUT, "fc")
    # Same GEMMs (name, shape, FLOPs) as PyTorch's linear; only the operands' dtype differs.
    assert [(k.name, k.gemm, k.flops) for k in _gemms(b)] == \
        [(k.name, k.gemm, k.flops) for k in _gemms(ref)]
    names = [k.name for k in b.block.forward + b.block.backward]
    amax = [n for n in names if ".amax_" in n]
    # Current scaling reduces weight, input and output gradient once each; delayed, never.
    assert amax == (["fc.amax_w", "fc.amax_in", "fc.amax_g"] if fp8 == "tensorwise" else [])
    assert sum(".cast_" in n for n in names) == (0 if fp8 is None else 3)


def test_every_name_importers_use_is_still_on_layer_ops() -> None:
    # The split kept sim.workload.layer_ops as the import surface (grep of sim/, tests/, tools/).
    for name in ("BF16", "FP32", "IDX", "Block", "BlockCost", "Kernel", "SacCost", "Style",
                 "Tensor", "_Builder", "_fuse", "_needed_outside", "attention_block",
                 "embedding_block", "head_block", "is_reduction", "kernel_time", "mlp_block",
                 "model_blocks", "op_sac_costs", "price_block", "qkv_projections",
                 "mlp_projections"):
        assert hasattr(layer_ops, name), name
