"""Transformer Engine's block-scaled FP8 recipes (Megatron's ``--fp8-recipe mxfp8`` and
``blockwise``) against what TE's source and NVIDIA's published figures say.

Truths used (sources, not the simulator):

* MXFP8 (OCP Microscaling Formats v1.0): one E8M0 scale byte per 32 elements; TE's 1x128
  blocks (``Float8BlockScaling``): one fp32 per 128. Either way 1/32 byte an element and layout.
* The scales run along a GEMM's reduction dimension, so ``MXFP8Quantizer`` and
  ``Float8BlockQuantizer`` write a row-wise and a column-wise copy (``columnwise_usage``) even
  on Blackwell, where per-tensor FP8 needs only the row-wise data; neither takes an amax pass
  (the scales are local to a block).
* ``multi_tensor_quantize_impl`` (``pytorch/csrc/extensions/cast.cpp``) has a fused
  multi-tensor kernel only for the delayed recipe: a grouped linear quantizes each expert's
  split in a launch of its own under the block recipes.
* ``get_fp8_align_size`` (Megatron-Core ``fp8_utils.py``): MXFP8 pads each expert's rows to
  32, every other recipe to 16.
* DeepSeek-V3 technical report (arXiv 2412.19437, sec. 3.3.2): on Hopper a block-scaled FP8
  GEMM promotes its partial sums to FP32 on the CUDA cores every 128 reduction elements;
  cuBLAS 12.9 (NVIDIA blog, 2025): block-scaled FP8 on Hopper reaches "a 1.75x speedup for
  large matmuls ... compared to the BF16 baseline"; Blackwell's tensor cores apply MX scales
  at the FP8 rate.
* TE's ``check_mxfp8_support``: compute capability 10.0 or later.
"""

from __future__ import annotations

import pytest

from sim import catalog
from sim.hardware.compute import BLACKWELL_BLOCK_SCALED_SLOWDOWN, ComputeModel
from sim.scenario import ScenarioError, scenario_from_dict
from sim.workload.block_pricing import kernel_time
from sim.workload.kernels import Kernel
from sim.workload.megatron_ops import MegatronLayout, mlp_block
from sim.workload.model import ModelSpec
from sim.workload.moe_ops import MoELayout, moe_layer_ops

SCALE_SHARE = 1 / 32        # scale bytes per element and layout (both block recipes)


def _fc1(recipe: str, both: bool) -> tuple[list[Kernel], list[Kernel], list]:
    m = ModelSpec.from_ref("llama3-8b")
    _, main = mlp_block(m, MegatronLayout(tp=1, fp8=recipe, fp8_transpose=both), 1, 4096)  # type: ignore[arg-type]
    return main.forward, main.backward, main.saved


@pytest.mark.parametrize("recipe", ["mxfp8", "blockwise"])
def test_block_recipes_quantize_once_into_both_layouts_with_scales(recipe: str) -> None:
    fwd, bwd, saved = _fc1(recipe, both=True)
    assert not [k for k in fwd + bwd if ".amax_" in k.name]      # no amax pass, no all-reduce
    cast = next(k for k in fwd if k.name == "fc2.cast_in")
    assert cast.launches == 1 and len(cast.writes) == 2            # row-wise and column-wise
    src = cast.reads[0]
    for out in cast.writes:
        assert out.nbytes == pytest.approx(src.nbytes / 2 * (1 + SCALE_SHARE))
    # What backward keeps of fc2's input: its column-wise copy, scales included.
    kept = next(t for t in saved if t.name.endswith("fc2.in_fp8_t"))
    assert kept.nbytes == pytest.approx(src.nbytes / 2 * (1 + SCALE_SHARE))
    gemms = [k for k in fwd + bwd if k.klass == "gemm" and k.fp8]
    assert gemms and all(k.fp8_block for k in gemms)


def test_tensorwise_keeps_per_tensor_scales() -> None:
    fwd, bwd, _ = _fc1("tensorwise", both=False)
    cast = next(k for k in fwd if k.name == "fc2.cast_in")
    assert len(cast.writes) == 1 and cast.writes[0].nbytes == cast.reads[0].nbytes / 2
    assert not any(k.fp8_block for k in fwd + bwd)


@pytest.mark.parametrize(("recipe", "align"), [("mxfp8", 32), ("blockwise", 16)])
def test_grouped_linear_quantizes_each_expert_and_pads_to_the_recipe(recipe: str,
                                                                     align: int) -> None:
    m = ModelSpec.from_ref("qwen3-30b-a3b")
    lay = MoELayout(ep=8, fp8=recipe, fp8_transpose=True)  # type: ignore[arg-type]
    ops = moe_layer_ops(m, lay, tokens=4096)
    ks = ops.experts.forward
    local = m.moe.experts // 8
    cast = next(k for k in ks if k.name == "fc1.cast_in")
    assert cast.launches == local                                 # one launch per split
    gemm = next(k for k in ks if k.name == "fc1.fwd")
    # Each expert's routed rows padded to the recipe's alignment, in expectation: about half
    # of it where the count's spread (here ~44 rows) exceeds it.
    share = 4096 * 8 * 8 / m.moe.experts
    assert all(share + (align - 1) / 2 - 1 < c < share + align for c in gemm.group)
    assert gemm.fp8_block


def test_block_scaled_gemm_promotes_on_hopper_only() -> None:
    # Hopper: the CUDA cores add each 128-deep partial sum (DeepSeek-V3 report, sec. 3.3.2),
    # one FP32 FMA per 256 FP8 FLOPs: 1 + 1,979 / (128 x 66.9) on the tensor-core term
    # (datasheet rates). cuBLAS 12.9's blog: block scaling gains at most 1.75x over BF16.
    cm = ComputeModel(catalog.gpu("h100-sxm"))
    shape = (8192.0, 8192, 8192, "fwd")

    def t(**kw: bool) -> float:
        return kernel_time(cm, Kernel("g.fwd", "gemm", flops=2 * 8192**3, gemm=shape, **kw))
    bf16, tensorwise, blockwise = t(), t(fp8=True), t(fp8=True, fp8_block=True)
    assert tensorwise < blockwise < bf16
    assert bf16 / blockwise <= 1.75
    assert cm._accumulation("dgrad", True) == pytest.approx(1 + 1978.9 / (128 * 66.9))
    # Blackwell applies MX scales in its tensor cores: no promotion, only the measured cost
    # of staging the scales (TE's B300 table, 5%), far under Hopper's 23%.
    bw = ComputeModel(catalog.gpu("b200"))
    mx = kernel_time(bw, Kernel("g.fwd", "gemm", flops=2 * 8192**3, gemm=shape, fp8=True,
                                fp8_block=True))
    per_tensor = kernel_time(bw, Kernel("g.fwd", "gemm", flops=2 * 8192**3, gemm=shape,
                                        fp8=True))
    assert per_tensor < mx <= per_tensor * BLACKWELL_BLOCK_SCALED_SLOWDOWN
    assert BLACKWELL_BLOCK_SCALED_SLOWDOWN < cm._accumulation("fwd", True)



def test_hopper_wgrad_promotes_each_element_with_its_own_scale() -> None:
    # wgrad reduces over tokens, along which both of its operands (the output gradient and
    # the input, 1x128 blocks each) carry a scale per row: each output element's scale is a
    # product of its own, a multiply before the multiply-add (two FP32 ops per 256 FP8
    # FLOPs); the forward and dgrad GEMMs scale by a weight block shared by 128 columns.
    cm = ComputeModel(catalog.gpu("h100-sxm"))
    one = 1978.9 / (128 * 66.9)
    assert cm._accumulation("fwd", True) == pytest.approx(1 + one)
    assert cm._accumulation("wgrad", True) == pytest.approx(1 + 2 * one)
    # So against its own 16-bit pass, a blockwise wgrad gains less than the forward does,
    # by less than the factors' ratio (the fixed and per-tile terms do not change);
    # DeepGEMM's 1-D x 1-D wgrad kernel runs at 878-1,092 TFLOP/s on H800 (deepseek-ai/
    # DeepGEMM PR 95) against 1,166-1,470 for its 1-D x 2-D GEMMs (PR 74): 0.6-0.94 of
    # their rate.
    dims = 8192.0

    def share(pass_: str) -> float:
        return (cm.gemm_time(dims, dims, dims, pass_, fp8=True, block_scaled=True)  # type: ignore[arg-type]
                / cm.gemm_time(dims, dims, dims, pass_))  # type: ignore[arg-type]
    assert 1.0 < share("wgrad") / share("fwd") < (1 + 2 * one) / (1 + one)
    assert 0.6 < share("fwd") / share("wgrad") < 0.94
    # Per-tensor FP8 has no promotion of its own: its wgrad pays the split accumulation.
    assert cm._accumulation("wgrad", False) == cm._accumulation("dgrad", False)

def _megatron(topology: str, recipe: str) -> dict:
    return {"name": "fp8", "model": "llama3-8b", "cluster": {"topology": topology, "nodes": 1},
            "framework": {"name": "megatron", "fp8_recipe": recipe},
            "parallelism": {"tp": 1, "pp": 1},
            "training": {"seq_len": 4096, "micro_batch_size": 1, "global_batch_size": 8,
                         "precision": "fp8"}}


def test_mxfp8_needs_blackwell() -> None:
    from sim.api import simulate
    with pytest.raises(ScenarioError, match="framework.fp8_recipe.*Blackwell"):
        simulate(scenario_from_dict(_megatron("dgx-h100", "mxfp8")))
    assert simulate(scenario_from_dict(_megatron("dgx-b200", "mxfp8"))).summary["step_time_s"] > 0


def test_mxfp8_primary_weights_gather_in_16_bits_and_hold_both_layouts() -> None:
    """Megatron-Bridge's ``bf16_with_mxfp8_mixed`` sets ``fp8_param_gather`` with
    ``reuse_grad_buf_for_mxfp8_param_ag``: the 16-bit values are all-gathered into the gradient
    buffer and cast into the ``MXFP8Tensor`` parameter (both layouts, scales included) as they
    are copied out (Megatron-Core ``param_and_grad_buffer.py``); a per-tensor FP8 primary
    weight is gathered as its 1-byte data."""
    from sim.frameworks import JobContext
    from sim.frameworks.megatron.shape import megatron_shape

    def shape(recipe: str):
        sc = _megatron("dgx-b200", recipe)
        sc["cluster"]["nodes"] = 2
        sc["framework"].update(fp8_param_gather=True, distributed_optimizer=True)
        sc["training"]["global_batch_size"] = 16
        return megatron_shape(JobContext.from_scenario(scenario_from_dict(sc), "test"))

    mx, tw = shape("mxfp8"), shape("tensorwise")
    assert mx.gather_bytes(0, expert=False) == 2.0
    assert tw.gather_bytes(0, expert=False) < 2.0
    lin = mx.stage_fp8_params(0)
    other = mx.stage_params(0) - lin
    mem = mx.initial_memory(0)
    assert mem["parameters"] == pytest.approx(2 * other + 2 * (1 + SCALE_SHARE) * lin)
    assert mem["buffers"] == 0.0
    assert tw.initial_memory(0)["parameters"] == pytest.approx(2 * other + lin)
